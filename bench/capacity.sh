#!/usr/bin/env bash
# "How many kettles does this deployment hold?" on this machine, with
# everything co-located on 127.0.0.1: `kettle capacity` (a fresh fleet of
# each step's size, stepped up until the SLO breaks; see kettle capacity
# --help) against `kettle serve` on a fresh store.
#
#   bench/capacity.sh                      # the embedded store (SQLite)
#   STORE=postgres bench/capacity.sh       # a throwaway PostgreSQL cluster (bench/lib/pg-cluster.sh)
#   STORE=postgres PG_EXTRA="-c checkpoint_timeout=30s" bench/capacity.sh
#
# CAPACITY_ARGS: kettle capacity's steps (default below: the README's);
# SERVE_ARGS: more kettle serve flags; KETTLE_BIN: a prebuilt kettle; OUT=DIR
# keeps the steps' results and report.html (default: removed at exit).
#
# A step is short next to a store's periodic work: SQLite merges its staged
# rows every 65,536 readings, PostgreSQL checkpoints every checkpoint_timeout
# (30 min in bench/lib/pg-cluster.sh's settings) and logs every page a write
# touches whole once after each checkpoint. The script prints, per store,
# how much of that work fell inside the run (merges; checkpoints and WAL
# bytes with full-page images), so that a figure measured without it is
# seen to be so. PG_EXTRA="-c checkpoint_timeout=30s" (PostgreSQL's
# minimum) puts a checkpoint in every 40 s step.
#
# A slow disk: PG_WRITE_MBPS=8 throttles the cluster's disk writes (root,
# a cgroup; bench/lib/pg-cluster.sh); PG_WARM_WAL=1024 gives the fresh cluster
# recycled WAL segment files first, as one in service has:
#   STORE=postgres PG_WRITE_MBPS=8 CAPACITY_ARGS="--start 40000 --max 40000 --step-duration 60s" bench/capacity.sh
#   PG_WARM_WAL=1024 STORE=postgres PG_WRITE_MBPS=8 PG_EXTRA="-c checkpoint_timeout=30s" CAPACITY_ARGS=… bench/capacity.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${CAPACITY_ARGS:=--start 10 --max 10 --interval 1s --step-duration 3s --slo-p99 10s}"
STORE=${STORE:-sqlite}
CAPACITY_ARGS=${CAPACITY_ARGS:---start 40000 --step 40000 --step-duration 40s --warmup 10s}
case $STORE in sqlite | postgres) ;; *) echo "STORE must be sqlite or postgres, got $STORE" >&2; exit 2 ;; esac
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port; the cluster only for STORE=postgres
work=$(mktemp -d /tmp/kettle-capacity-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; pg_stop; rm -rf "$work"' EXIT
rerun="${PG_WARM_WAL:+PG_WARM_WAL=$PG_WARM_WAL }STORE=$STORE ${PG_EXTRA:+PG_EXTRA=\"$PG_EXTRA\" }${PG_WRITE_MBPS:+PG_WRITE_MBPS=$PG_WRITE_MBPS }CAPACITY_ARGS=\"$CAPACITY_ARGS\" SERVE_ARGS=\"${SERVE_ARGS:-}\" bench/capacity.sh"
echo "rerun: $rerun"
rec_begin capacity.sh "$rerun"
machine_line
build_kettle "$work"
db="sqlite:$work/kettle.db"
if [ "$STORE" = postgres ]; then
	pg_start
	pg_settings
	db=$(pg_db kettle)
	# pg_stat_bgwriter and pg_stat_wal (PostgreSQL 14–16; 17 moved the
	# checkpoint counts to pg_stat_checkpointer)
	pg_stat() { pg_sql kettle "SELECT (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter), wal_bytes, wal_fpi, wal_records FROM pg_stat_wal" 2>/dev/null || echo "0|0|0|0"; }
fi
port=$(free_port)
"$work/kettle" serve --addr 127.0.0.1:$port --db "$db" --data-dir "$work/data" --log-level warn ${SERVE_ARGS:-} 2>"$work/serve.log" &
kpid=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$port/readyz" >/dev/null || { echo "kettle serve did not start:"; cat "$work/serve.log"; exit 1; }
metric() { curl -sf "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m { s += $2 } END { printf "%.0f", s }'; }
[ "$STORE" = postgres ] && before=$(pg_stat)
m0=$(metric kettle_sqlite_merges_total)
t0=$(date +%s)
rc=0
# shellcheck disable=SC2086
"$work/kettle" capacity --target "http://127.0.0.1:$port" --data-dir "$work/data" --out "${OUT:-$work/out}" $CAPACITY_ARGS 2>&1 |
	grep --line-buffered -E '^capacity: ([0-9]+ kettles|caveat):|^holds' || rc=$?
echo "run: $(( $(date +%s) - t0 )) s; kettle serve: rows stored $(metric kettle_ingest_rows_stored_total), store errors $(metric kettle_store_errors_total), RSS $(awk '/VmHWM/ { printf "%.0f MiB max", $2 / 1024 }' /proc/$kpid/status)"
if [ "$STORE" = postgres ]; then
	IFS='|' read -r c0 w0 f0 r0 <<<"$before"
	IFS='|' read -r c1 w1 f1 r1 <<<"$(pg_stat)"
	echo "postgres during the run: checkpoints $((c1 - c0)), WAL $(awk -v a="$w0" -v b="$w1" 'BEGIN { printf "%.0f MiB", (b - a) / 1048576 }'), full-page images $((f1 - f0)) in $((r1 - r0)) WAL records; database $(pg_sql kettle "SELECT pg_size_pretty(pg_database_size('kettle'))")"
	grep -h 'checkpoint complete' "$PG_DIR/postgres.log" | sed 's/^/  /' | tail -5 || true
else
	echo "sqlite during the run: merges $(( $(metric kettle_sqlite_merges_total) - m0 )), staged rows at the end $(metric kettle_sqlite_staged_rows)"
fi
rec_json "${OUT:-$work/out}/capacity.json" "holds=.capacity.holds:kettles" "breaks at=.capacity.breaks_at?:kettles" "SLO p99=.capacity.slo_p99_ms:ms"
rec_end
exit $rc
