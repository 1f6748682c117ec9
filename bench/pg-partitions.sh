#!/usr/bin/env bash
# What many partitions cost. kettle partitions measurements by UTC day, so
# a store that keeps everything (the default) holds a partition for every
# day of its history: ~365 a year. One throwaway cluster, two databases
# with the same rows (kettle seed: DEVICES kettles × DAYS days at INTERVAL,
# ending at today's 00:00 UTC):
#   days:   kettle's own day partitions (DAYS of them, and today's ahead);
#   months: the same history in month partitions, attached before the
#           seeding (as a database made before day partitions holds them;
#           kettle uses them as they are): ~DAYS/30 partitions.
# Then, ROUNDS times (each side first in half of them), against kettle serve
# on each database in turn:
#   single:  acknowledged case-study POST /measurement req/s (wrk +
#            bench/measurement.lua, CONNS connections, readings of now);
#   v1:      acknowledged rows/s of POST /v1/measurements, batches of 500
#            (pgbench ingest, V1_CONNS connections; its readings start 40
#            days ago, inside the seeded history);
#   history: GET /v1/devices/{id}/measurements p50/p99, sequential, one
#            kettle: the oldest 100 (history_oldest: no bound, every
#            partition a candidate), a page of 100 after a cursor in the
#            middle of the history (history_after), the last day's
#            (history_lastday: from=yesterday) and those of a kettle that
#            never reported (history_none: registered by POST /login);
# with CPU µs of kettle serve and PostgreSQL a request or reading, and the
# median ratio days / months of each figure.
#
#   bench/pg-partitions.sh                           # 2,000 kettles × 1,000 days at 24h (2M rows; 1,000 against 34 partitions)
#   DAYS=365 ROUNDS=2 DURATION=10s bench/pg-partitions.sh   # a quicker run
#
# PHASES (default "single v1 history") picks the phases. OLD_BIN=path: each
# round also runs the history phase against that kettle binary (right after
# the one under test, on the same database), and the median ratio new / old
# of each history figure on each database is printed: an A/B of a change to
# the read path in one run.
#   PHASES=history OLD_BIN=/tmp/kettle.old bench/pg-partitions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DAYS:=40}" "${DURATION:=2s}" "${CONNS:=4}" "${HISTORY_N:=10}" "${ROUNDS:=1}"
NDEV=${DEVICES:-2000}
DAYS=${DAYS:-1000}
INTERVAL=${INTERVAL:-24h}
DURATION=${DURATION:-20s}
CONNS=${CONNS:-256}
V1_CONNS=${V1_CONNS:-16}
HISTORY_N=${HISTORY_N:-500}
WORKERS=${WORKERS:-3}
ROUNDS=${ROUNDS:-4}
PHASES=${PHASES:-single v1 history}
OLD_BIN=${OLD_BIN:-}
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
. bench/lib/pg-cluster.sh
PORT_K=$(free_port)
END=$(date -u +%Y-%m-%dT00:00:00Z)
work_start pgparts
rerun="${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }DEVICES=$NDEV DAYS=$DAYS INTERVAL=$INTERVAL DURATION=$DURATION CONNS=$CONNS V1_CONNS=$V1_CONNS HISTORY_N=$HISTORY_N ROUNDS=$ROUNDS PHASES=\"$PHASES\"${OLD_BIN:+ OLD_BIN=$OLD_BIN} bench/pg-partitions.sh"
echo "rerun: $rerun"
rec_begin pg-partitions.sh "$rerun"
machine_line
build_kettle "$work"
[ -z "$OLD_BIN" ] || cp "$OLD_BIN" "$work/kettle-old"
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
dsn_of() { echo "postgres://postgres@/$1?host=$PG_DIR&port=$PG_PORT&sslmode=disable"; }
parts() { pg_sql "$1" "SELECT count(*) FROM pg_inherits WHERE inhparent = 'measurements'::regclass"; }

for db in days months; do
	pg_db "$db" >/dev/null
	if [ "$db" = months ]; then
		# a partition a month from the history's first day to END's month
		m=$(date -u -d "$END - $DAYS days" +%Y-%m-01)
		last=$(date -u -d "$END" +%Y-%m-01)
		while [[ "$m" < "$last" || "$m" == "$last" ]]; do
			pg_attach_month months "$m"
			m=$(date -u -d "$m + 1 month" +%Y-%m-01)
		done
	fi
	t0=$(date +%s.%N)
	"$work/kettle" seed --db "$(dsn_of "$db")" --devices "$NDEV" --days "$DAYS" --interval "$INTERVAL" --end "$END" --workers "$WORKERS" --quiet | tail -1
	t1=$(date +%s.%N)
	pg_sql "$db" "VACUUM (ANALYZE) measurements" >/dev/null
	echo "SEED $db seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') partitions=$(parts "$db") rows=$(pg_sql "$db" "SELECT count(*) FROM measurements")"
done


# history DB ROUND SUFFIX: the history phase's three figures against the
# kettle serve running (RUN lines named history_oldest$SUFFIX and so on)
history() {
	local db=$1 r=$2 out dev mid
	dev=$(head -1 "$work/devices.txt")
	mid=$(date -u -d "$END - $((DAYS / 2)) days" +%Y-%m-%dT%H:%M:%SZ)
	# a kettle registered (POST /login) that never reported, one per database
	[ -s "$work/nodev-$db" ] || "$work/pgbench" login --url "http://127.0.0.1:$PORT_K" -n 1 >"$work/nodev-$db"
	for h in "oldest|$dev|limit=100" "after|$dev|after=$mid&limit=100" "lastday|$dev|from=$(date -u -d "$END - 1 day" +%Y-%m-%dT%H:%M:%SZ)&limit=100" \
		"none|$(cat "$work/nodev-$db")|limit=100"; do
		out=$("$work/pgbench" stats --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data-$db" --n "$HISTORY_N" --path "/v1/devices/$(echo "$h" | cut -d'|' -f2)/measurements" --query "${h##*|}" | grep RESULT)
		echo "RUN $db-$r history_${h%%|*}$3 $(echo "$out" | grep -o 'bytes=.*')"
	done
}

# measure DB ROUND: the phases against kettle serve on DB
measure() {
	local db=$1 r=$2 n0 n1 k0 k1 s0 s1 out
	pg_sql "$db" "CHECKPOINT" >/dev/null
	kettle_serve "$db" "$(dsn_of "$db")"
	pg_sql "$db" "SELECT id FROM devices ORDER BY id" >"$work/devices.txt"
	if [[ " $PHASES " == *" single "* ]]; then
	# single readings of now, a new second for each round (no duplicates)
	export DEVICES="$work/devices.txt" BASE_EPOCH=$(($(date -u +%s) + r * 100))
	n0=$(kettle_count "$db"); k0=$(proc_cpu "$kpid"); s0=$(pg_cpu)
	out=$(wrk -t2 -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_K" | grep RESULT)
	n1=$(kettle_count "$db"); k1=$(proc_cpu "$kpid"); s1=$(pg_cpu)
	echo "$out" | awk -v s="$db-$r" -v n=$((n1 - n0)) -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v p="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" '
		{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
		  printf "RUN %s single req_per_s=%s p99_ms=%s non2xx=%s stored=%d kettle_cpu_us=%.1f postgres_cpu_us=%.1f\n",
		    s, x["rps"], x["p99_ms"], x["errors_status"], n, k / n * 1e6, p / n * 1e6 }'
	fi
	if [[ " $PHASES " == *" v1 "* ]]; then
	k0=$(proc_cpu "$kpid"); s0=$(pg_cpu)
	out=$("$work/pgbench" ingest --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data-$db" --devices 2000 --batch 500 \
		--conns "$V1_CONNS" --duration "$DURATION" --warmup 0s --shift "$((r * 3600))s" | grep RESULT)
	k1=$(proc_cpu "$kpid"); s1=$(pg_cpu)
	echo "$out" | awk -v s="$db-$r" -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v p="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" '
		{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
		  n = x["stored"]
		  printf "RUN %s v1 rows_per_s=%s p99_ms=%s errors=%s duplicates=%s kettle_cpu_us=%.2f postgres_cpu_us=%.2f\n",
		    s, x["rows_per_s"], x["p99_ms"], x["errors"], x["duplicates"], k / n * 1e6, p / n * 1e6 }'
	fi
	if [[ " $PHASES " == *" history "* ]]; then
		history "$db" "$r" ""
		if [ -n "$OLD_BIN" ]; then
			kettle_stop
			SERVE_BIN="$work/kettle-old" kettle_serve "$db" "$(dsn_of "$db")"
			history "$db" "$r" _old
		fi
	fi
	kettle_stop
}

for r in $(seq "$ROUNDS"); do
	echo "--- round $r of $ROUNDS: $([ $((r % 2)) = 1 ] && echo "days, then months" || echo "months, then days") ---"
	if ((r % 2)); then order="days months"; else order="months days"; fi
	for db in $order; do measure "$db" "$r" | tee -a "$work/runs.txt"; done
done
# the median over the rounds of days / months, per phase and figure
ratio() { # PHASE FIGURE [DB_A DB_B PHASE_B]: A's PHASE / B's PHASE_B (days/months, PHASE, by default)
	local da=${3:-days} db=${4:-months} pb=${5:-$1}
	for r in $(seq "$ROUNDS"); do
		a=$(grep "^RUN $da-$r $1 " "$work/runs.txt" | sed -n "s/.* $2=\([0-9.]*\).*/\1/p") || true
		b=$(grep "^RUN $db-$r $pb " "$work/runs.txt" | sed -n "s/.* $2=\([0-9.]*\).*/\1/p") || true
		awk -v a="$a" -v b="$b" 'BEGIN { if (a != "" && b > 0) printf "%.3f\n", a / b }'
	done >"$work/r.txt"
	[ -s "$work/r.txt" ] || return 0
	local what="days/months"
	[ -z "${3:-}" ] || what="new/old ($da)"
	echo "RATIO $what $1 $2 median $(median <"$work/r.txt") (rounds: $(tr '\n' ' ' <"$work/r.txt"))"
	rec_fig "$what $1 $2, median of rounds" "$(median <"$work/r.txt")" ratio
}
echo "--- $(parts days) partitions against $(parts months): the same seeded history, then each round's live writes in both ---"
ratio single req_per_s; ratio single kettle_cpu_us; ratio single postgres_cpu_us
ratio v1 rows_per_s; ratio v1 kettle_cpu_us; ratio v1 postgres_cpu_us
for h in oldest after lastday none; do
	ratio "history_$h" p50_ms; ratio "history_$h" p99_ms
	for db in days months; do ratio "history_$h" p50_ms "$db" "$db" "history_${h}_old"; done
done
echo "done: load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
rec_end
