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
# INTERVAL (30s), KETTLE_HA_NET (127.0.44).
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
export KETTLE_HA_NODES=1 KETTLE_HA_SYNC=true
export KETTLE_HA_SERVE_ARGS="--access-log-sample 0 --log-level warn"
out=$(mktemp -d /tmp/kha-size-XXXX)
chmod 755 "$out" # Patroni runs as postgres and reads its files under it
bench_build "$out/kettle" ./cmd/kettle
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
before=$(state)
echo "before: $before"
"$KETTLE_BIN" swarm --target "http://$KETTLE_HA_NET.21:8080" --api v1 --devices "$DEVICES" --interval "$RUN_INTERVAL" \
	--duration "$DURATION" --data-dir "$KETTLE_HA_DIR/kettle1" --out "$out/swarm" --report=false --sample=false \
	--slo-p99 0 --max-error-rate -1 >"$out/swarm.log" 2>&1
# Autovacuum and the hint bits of the new rows land within a few seconds;
# a checkpoint writes them out, so the size counts what stays.
deploy/cluster.sh psql -c "CHECKPOINT" >/dev/null
after=$(state)
echo "after: $after (primary $leader, synchronous standby $sync)"
[ "$(deploy/cluster.sh leader)" = "$leader" ] || { echo "sizing.sh: the primary changed during the run" >&2; exit 1; }

rec_begin sizing.sh "DEVICES=$DEVICES RUN_INTERVAL=$RUN_INTERVAL DURATION=$DURATION INTERVAL=$INTERVAL bench/sizing.sh"
# A kettle's interval is one reading and one poll: readings acknowledged
# count the intervals (the polls are reported beside them). The figures the
# run exists for first: the CPU, memory and disk a kettle costs.
res=$out/swarm/results.json
jq -e '.totals as $t | $t.acked > 0 and ($t.errors <= 0.01 * ([$t.endpoints[].requests] | add)) and ((.audit.lost // 0) == 0)' "$res" >/dev/null ||
	{ echo "sizing.sh: the run is not a clean one to size from ($(jq -c '{acked: .totals.acked, errors: .totals.errors, audit}' "$res")); see $out/swarm.log" >&2; exit 1; }
interval_s=$(awk -v v="$INTERVAL" 'BEGIN { n = v + 0; u = substr(v, length(n "") + 1); print n * (u == "ms" ? 0.001 : u == "m" ? 60 : 1) }')
asyncn=$(for i in 1 2 3; do [ "pg$i" = "$leader" ] || [ "pg$i" = "$sync" ] || echo "$i"; done)
jq -r --argjson b "$before" --argjson a "$after" --arg l "${leader#pg}" --arg s "${sync#pg}" --arg an "$asyncn" \
	--argjson devices "$DEVICES" --argjson interval "$interval_s" '
	.totals as $t | $t.acked as $n
	| def cpu(k): ($a.cpu[k] // 0) - ($b.cpu[k] // 0);
	  def us(k): cpu(k) * 1e6 / $n * 100 | round / 100;
	  def fig(name; v; unit): "figure \(name)=\(v):\(unit)";
	fig("serve_cpu_us_per_kettle_interval"; us("kettle1"); "µs"),
	fig("primary_cpu_us_per_kettle_interval"; us("postgres" + $l); "µs"),
	fig("sync_standby_cpu_us_per_kettle_interval"; us("postgres" + $s); "µs"),
	fig("async_standby_cpu_us_per_kettle_interval"; us("postgres" + $an); "µs"),
	fig("serve_rss_bytes_per_kettle"; (($a.cpu.kettle1_rss_bytes - $b.cpu.kettle1_rss_bytes) / $devices | round); "bytes"),
	fig("disk_bytes_per_reading"; (($a.db_bytes - $b.db_bytes) / $n * 10 | round / 10); "bytes"),
	fig("wal_bytes_per_reading"; (($a.wal_bytes - $b.wal_bytes) / $n * 10 | round / 10); "bytes"),
	fig("patroni_etcd_cpu_s_per_s"; ([$a.cpu | keys[] | select(startswith("patroni") or startswith("etcd")) | cpu(.)] | add / $t.wall_seconds * 1e4 | round / 1e4); "cores"),
	fig("serve_rss_bytes_base"; $b.cpu.kettle1_rss_bytes; "bytes"),
	fig("upload_p99_ms"; $t.endpoints.measurement.p99_ms; "ms"),
	fig("poll_p99_ms"; $t.endpoints.command.p99_ms; "ms"),
	fig("interval_s"; $interval; "s"),
	fig("kettles"; $devices; "kettles"),
	fig("readings_acked"; $n; "readings"),
	fig("polls"; $t.endpoints.command.requests; "requests"),
	fig("swarm_cpu_s"; $t.cpu_seconds; "s")' "$res" | tee /dev/stderr | rec_lines
rec_end
