#!/usr/bin/env bash
# Synchronous vs asynchronous standby, one run: the topology of
# deploy/cluster.sh with one kettle serve node, brought up twice (Patroni
# synchronous_mode true, then false), and against that node the same open-model
# load twice: single readings (v1, one reading a request) and batched uploads
# (v1, --batch 10). Prints, for each, acknowledged readings/s, the upload p50
# and p99, and the CPU seconds of every process (kettle serve, each
# PostgreSQL member with its backends, each Patroni, etcd, the swarm), then
# the sync/async ratios; appends one JSON line to bench/results.jsonl.
#
#   flock -w 900 /tmp/kettle-heavy.lock bench/ha-sync.sh
#
# Environment: DEVICES (2000), INTERVAL (2s), DURATION (30s), BATCH (10),
# KETTLE_HA_NET (127.0.44).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
# (one topology, synchronous, instead of both: bringing one up takes a minute)
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DURATION:=3s}" "${BATCH:=2}" "${MODES:=true}"
DEVICES=${DEVICES:-2000}
INTERVAL=${INTERVAL:-2s}
DURATION=${DURATION:-30s}
BATCH=${BATCH:-10}
export KETTLE_HA_NET=${KETTLE_HA_NET:-127.0.44}
export KETTLE_HA_NODES=1
export KETTLE_HA_SERVE_ARGS="--access-log-sample 0 --log-level warn"
out=$(mktemp -d /tmp/kha-bench-XXXX)
chmod 755 "$out" # Patroni runs as postgres and reads its files under it
bench_build "$out/kettle" ./cmd/kettle
export KETTLE_BIN=$out/kettle
trap 'deploy/cluster.sh down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

# cpu DIR: CPU seconds so far of each process of the topology, as JSON.
cpu() { rec topo-cpu "$1"; }

run() { # mode kind args…
	local mode=$1 kind=$2; shift 2
	local dir=$KETTLE_HA_DIR
	local before after
	before=$(cpu "$dir")
	"$KETTLE_BIN" swarm --target "http://$KETTLE_HA_NET.21:8080" --api v1 --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --data-dir "$dir/kettle1" --out "$out/$mode-$kind" --report=false --sample=false \
		--slo-p99 0 --max-error-rate -1 "$@" >"$out/$mode-$kind.log" 2>&1
	after=$(cpu "$dir")
	jq -c --argjson b "$before" --argjson a "$after" --arg mode "$mode" --arg kind "$kind" --arg primary "$(deploy/cluster.sh leader)" \
		'.totals as $t | {mode: $mode, kind: $kind, primary: $primary, acked_per_s: ($t.acked / $t.wall_seconds),
		upload_p50_ms: $t.endpoints.measurement.p50_ms, upload_p99_ms: $t.endpoints.measurement.p99_ms, errors: $t.errors,
		swarm_cpu_s: $t.cpu_seconds, lost: .audit.lost,
		cpu_s: ($a | with_entries(select(.key | endswith("_rss_bytes") | not) | .value = ((.value - ($b[.key] // 0)) * 100 | round / 100)))}' \
		"$out/$mode-$kind/results.json" >>"$out/rows.jsonl"
	tail -1 "$out/rows.jsonl"
}

MODES=${MODES:-true false} # Patroni's synchronous_mode, one topology each
for mode in $MODES; do
	export KETTLE_HA_DIR=$out/topo-$mode KETTLE_HA_SYNC=$mode
	deploy/cluster.sh up >/dev/null
	run "$mode" single
	run "$mode" batched --batch "$BATCH"
	deploy/cluster.sh down >/dev/null
done

cat "$out/rows.jsonl"
# The figure the run exists for first: the upload p99 of single readings
# with a synchronous standby, against an asynchronous one (its ceiling).
rec_begin ha-sync.sh "DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION BATCH=$BATCH bench/ha-sync.sh"
jq -rs 'def r3: . * 1000 | round / 1000;
	(map({key: "\(.mode)/\(.kind)", value: .}) | from_entries) as $by
	| "figure sync_single_upload_p99_ms=\($by["true/single"].upload_p99_ms | r3):ms",
	  if $by["false/single"] then
	    "ceiling async_single_upload_p99_ms=\($by["false/single"].upload_p99_ms | r3):ms",
	    "ratio \($by["true/single"].upload_p99_ms / ([$by["false/single"].upload_p99_ms, 1e-9] | max) | r3)"
	  else empty end,
	  (.[] | ((if .mode == "true" then "sync" else "async" end) + "_" + .kind) as $p
	   | "figure \($p)_acked_per_s=\(.acked_per_s | r3):readings/s",
	     "figure \($p)_upload_p50_ms=\(.upload_p50_ms | r3):ms",
	     (select($p != "sync_single") | "figure \($p)_upload_p99_ms=\(.upload_p99_ms | r3):ms"),
	     (.cpu_s | to_entries[] | "figure \($p)_cpu_\(.key)=\(.value):s")),
	  (["single", "batched"][] as $k | $by["true/" + $k] as $s | $by["false/" + $k] as $a | select($a)
	   | "figure \($k)_p99_sync_over_async=\($s.upload_p99_ms / ([$a.upload_p99_ms, 1e-9] | max) | r3):ratio",
	     "figure \($k)_p50_sync_over_async=\($s.upload_p50_ms / ([$a.upload_p50_ms, 1e-9] | max) | r3):ratio",
	     "figure \($k)_primary_cpu_sync_over_async=\(($s.cpu_s["postgres" + $s.primary[2:]] // 0) / ([$a.cpu_s["postgres" + $a.primary[2:]] // 0, 1e-9] | max) | r3):ratio")' \
	"$out/rows.jsonl" | rec_lines
grep -E 'over_async' "$KETTLE_REC_FIGS" || echo "(one topology, MODES=$MODES: no sync/async ratios)"
rec_end
