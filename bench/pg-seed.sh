#!/usr/bin/env bash
# Issue 3 benchmarks 1 and 4 on a throwaway PostgreSQL cluster:
#   1. `kettle seed` rows/s against the ceiling: a raw COPY of the identical
#      rows (same generator, groups, chunks and streams) into a scratch table
#      of the same shape (measurements' columns and primary key, partitioned
#      by UTC day, each chunk into its day's partition), all of them: the
#      same row count as the seeding. Measured before and after the seeding
#      in the same run;
#      Also, unless DAY_CEIL=0, a second ceiling before and after: the same
#      rows loaded the way kettle seed loads a new day (COPY FREEZE into a
#      table of its own, primary key built after, attached; pgbench ceiling
#      --load day), without the devices and rollups: the seeder against the
#      best raw load of its technique;
#   4. GET /v1/statistics p50/p99 on the seeded store (kettle serve --db
#      postgres://…), beside the naive GROUP BY over every stored row;
#   and table + index bytes per stored measurement.
#
#   bench/pg-seed.sh                                        # 2000 devices × 2 days at 60s (5.7M rows)
#   DEVICES=20000 DAYS=29 INTERVAL=15m bench/pg-seed.sh      # ~55.7M rows
#
# Each phase prints a CPU line (client and postgres CPU seconds) and a WAL
# line (WAL bytes, full-page images, checkpoints it saw). The ceiling runs
# once more first, not counted, to warm the fresh cluster (WARM=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh # free_port, bench_build, rec_*
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DAYS:=1}" "${INTERVAL:=1h}" "${STATS_N:=20}" "${CHUNK:=1000}"
DEVICES=${DEVICES:-2000}
DAYS=${DAYS:-2}
INTERVAL=${INTERVAL:-60s}
WORKERS=${WORKERS:-3}
CHUNK=${CHUNK:-200000}
STATS_N=${STATS_N:-2000}
PORT_K=${PORT_K:-$(free_port)}
END=${END:-$(date -u +%Y-%m-%dT%H:00:00Z)}
. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-pgbench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pg_stop; rm -rf "$work"; }
trap cleanup EXIT
rerun="${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }${WARM:+WARM=$WARM }DEVICES=$DEVICES DAYS=$DAYS INTERVAL=$INTERVAL WORKERS=$WORKERS CHUNK=$CHUNK END=$END bench/pg-seed.sh"
echo "rerun: $rerun"
rec_begin pg-seed.sh "$rerun"
machine_line
build_kettle "$work"
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
ceil_dsn=$(pg_db ceiling)
dsn=$(pg_db kettle)

# wal_stat: cluster-wide WAL bytes, full-page images and checkpoints so far
wal_stat() { pg_sql postgres "SELECT w.wal_bytes || ' ' || w.wal_fpi || ' ' || (b.checkpoints_timed + b.checkpoints_req) FROM pg_stat_wal w, pg_stat_bgwriter b"; }
# cpu_run NAME CMD...: run CMD, print its output, then a CPU line (client =
# CMD's own CPU) and a WAL line
cpu_run() { local name=$1 s0 s1 w0 w1 out; shift; s0=$(pg_cpu); w0=$(wal_stat)
	out=$( { /usr/bin/time -f "__CPU %U %S" "$@"; } 2>&1 ); sleep 1; s1=$(pg_cpu); w1=$(wal_stat) # 1s: let the postmaster reap the backends
	echo "$out" | grep -v '^__CPU'
	echo "$out" | awk -v n="$name" -v s0="$s0" -v s1="$s1" '/^__CPU/ { printf "CPU %s client_s=%.2f postgres_s=%.2f\n", n, $2+$3, s1-s0 }'
	echo "$w0 $w1" | awk -v n="$name" '{ printf "WAL %s wal_mb=%.0f fpi=%d checkpoints=%d\n", n, ($4-$1)/1048576, $5-$2, $6-$3 }'; }

ceiling() {
	cpu_run ceiling "$work/pgbench" ceiling --dsn "$ceil_dsn" --devices "$DEVICES" --days "$DAYS" --interval "$INTERVAL" \
		--end "$END" --workers "$WORKERS" --chunk-rows "$CHUNK" | grep -E "RESULT|CPU|WAL"
	pg_sql ceiling "CHECKPOINT" >/dev/null
}
# Warm-up, not counted (WARM=0 skips it): the ceiling once. The first heavy
# write into a fresh cluster creates and zero-fills its WAL files and is the
# first to touch shared_buffers; whatever runs after a checkpoint finds those
# files recycled. Without it the "before" ceiling pays for that alone, and the
# mean of the two ceilings favours the seeder.
if [ "${WARM:-1}" != 0 ]; then
	echo "--- warm-up, not counted: the ceiling once ---"
	ceiling | grep RESULT
	pg_sql postgres "CHECKPOINT" >/dev/null
fi
echo "--- ceiling (before): raw binary COPY of the same rows into a scratch table of the same shape (device, t primary key, day partitions), $WORKERS streams ---"
c1=$(ceiling); echo "$c1"
ceiling_day() {
	cpu_run ceiling_day "$work/pgbench" ceiling --load day --dsn "$ceil_dsn" --devices "$DEVICES" --days "$DAYS" --interval "$INTERVAL" \
		--end "$END" --workers "$WORKERS" --chunk-rows "$CHUNK" | grep -E "RESULT|CPU|WAL"
	pg_sql ceiling "CHECKPOINT" >/dev/null
}
if [ "${DAY_CEIL:-1}" != 0 ]; then
	echo "--- day-load ceiling (before): the same rows as kettle seed loads a new day (COPY FREEZE into a table of its own, primary key after, attached), no devices or rollups, $WORKERS days at once ---"
	d1=$(ceiling_day); echo "$d1"
fi
echo "--- kettle seed --devices $DEVICES --days $DAYS --interval $INTERVAL --workers $WORKERS --end $END ---"
cpu_run seed "$work/kettle" seed --db "$dsn" --devices "$DEVICES" --days "$DAYS" --interval "$INTERVAL" --workers "$WORKERS" \
	--chunk-rows "$CHUNK" --end "$END" --quiet | tee "$work/seed.out"
pg_sql kettle "CHECKPOINT" >/dev/null
echo "--- ceiling (after) ---"
c2=$(ceiling); echo "$c2"
if [ "${DAY_CEIL:-1}" != 0 ]; then
	echo "--- day-load ceiling (after) ---"
	d2=$(ceiling_day); echo "$d2"
fi
seed_rate=$(sed -n 's/.*, \([0-9]*\) rows\/s stored.*/\1/p' "$work/seed.out")
r1=$(echo "$c1" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p'); r2=$(echo "$c2" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p')
awk -v s="$seed_rate" -v a="$r1" -v b="$r2" 'BEGIN { c=(a+b)/2; printf "RATIO seed/ceiling = %.3f (seed %d rows/s; ceiling %d / %d rows/s before / after, mean %.0f); goal >= 0.90\n", s/c, s, a, b, c }'
rec_fig "kettle seed" "$seed_rate" rows/s
rec_ceiling "raw binary COPY, mean of before and after" "$(awk -v a="$r1" -v b="$r2" 'BEGIN { printf "%.0f", (a+b)/2 }')" rows/s
rec_ratio "$(awk -v s="$seed_rate" -v a="$r1" -v b="$r2" 'BEGIN { if (a+b > 0) printf "%.3f", s/((a+b)/2) }')"
# The same with the seed's time up to its last commit (every row stored and
# every statistic exact; then the VACUUM (ANALYZE) of the seeded partitions
# and the rollups' fold, "finishing" in its summary): the end state the
# ceiling's COPY leaves, without the maintenance kettle seed does after it.
fin=$(sed -n 's/.*of which \([0-9hmµs.]*\) finishing.*/\1/p' "$work/seed.out" | awk '{ t = 0; s = $0
	while (match(s, /^[0-9.]+(h|ms|µs|m|s)/)) { v = substr(s, 1, RLENGTH); s = substr(s, RLENGTH + 1)
		if (v ~ /ms$/) t += v / 1000; else if (v ~ /µs$/) t += v / 1e6; else if (v ~ /h$/) t += v * 3600; else if (v ~ /m$/) t += v * 60; else t += v + 0 }
	printf "%.3f", t }')
awk -v s="$seed_rate" -v n="$(sed -n 's/.* \([0-9]*\) stored, .*/\1/p' "$work/seed.out")" -v f="${fin:-0}" -v a="$r1" -v b="$r2" 'BEGIN { c = (a + b) / 2; t = n / s - f
	printf "RATIO seed to its last commit/ceiling = %.3f (%d rows in %.2f s of its %.2f, %d rows/s; %.2f s finishing after it)\n", n / t / c, n, t, n / s, n / t, f }'
# the same ratio in CPU per row (client + postgres), less sensitive to the other load on the machine
seed_rows=$(sed -n 's/.* \([0-9]*\) stored, .*/\1/p' "$work/seed.out")
ceil_rows=$(echo "$c1" | sed -n 's/.*RESULT ceiling rows=\([0-9]*\).*/\1/p')
{ echo "$c1" | grep '^CPU'; echo "$c2" | grep '^CPU'; grep '^CPU' "$work/seed.out"; } | awk -v sr="$seed_rows" -v cr="$ceil_rows" '
	/^CPU ceiling/ { split($3, a, "="); split($4, b, "="); cc += a[2] + b[2]; cn++ }
	/^CPU seed/ { split($3, a, "="); split($4, b, "="); sc = a[2] + b[2]; scl = a[2]; spg = b[2] }
	END { cu = cc / cn / cr * 1e6; su = sc / sr * 1e6
		printf "RATIO (CPU) seed/ceiling throughput at equal CPU = %.3f (ceiling %.2f µs CPU/row, mean of 2; seed %.2f µs CPU/row: kettle seed %.2f + postgres %.2f)\n", cu / su, cu, su, scl / sr * 1e6, spg / sr * 1e6 }'

if [ "${DAY_CEIL:-1}" != 0 ]; then
	q1=$(echo "$d1" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p'); q2=$(echo "$d2" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p')
	awk -v s="$seed_rate" -v a="$q1" -v b="$q2" 'BEGIN { c=(a+b)/2; printf "RATIO seed/day-load ceiling = %.3f (seed %d rows/s; day-load ceiling %d / %d rows/s before / after, mean %.0f): what keeping devices, rollups and totals exact costs\n", s/c, s, a, b, c }'
	{ echo "$d1" | grep '^CPU'; echo "$d2" | grep '^CPU'; grep '^CPU' "$work/seed.out"; } | awk -v sr="$seed_rows" -v cr="$ceil_rows" '
		/^CPU ceiling_day/ { split($3, a, "="); split($4, b, "="); cc += a[2] + b[2]; cn++ }
		/^CPU seed/ { split($3, a, "="); split($4, b, "="); sc = a[2] + b[2] }
		END { cu = cc / cn / cr * 1e6; su = sc / sr * 1e6
			printf "RATIO (CPU) seed/day-load ceiling throughput at equal CPU = %.3f (day-load ceiling %.2f µs CPU/row, mean of 2; seed %.2f)\n", cu / su, cu, su }'
fi
echo "ceiling and seed done: load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "--- storage ---"
pg_sql kettle "SELECT 'STORAGE rows=' || sum(c.reltuples)::bigint || ' partitions=' || count(*) || ' table_bytes=' || sum(pg_table_size(c.oid)) || ' index_bytes=' || sum(pg_indexes_size(c.oid)) ||
	' total_bytes=' || sum(pg_total_relation_size(c.oid)) || ' bytes_per_row=' || round(sum(pg_total_relation_size(c.oid)) / (SELECT count(*) FROM measurements)::numeric, 1)
	FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass"
pg_sql kettle "SELECT 'DERIVED ' || string_agg(relname || ' rows=' || n_live_tup || ' dead=' || n_dead_tup || ' bytes=' || pg_total_relation_size(relid), ', ' ORDER BY relname)
	FROM pg_stat_user_tables WHERE relname IN ('rollups', 'hours_of_day', 'devices', 'last_seen_counts')"

echo "--- GET /v1/statistics (open range, $STATS_N sequential requests, one keep-alive connection) on kettle serve --db postgres ---"
"$work/kettle" serve --addr 127.0.0.1:$PORT_K --db "$dsn" --data-dir "$work/data" --access-log-sample 0 2>"$work/serve.log" & pids+=($!)
t0=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT_K/readyz" >/dev/null 2>&1; do
	kill -0 "${pids[-1]}" 2>/dev/null || { echo "kettle serve exited:"; tail -5 "$work/serve.log"; exit 1; }
	[ $(( $(date +%s) - t0 )) -lt 900 ] || { echo "kettle serve not ready after 900s"; exit 1; }
	sleep 0.2
done
echo "kettle serve ready after $(( $(date +%s) - t0 ))s"
"$work/pgbench" stats --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data" -n "$STATS_N" --dsn "$dsn" | tee "$work/stats.txt"
rec_results "$work/stats.txt" "open range:"
range="from=$(date -u -d "$(echo "$END" | sed 's/T/ /; s/Z//') UTC - $DAYS days" +%Y-%m-%dT%H:%M:%SZ)&to=$END"
echo "--- the same, bounded range (from=start&to=end of the seeded history: one rollup row per hour of it) ---"
"$work/pgbench" stats --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data" -n "$STATS_N" --query "$range"
# kettle seed ends with VACUUM (ANALYZE) of the partitions it filled (in its
# time), so autovacuum has no first pass over gigabytes of them to make
# while the statistics are measured. An autovacuum run still in progress is
# named here; the explicit VACUUM shows what was left to do (its time), and
# both ranges are measured again on the store at rest.
echo "--- at rest: VACUUM (ANALYZE) measurements, then both ranges again ---"
echo "autovacuum running: $(pg_sql kettle "SELECT coalesce(string_agg(c.relname || ' ' || p.phase, ', '), 'none') FROM pg_stat_progress_vacuum p JOIN pg_class c ON c.oid = p.relid")"
v0=$(date +%s.%N); pg_sql kettle "VACUUM (ANALYZE) measurements" >/dev/null
echo "VACUUM (ANALYZE) measurements: $(echo "$(date +%s.%N) - $v0" | bc) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$work/pgbench" stats --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data" -n "$STATS_N"
"$work/pgbench" stats --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data" -n "$STATS_N" --query "$range"
rec_end
