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
DEVICES=${DEVICES:-2000}
RUN_INTERVAL=${RUN_INTERVAL:-2s}
DURATION=${DURATION:-40s}
INTERVAL=${INTERVAL:-30s}
export KETTLE_HA_NET=${KETTLE_HA_NET:-127.0.44}
export KETTLE_HA_NODES=1 KETTLE_HA_SYNC=true
export KETTLE_HA_SERVE_ARGS="--access-log-sample 0 --log-level warn"
bench_build bin/kettle ./cmd/kettle
export KETTLE_BIN=$PWD/bin/kettle
out=$(mktemp -d /tmp/kha-size-XXXX)
chmod 755 "$out" # Patroni runs as postgres and reads its files under it
export KETTLE_HA_DIR=$out/topo
trap 'deploy/cluster.sh down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT
. bench/lib/record.sh

deploy/cluster.sh up >/dev/null
leader=$(deploy/cluster.sh leader)
sync=$(deploy/cluster.sh sync)
# state: the processes' CPU and memory, the database's size, the WAL position.
state() {
	printf '{"cpu":%s,"db_bytes":%s,"wal_bytes":%s}\n' "$(python3 bench/lib/topo_cpu.py "$KETTLE_HA_DIR")" \
		"$(deploy/cluster.sh psql -c "SELECT pg_database_size('kettle')")" \
		"$(deploy/cluster.sh psql -c "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")"
}
before=$(state)
echo "before: $before"
bin/kettle swarm --target "http://$KETTLE_HA_NET.21:8080" --api v1 --devices "$DEVICES" --interval "$RUN_INTERVAL" \
	--duration "$DURATION" --data-dir "$KETTLE_HA_DIR/kettle1" --out "$out/swarm" --report=false --sample=false \
	--slo-p99 0 --max-error-rate -1 >"$out/swarm.log" 2>&1
# Autovacuum and the hint bits of the new rows land within a few seconds;
# a checkpoint writes them out, so the size counts what stays.
deploy/cluster.sh psql -c "CHECKPOINT" >/dev/null
after=$(state)
echo "after: $after (primary $leader, synchronous standby $sync)"
[ "$(deploy/cluster.sh leader)" = "$leader" ] || { echo "sizing.sh: the primary changed during the run" >&2; exit 1; }

rec_begin sizing.sh "DEVICES=$DEVICES RUN_INTERVAL=$RUN_INTERVAL DURATION=$DURATION INTERVAL=$INTERVAL bench/sizing.sh"
python3 - "$out/swarm/results.json" "$before" "$after" "$leader" "$sync" "$DEVICES" "$INTERVAL" <<'EOF'
import json, os, re, sys
r = json.load(open(sys.argv[1]))
b, a = json.loads(sys.argv[2]), json.loads(sys.argv[3])
leader, sync, devices = sys.argv[4][2:], sys.argv[5][2:], int(sys.argv[6])
m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", sys.argv[7])
interval = float(m[1]) * {"ms": 1e-3, "s": 1, "m": 60}[m[2]]
t = r["totals"]
acked = t["acked"]
audit = r.get("audit") or {}
if acked == 0 or t["errors"] > 0.01 * sum(e["requests"] for e in t["endpoints"].values()) or audit.get("lost"):
    sys.exit(f"sizing.sh: the run is not a clean one to size from (acked {acked}, errors {t['errors']}, audit {audit}); see the swarm log")
polls = t["endpoints"]["command"]["requests"]
cpu = lambda k: a["cpu"].get(k, 0) - b["cpu"].get(k, 0)
# A kettle's interval is one reading and one poll: readings acknowledged
# count the intervals (the polls are reported beside them).
us = lambda k: round(cpu(k) * 1e6 / acked, 2)
async_ = next(i for i in "123" if i not in (leader, sync))
figs = [
    ("interval_s", interval, "s"),
    ("kettles", devices, "kettles"),
    ("readings_acked", acked, "readings"),
    ("polls", polls, "requests"),
    ("serve_cpu_us_per_kettle_interval", us("kettle1"), "µs"),
    ("primary_cpu_us_per_kettle_interval", us("postgres" + leader), "µs"),
    ("sync_standby_cpu_us_per_kettle_interval", us("postgres" + sync), "µs"),
    ("async_standby_cpu_us_per_kettle_interval", us("postgres" + async_), "µs"),
    ("patroni_etcd_cpu_s_per_s", round(sum(cpu(k) for k in a["cpu"] if k.startswith(("patroni", "etcd"))) / t["wall_seconds"], 4), "cores"),
    ("serve_rss_bytes_per_kettle", round((a["cpu"]["kettle1_rss_bytes"] - b["cpu"]["kettle1_rss_bytes"]) / devices), "bytes"),
    ("serve_rss_bytes_base", b["cpu"]["kettle1_rss_bytes"], "bytes"),
    ("disk_bytes_per_reading", round((a["db_bytes"] - b["db_bytes"]) / acked, 1), "bytes"),
    ("wal_bytes_per_reading", round((a["wal_bytes"] - b["wal_bytes"]) / acked, 1), "bytes"),
    ("upload_p99_ms", t["endpoints"]["measurement"]["p99_ms"], "ms"),
    ("poll_p99_ms", t["endpoints"]["command"]["p99_ms"], "ms"),
    ("swarm_cpu_s", t["cpu_seconds"], "s"),
]
with open(os.environ["KETTLE_REC_FIGS"], "a") as f:
    for name, v, unit in figs:
        print(f"{name} = {v} {unit}")
        f.write(f"figure {name}={v}:{unit}\n")
EOF
rec_end
