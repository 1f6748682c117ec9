#!/usr/bin/env bash
# Retention on PostgreSQL: Store.Expire of a month of history (its day
# partitions, one transaction each) while writers
# store live readings, on a throwaway cluster.
#   1. kettle seed DEVICES kettles × DAYS days at INTERVAL, ending on the 2nd
#      of this month (so last month's days are full);
#   2. pgbench expire: WRITERS goroutines write batches of BATCH live
#      readings of the seeded kettles (as kettle serve's batchers do) for
#      WARMUP, then Store.Expire removes the days before this month; it
#      prints how long that took, what it removed, the writers' commit
#      latency before and while it ran, and checks the statistics' count
#      and every kettle's count against the rows left.
#
#   bench/pg-expire.sh                                     # 2000 kettles × 33 days at 60m (1.6M rows)
#   DEVICES=20000 DAYS=33 INTERVAL=15m bench/pg-expire.sh   # 63M rows, ~60M of them expired
#   STORE=sqlite bench/pg-expire.sh                          # the same on the embedded store (no cluster)
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DAYS:=2}" "${WARMUP:=1s}" "${BATCH:=10}"
DEVICES=${DEVICES:-2000}
DAYS=${DAYS:-33}
INTERVAL=${INTERVAL:-60m}
WORKERS=${WORKERS:-3}
WRITERS=${WRITERS:-2}
BATCH=${BATCH:-200}
WARMUP=${WARMUP:-10s}
STORE=${STORE:-postgres}
END=${END:-$(date -u +%Y-%m-02T00:00:00Z)}
. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-pgbench-XXXXXX)
trap 'pg_stop; rm -rf "$work"' EXIT
rerun="${PGBENCH_BIN:+PGBENCH_BIN=$PGBENCH_BIN }STORE=$STORE DEVICES=$DEVICES DAYS=$DAYS INTERVAL=$INTERVAL WRITERS=$WRITERS BATCH=$BATCH WARMUP=$WARMUP END=$END bench/pg-expire.sh"
echo "rerun: $rerun"
rec_begin pg-expire.sh "$rerun"
machine_line
build_kettle "$work"
# PGBENCH_BIN: a pgbench built from another commit (it holds the store's Expire), to compare
if [ -n "${PGBENCH_BIN:-}" ]; then cp "$PGBENCH_BIN" "$work/pgbench"; else bench_build "$work/pgbench" ./bench/pgbench; fi
if [ "$STORE" = sqlite ]; then
	dsn="sqlite:$work/kettle.db"
else
	pg_start
	pg_settings
	dsn=$(pg_db kettle)
fi
echo "--- kettle seed --devices $DEVICES --days $DAYS --interval $INTERVAL --end $END ---"
"$work/kettle" seed --db "$dsn" --devices "$DEVICES" --days "$DAYS" --interval "$INTERVAL" --workers "$WORKERS" --end "$END" --quiet
if [ "$STORE" != sqlite ]; then
	pg_sql kettle "VACUUM (ANALYZE) measurements" >/dev/null
	pg_sql kettle "CHECKPOINT" >/dev/null
	pg_sql kettle "SELECT 'partitions: ' || string_agg(c.relname || ' ' || c.reltuples::bigint, ', ' ORDER BY c.relname) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass"
fi
echo "--- pgbench expire: $WRITERS writers × $BATCH live readings a write; Expire(start of this month) after $WARMUP ---"
"$work/pgbench" expire --dsn "$dsn" --devices "$DEVICES" --writers "$WRITERS" --batch "$BATCH" --warmup "$WARMUP" | tee "$work/expire.txt"
rec_results "$work/expire.txt"
if [ "$STORE" != sqlite ]; then
	pg_sql kettle "SELECT 'partitions left: ' || string_agg(c.relname, ', ' ORDER BY c.relname) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass"
fi
echo "done: load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
rec_end
