#!/usr/bin/env bash
# Sizing per 100,000 kettles, from measured per-kettle costs, one run: the
# topology of deploy/cluster.sh with one kettle serve node (Patroni, a
# synchronous and an asynchronous standby), DEVICES v1 kettles each sending
# a reading and polling its command every RUN_INTERVAL for DURATION. Before
# and after, it reads the CPU seconds of every process, the node's resident
# memory, the database's size and the WAL position, and records per kettle
# and interval (one reading and one poll):
#   - CPU-µs in kettle serve, in the primary's PostgreSQL (every backend,
#     walsender and worker), in each standby's;
#   - the node's memory per kettle (its RSS growth over the run ÷ kettles);
#   - disk per reading (the database's growth: table, indexes, rollups) and
#     WAL per reading (what each standby receives).
# The table "per 100,000 kettles" in docs/results.md (`make results`) is
# rendered from this record, at INTERVAL (the fleet's own interval, which
# the per-interval costs do not depend on); docs/operations.md explains it.
#
#   flock -w 2400 /tmp/kettle-heavy.lock bench/sizing.sh
#
# Environment: DEVICES (2000), RUN_INTERVAL (2s), DURATION (40s),
# INTERVAL (30s), KETTLE_HA_NET (127.0.44), SERVE_ARGS (more kettle serve
# flags), KETTLE_BIN (a prebuilt kettle; default: this tree's),
# PG_SET ("name=value …": PostgreSQL settings that need no restart, set on
# every member through Patroni before the run, e.g. wal_compression=off),
# NODES (1: kettle serve nodes, each loaded directly) and WORKERS (0: the
# fleet from kettle swarm worker processes, worker i loading node i mod
# NODES; a process holds at most 20,000 open files, so 100,000 kettles
# take six nodes and six workers), CHECKPOINT_AT (seconds into the run: a CHECKPOINT then, so that the run
# pays the full-page images of a checkpoint cycle, as a fleet does after
# every checkpoint; a 40 s run on a new database has almost none).
#
# PROFILE=DIR: where the time goes, into DIR (bench/lib/profile.sh): the
# primary restarted with pg_stat_statements before the run, then in the
# run's middle kettle serve's CPU profile and execution trace (off-CPU:
# `go tool trace -pprof=net|sync|syscall|sched`), `strace -c` of kettle
# serve and of the primary's processes, perf of the primary; after it the
# statements by time, pg_stat_wal and pg_waldump's WAL by record type over
# the run. Profiling costs CPU: the run's figures are not recorded.
#
# WAL_PROFILE=DIR: only where the run's WAL went, read after the run
# (bench/lib/profile.sh wal_profile: by record type, and by relation with
# each relation's record types), so the run is recorded as usual, with the
# WAL a reading of each table and index of the write path beside the
# figures (wal_RELATION_bytes_per_reading).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DURATION:=3s}"
DEVICES=${DEVICES:-2000}
RUN_INTERVAL=${RUN_INTERVAL:-2s}
DURATION=${DURATION:-40s}
INTERVAL=${INTERVAL:-30s}
export KETTLE_HA_NET=${KETTLE_HA_NET:-127.0.44}
NODES=${NODES:-1} WORKERS=${WORKERS:-0}
export KETTLE_HA_NODES=$NODES KETTLE_HA_SYNC=true
export KETTLE_HA_SERVE_ARGS="--access-log-sample 0 --log-level warn ${SERVE_ARGS:-}${PROFILE:+ --debug-addr $KETTLE_HA_NET.21:6060}"
out=$(mktemp -d /tmp/kha-size-XXXX)
chmod 755 "$out" # Patroni runs as postgres and reads its files under it
BIN_LABEL=${KETTLE_BIN:-}
if [ -n "${KETTLE_BIN:-}" ]; then cp "$KETTLE_BIN" "$out/kettle"; else bench_build "$out/kettle" ./cmd/kettle; fi
export KETTLE_BIN=$out/kettle
export KETTLE_HA_DIR=$out/topo
trap 'deploy/cluster.sh down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

deploy/cluster.sh up >/dev/null
leader=$(deploy/cluster.sh leader)
sync=$(deploy/cluster.sh sync)
# state: the processes' CPU and memory, the database's size, the WAL position.
state() {
	printf '{"cpu":%s,"db_bytes":%s,"wal_bytes":%s}\n' "$(rec topo-cpu "$KETTLE_HA_DIR")" \
		"$(deploy/cluster.sh psql -c "SELECT pg_database_size('kettle')")" \
		"$(deploy/cluster.sh psql -c "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")"
}
if [ -n "${PG_SET:-}" ]; then
	# shellcheck disable=SC2046
	"${KETTLE_HA_VENV:-.deps/venv-patroni}/bin/patronictl" -c "$KETTLE_HA_DIR/$leader.yml" edit-config --force $(printf -- '--pg %s ' $PG_SET) >/dev/null
	for kv in $PG_SET; do # Patroni reloads each member within its loop_wait
		for _ in $(seq 60); do [ "$(deploy/cluster.sh psql -c "SHOW ${kv%%=*}")" = "${kv#*=}" ] && break; sleep 0.5; done
		echo "PostgreSQL: $(deploy/cluster.sh psql -c "SELECT name || '=' || setting FROM pg_settings WHERE name = '${kv%%=*}'")"
	done
fi
[ -z "${PROFILE:-}" ] || { . bench/lib/profile.sh; profile_prepare; }
before=$(state)
echo "before: $before"
targets=$(for i in $(seq "$NODES"); do printf 'http://%s.2%s:8080\n' "$KETTLE_HA_NET" "$i"; done | paste -sd,)
lab=()
if [ "$WORKERS" -gt 0 ]; then
	lab=(--workers "$(deploy/cluster.sh workers "$WORKERS")" --worker-token-file "$KETTLE_HA_DIR/worker-token")
fi
"$KETTLE_BIN" swarm --target "$targets" "${lab[@]}" --api v1 --devices "$DEVICES" --interval "$RUN_INTERVAL" \
	--duration "$DURATION" --data-dir "$KETTLE_HA_DIR/kettle1" --out "$out/swarm" --report=false --sample=false \
	--slo-p99 0 --max-error-rate -1 >"$out/swarm.log" 2>&1 &
swarm=$!
[ -z "${CHECKPOINT_AT:-}" ] || { sleep "$CHECKPOINT_AT"; deploy/cluster.sh psql -c "CHECKPOINT" >/dev/null; }
[ -z "${PROFILE:-}" ] || profile_during
wait "$swarm"
# Autovacuum and the hint bits of the new rows land within a few seconds;
# a checkpoint writes them out, so the size counts what stays.
deploy/cluster.sh psql -c "CHECKPOINT" >/dev/null
after=$(state)
echo "after: $after (primary $leader, synchronous standby $sync)"
[ "$(deploy/cluster.sh leader)" = "$leader" ] || { echo "sizing.sh: the primary changed during the run" >&2; exit 1; }

[ -z "${PROFILE:-}" ] || profile_after "$before" "$after"
[ -z "${WAL_PROFILE:-}" ] || { . bench/lib/profile.sh; wal_profile "$WAL_PROFILE" "$before" "$after"; echo "WAL profile: $WAL_PROFILE"; cat "$WAL_PROFILE/wal-relations.txt"; }
[ -z "${PROFILE:-}" ] || export KETTLE_NO_RECORD=1 # profiled: printed, not recorded
rec_begin sizing.sh "NODES=$NODES WORKERS=$WORKERS DEVICES=$DEVICES RUN_INTERVAL=$RUN_INTERVAL DURATION=$DURATION INTERVAL=$INTERVAL${SERVE_ARGS:+ SERVE_ARGS=\"$SERVE_ARGS\"}${PG_SET:+ PG_SET=\"$PG_SET\"}${CHECKPOINT_AT:+ CHECKPOINT_AT=$CHECKPOINT_AT}${BIN_LABEL:+ KETTLE_BIN=$BIN_LABEL} bench/sizing.sh"
# A kettle's interval is one reading and one poll: readings acknowledged
# count the intervals (the polls are reported beside them). The figures the
# run exists for first: the CPU, memory and disk a kettle costs.
res=$out/swarm/results.json
jq -e '.totals as $t | $t.acked > 0 and ($t.errors <= 0.01 * ([$t.endpoints[].requests] | add)) and ((.audit.lost // 0) == 0)' "$res" >/dev/null ||
	{ echo "sizing.sh: the run is not a clean one to size from ($(jq -c '{acked: .totals.acked, errors: .totals.errors, audit, endpoints: [.totals.endpoints | to_entries[] | {(.key): (.value | with_entries(select(.key | test("error|status|timeout|refused|reset"))))}]}' "$res")); the swarm's log ends:" >&2
	  tail -n 25 "$out/swarm.log" >&2; tail -n 15 "$KETTLE_HA_DIR/kettle1.log" >&2; exit 1; }
interval_s=$(awk -v v="$INTERVAL" 'BEGIN { n = v + 0; u = substr(v, length(n "") + 1); print n * (u == "ms" ? 0.001 : u == "m" ? 60 : 1) }')
asyncn=$(for i in 1 2 3; do [ "pg$i" = "$leader" ] || [ "pg$i" = "$sync" ] || echo "$i"; done)
jq -r --argjson b "$before" --argjson a "$after" --arg l "${leader#pg}" --arg s "${sync#pg}" --arg an "$asyncn" \
	--argjson devices "$DEVICES" --argjson interval "$interval_s" '
	.totals as $t | $t.acked as $n
	| def cpu(k): ($a.cpu[k] // 0) - ($b.cpu[k] // 0);
	  def us(k): cpu(k) * 1e6 / $n * 100 | round / 100;
	  def nodes(f): [$a.cpu | keys[] | select(test("^kettle[0-9]+$"))] | map(f) | add;
	  def fig(name; v; unit): "figure \(name)=\(v):\(unit)";
	fig("serve_cpu_us_per_kettle_interval"; nodes(cpu(.)) * 1e6 / $n * 100 | round / 100; "µs"),
	fig("primary_cpu_us_per_kettle_interval"; us("postgres" + $l); "µs"),
	fig("sync_standby_cpu_us_per_kettle_interval"; us("postgres" + $s); "µs"),
	fig("async_standby_cpu_us_per_kettle_interval"; us("postgres" + $an); "µs"),
	fig("serve_rss_bytes_per_kettle"; (nodes($a.cpu[. + "_rss_bytes"] - $b.cpu[. + "_rss_bytes"]) / $devices | round); "bytes"),
	fig("disk_bytes_per_reading"; (($a.db_bytes - $b.db_bytes) / $n * 10 | round / 10); "bytes"),
	fig("wal_bytes_per_reading"; (($a.wal_bytes - $b.wal_bytes) / $n * 10 | round / 10); "bytes"),
	fig("patroni_etcd_cpu_s_per_s"; ([$a.cpu | keys[] | select(startswith("patroni") or startswith("etcd")) | cpu(.)] | add / $t.wall_seconds * 1e4 | round / 1e4); "cores"),
	fig("serve_rss_bytes_base"; $b.cpu.kettle1_rss_bytes; "bytes"),
	fig("upload_p99_ms"; $t.endpoints.measurement.p99_ms; "ms"),
	fig("poll_p99_ms"; $t.endpoints.command.p99_ms; "ms"),
	fig("interval_s"; $interval; "s"),
	fig("kettles"; $devices; "kettles"),
	fig("nodes"; '"$NODES"'; "nodes"),
	fig("readings_acked"; $n; "readings"),
	fig("polls"; $t.endpoints.command.requests; "requests"),
	fig("swarm_cpu_s"; $t.cpu_seconds; "s")' "$res" | tee /dev/stderr | rec_lines
# WAL_PROFILE: the WAL a reading that each table and index of the write
# path cost (a partition under its table's name; "none": commits and other
# records of no relation; "other": the rest, catalogs among them).
if [ -n "${WAL_PROFILE:-}" ]; then
	awk -v n="$(jq .totals.acked "$res")" 'BEGIN {
			split("devices devices_pkey measurements measurements_pkey last_seen_moves last_seen_counts last_seen_counts_pkey rollups hours_of_day totals none other", k, " ")
			for (i in k) b[k[i]] = 0 }
		NR > 1 && $1 != "total" { r = $1; gsub(/_y[0-9]+m[0-9]+(d[0-9]+)?/, "", r); if (r == "-") r = "none"; if (!(r in b)) r = "other"; b[r] += $2 }
		END { for (r in b) printf "figure wal_%s_bytes_per_reading=%.1f:bytes\n", r, b[r] / n }' "$WAL_PROFILE/wal-relations.txt" |
		sort | tee /dev/stderr | rec_lines
fi
rec_end
