#!/usr/bin/env bash
# Issue 3: insert speed must not fall as the table grows. One throwaway
# PostgreSQL cluster, one kettle database, one fleet (kettle seed's DEVICES
# kettles), grown in STEPS: before each step's measurement `kettle seed`
# adds older history (--days D, the same --end, so each run adds only the
# days before the last), every row of it in one calendar month: END is the
# 20th of the previous month, 00:00 UTC, and D < 20. The live readings of
# every step go into that same month, right after END. kettle partitions
# measurements by UTC day, so a partition holds at most a day of the fleet
# (57.6 million readings at 20,000 kettles every 30 s); to measure inserts
# into one partition grown to that and beyond, the script attaches END's
# month as one partition before the first seeding (as a database made
# before day partitions holds them; kettle uses such a month as it is), so
# the partition the seeder filled is the one being written. Each step:
#   single: acknowledged case-study POST /measurement req/s from the seeded
#           kettles (wrk + bench/measurement.lua, CONNS connections);
#   v1:     acknowledged rows/s of POST /v1/measurements, batches of 500
#           readings of one device (pgbench ingest, V1_CONNS connections),
# each with CPU µs of kettle serve and of PostgreSQL per reading and the
# blocks PostgreSQL read from outside shared_buffers per reading (a growing
# index whose hot pages no longer fit would show there first; the pages an
# insert adds at the end of the table and index count too, ~0.02 a reading
# into an empty one), then the
# partition's table and index size. kettle seed ends with VACUUM (ANALYZE)
# of the partitions it filled, as after any bulk load; the script runs
# VACUUM (ANALYZE) on all of measurements once more after each seeding (its
# time is printed: what was left, e.g. the live rows of the step before).
# Otherwise autovacuum's first pass over the rows could land in a
# measurement and its CPU count as the inserts'; each phase prints how
# many autovacuum/autoanalyze runs finished during it (autovac=).
# Each phase also prints the WAL it wrote per reading, and how many of
# its records were full-page images (fpi): a page's first change after a
# checkpoint logs the whole page, and every phase starts after one.
# Last, ROUNDS times (default 4), a small database — the same kettles with
# REF_DAYS (default 1) of history, the month's partition one day in, a new
# database each round — and the grown one are measured in turn (small first
# in odd rounds, grown first in even ones), and the
# script prints the geometric mean and the median (the lower middle one of
# an even count) of the ratio grown / small of each figure: one short run
# swings by several per cent on a shared machine, and the order may matter
# too (docs/performance.md): an even ROUNDS puts each side first equally
# often, and the geometric mean cancels what the order does.
# (REF_DAYS=0: one reading a kettle, an empty
# partition; there every kettle's keys share a few index pages, as they do
# only in a partition's first hour or so.)
#
#   bench/pg-growth.sh                                   # 20,000 kettles, 0, 1, 6, 12, 19 days at 10 min (54.7M rows seeded, ~35 min)
#   DEVICES=2000 STEPS="0 2 4" INTERVAL=10m DURATION=10s bench/pg-growth.sh   # a quick run
#
# The first step's "0 days" seeds one reading a kettle (registering them).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh # free_port, bench_build, rec_*
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${STEPS:=0 1}" "${INTERVAL:=6h}" "${DURATION:=2s}" "${CONNS:=4}" "${ROUNDS:=1}"
NDEV=${DEVICES:-20000}
STEPS=${STEPS:-0 1 6 12 19}
REF_DAYS=${REF_DAYS:-1}
INTERVAL=${INTERVAL:-10m}
DURATION=${DURATION:-20s}
CONNS=${CONNS:-1024}
V1_CONNS=${V1_CONNS:-64}
WORKERS=${WORKERS:-3}
ROUNDS=${ROUNDS:-4}
PORT_K=$(free_port)
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
# the 20th of the previous month, 00:00 UTC
END=${END:-$(date -u -d "$(date -u +%Y-%m-01) - 1 month + 19 days" +%Y-%m-%dT00:00:00Z)}
end_s=$(date -u -d "$END" +%s)
for d in $STEPS; do ((d < 20)) || { echo "STEPS: at most 19 days (the history must stay in END's month)"; exit 2; }; done
. bench/lib/pg-cluster.sh
work_start pggrowth
rerun="${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }DEVICES=$NDEV STEPS=\"$STEPS\" INTERVAL=$INTERVAL DURATION=$DURATION CONNS=$CONNS V1_CONNS=$V1_CONNS ROUNDS=$ROUNDS REF_DAYS=$REF_DAYS END=$END bench/pg-growth.sh"
echo "rerun: $rerun"
rec_begin pg-growth.sh "$rerun"
machine_line
build_kettle "$work"
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
part="measurements_y$(date -u -d "$END" +%Ym%m)"

# blocks: blocks read into shared_buffers and found there, database $1
blocks() { pg_sql "$1" "SELECT blks_read || ' ' || blks_hit FROM pg_stat_database WHERE datname = '$1'"; }
# wal: WAL records, full-page images and bytes written so far (the cluster)
wal() { pg_sql postgres "SELECT wal_records || ' ' || wal_fpi || ' ' || wal_bytes FROM pg_stat_wal"; }
# autovac DB: autovacuum and autoanalyze runs finished so far in DB
autovac() { pg_sql "$1" "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_all_tables"; }

# measure NAME DB STEP: one single-readings and one v1 run against kettle
# serve on DB; STEP (0, 1, …) places its device times after END
measure() {
	local name=$1 db=$2 step=$3 dsn k0 k1 s0 s1 b0 b1 n0 n1 a0 a1 w0 w1 out
	dsn="postgres://postgres@/$db?host=$PG_DIR&port=$PG_PORT&sslmode=disable"
	pg_sql "$db" "CHECKPOINT" >/dev/null
	kettle_serve "$name" "$dsn"
	pg_sql "$db" "SELECT id FROM devices ORDER BY id" >"$work/devices.txt"
	export DEVICES="$work/devices.txt" BASE_EPOCH=$((end_s + 3600 + step * 4 * 3600))
	n0=$(kettle_count "$name"); k0=$(proc_cpu "$kpid"); s0=$(pg_cpu); b0=$(blocks "$db"); a0=$(autovac "$db"); w0=$(wal)
	out=$(wrk -t2 -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_K" | grep RESULT)
	n1=$(kettle_count "$name"); k1=$(proc_cpu "$kpid"); s1=$(pg_cpu); b1=$(blocks "$db"); a1=$(autovac "$db"); w1=$(wal)
	echo "$out" | awk -v s="$name" -v av=$((a1 - a0)) -v w0="$w0" -v w1="$w1" -v n=$((n1 - n0)) -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v p="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" -v b0="$b0" -v b1="$b1" '
		{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
		  split(b0, p0, " "); split(b1, q1, " "); split(w0, v0, " "); split(w1, v1, " ")
		  printf "STEP %s single conns=%s req_per_s=%s p99_ms=%s non2xx=%s stored=%d kettle_cpu_us=%.1f postgres_cpu_us=%.1f blocks_read=%.3f blocks_hit=%.1f wal_bytes=%.0f wal_fpi=%.4f (per reading) autovac=%d\n",
		    s, '"$CONNS"', x["rps"], x["p99_ms"], x["errors_status"], n, k / n * 1e6, p / n * 1e6, (q1[1] - p0[1]) / n, (q1[2] - p0[2]) / n, (v1[3] - v0[3]) / n, (v1[2] - v0[2]) / n, av }'
	# v1: pgbench ingest's readings start at (now - 40 days, whole hour);
	# shift them to 2 h after this step's single readings
	local base_s=$(( ($(date -u +%s) - 40 * 86400) / 3600 * 3600 ))
	k0=$(proc_cpu "$kpid"); s0=$(pg_cpu); b0=$(blocks "$db"); a0=$(autovac "$db"); w0=$(wal)
	out=$("$work/pgbench" ingest --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data-$name" --devices 2000 --batch 500 \
		--conns "$V1_CONNS" --duration "$DURATION" --warmup 0s --shift "$((BASE_EPOCH + 7200 - base_s))s" | grep RESULT)
	k1=$(proc_cpu "$kpid"); s1=$(pg_cpu); b1=$(blocks "$db"); a1=$(autovac "$db"); w1=$(wal)
	echo "$out" | awk -v s="$name" -v av=$((a1 - a0)) -v w0="$w0" -v w1="$w1" -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v p="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" -v b0="$b0" -v b1="$b1" '
		{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
		  n = x["stored"]; split(b0, p0, " "); split(b1, q1, " "); split(w0, v0, " "); split(w1, v1, " ")
		  printf "STEP %s v1 conns=%s rows_per_s=%s p99_ms=%s errors=%s duplicates=%s kettle_cpu_us=%.2f postgres_cpu_us=%.2f blocks_read=%.4f blocks_hit=%.1f wal_bytes=%.0f wal_fpi=%.4f (per reading) autovac=%d\n",
		    s, '"$V1_CONNS"', x["rows_per_s"], x["p99_ms"], x["errors"], x["duplicates"], k / n * 1e6, p / n * 1e6, (q1[1] - p0[1]) / n, (q1[2] - p0[2]) / n, (v1[3] - v0[3]) / n, (v1[2] - v0[2]) / n, av }'
	echo "STEP $name size: $(kettle_count "$name") measurements stored; $(pg_sql "$db" "SELECT 'partition $part ' || pg_size_pretty(pg_table_size('$part')) || ' table + ' || pg_size_pretty(pg_indexes_size('$part')) || ' index; all measurements ' || pg_size_pretty(pg_total_relation_size('measurements'::regclass) + coalesce((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = 'measurements'::regclass), 0))")"
	kettle_stop
}

# seed DB DAYS: kettle seed's fleet with DAYS of history ending at END (0: one
# reading a kettle, at END)
seed() {
	local dsn="postgres://postgres@/$1?host=$PG_DIR&port=$PG_PORT&sslmode=disable" args
	if [ "$2" = 0 ]; then args=(--days 1 --interval 24h); else args=(--days "$2" --interval "$INTERVAL"); fi
	local s0 t0 t1 s1; s0=$(pg_cpu); t0=$(date +%s.%N)
	"$work/kettle" seed --db "$dsn" --devices "$NDEV" "${args[@]}" --end "$END" --workers "$WORKERS" --quiet | tail -1
	t1=$(date +%s.%N); s1=$(pg_cpu)
	awk -v a="$t0" -v b="$t1" -v p="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" 'BEGIN { printf "seeded in %.1f s (postgres CPU %.1f s)\n", b - a, p }'
	t0=$(date +%s.%N); pg_sql "$1" "VACUUM (ANALYZE) measurements"; t1=$(date +%s.%N)
	awk -v a="$t0" -v b="$t1" 'BEGIN { printf "VACUUM (ANALYZE) measurements: %.1f s\n", b - a }'
}

pg_db kettle >/dev/null
pg_attach_month kettle "$(date -u -d "$END" +%Y-%m-01)"
step=0
for d in $STEPS; do
	echo "--- step $step: kettle seed --devices $NDEV --days $d --end $END, then single readings ($CONNS connections) and v1 batches ($V1_CONNS connections), $DURATION each, into $part ---"
	seed kettle "$d"
	measure "days-$d" kettle "$step"
	step=$((step + 1))
done
echo "--- grown ($STEPS days seeded) against small (a new database each round: the same $NDEV kettles, $REF_DAYS days of history), $ROUNDS rounds ---"
small() {
	pg_db "small$1" >/dev/null
	pg_attach_month "small$1" "$(date -u -d "$END" +%Y-%m-01)"
	seed "small$1" "$REF_DAYS"
	measure "small-$1" "small$1" 0 >"$work/m.txt"; tee -a "$work/ab.txt" <"$work/m.txt"
	pg_sql postgres "DROP DATABASE small$1"
}
grown() {
	measure "grown-$1" kettle "$step" >"$work/m.txt"; tee -a "$work/ab.txt" <"$work/m.txt"
	step=$((step + 1))
}
# small first in odd rounds, grown first in even ones: whatever the second
# of two runs gains (WAL segments recycled by the first, say) falls on each
# side alike over the rounds
for r in $(seq "$ROUNDS"); do
	if ((r % 2)); then small "$r"; grown "$r"; else grown "$r"; small "$r"; fi
done
# the geometric mean and median over the rounds of grown / small, per phase and figure
for ph in single v1; do
	for f in $([ $ph = single ] && echo req_per_s || echo rows_per_s) kettle_cpu_us postgres_cpu_us wal_bytes; do
		for r in $(seq "$ROUNDS"); do
			g=$(grep "^STEP grown-$r $ph " "$work/ab.txt" | sed -n "s/.* $f=\([0-9.]*\).*/\1/p")
			h=$(grep "^STEP small-$r $ph " "$work/ab.txt" | sed -n "s/.* $f=\([0-9.]*\).*/\1/p")
			awk -v g="$g" -v h="$h" 'BEGIN { printf "%.3f\n", g / h }'
		done >"$work/r.txt"
		gm=$(awk '{ s += log($1) } END { printf "%.3f", exp(s / NR) }' "$work/r.txt")
		echo "GROWN/SMALL $ph $f geomean $gm median $(median <"$work/r.txt") (rounds: $(tr '\n' ' ' <"$work/r.txt"))"
		rec_fig "grown/small $ph $f, geometric mean of rounds" "$gm" ratio
	done
done
rec_end
