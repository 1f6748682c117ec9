#!/usr/bin/env bash
# A/B of two kettle binaries on PostgreSQL, interleaved in one run on one
# throwaway cluster, so that a shared or noisy machine loads both alike:
# ROUNDS × (A, B) of
#   single: acknowledged case-study POST /measurement req/s (wrk +
#           bench/measurement.lua, as bench/pg-ingest.sh benchmark 3);
#   v1:     acknowledged rows/s of POST /v1/measurements, batches of 500
#           (pgbench ingest, as bench/pg-ingest.sh benchmark 2),
# each on a fresh database, with the CPU seconds of kettle serve and of the
# cluster per request / row. Prints every round and the median ratio B/A.
#
#   bench/pg-ab.sh OLD_KETTLE_BIN NEW_KETTLE_BIN
#   ROUNDS=5 DURATION=20s SERVE_ARGS="--writers 8" bench/pg-ab.sh bin/kettle.old bin/kettle
#
# A "binary" may be a script that execs kettle with flags, to A/B a setting:
#   printf '#!/bin/sh\nexec bin/kettle "$@" --writers 2\n' > /tmp/k2; chmod +x /tmp/k2
# ACCESS_LOG_SAMPLE (default 0.01, kettle serve's default, as bench/pg-ingest.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${ROUNDS:=1}" "${DURATION:=2s}" "${CONNS:=4}" "${V1_CONNS:=2}" "${DEVICES:=10}" "${PG_WARM_WAL:=0}"
[ $# = 2 ] || { echo "usage: $0 A_KETTLE_BIN B_KETTLE_BIN" >&2; exit 2; }
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-15s}
CONNS=${CONNS:-64}
V1_CONNS=${V1_CONNS-16}   # "" skips the v1 phase
NDEV=${DEVICES:-2000}
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
# The fresh cluster's WAL files made and recycled first (pg_warm_wal), so
# that round 1's first side does not pay alone for creating them.
export PG_WARM_WAL=${PG_WARM_WAL:-4096}
. bench/lib/pg-cluster.sh
rerun="PG_WARM_WAL=$PG_WARM_WAL ROUNDS=$ROUNDS ACCESS_LOG_SAMPLE=${ACCESS_LOG_SAMPLE:-0.01} DURATION=$DURATION CONNS=$CONNS V1_CONNS=$V1_CONNS DEVICES=$NDEV SERVE_ARGS=\"${SERVE_ARGS:-}\" bench/pg-ab.sh $1 $2"
echo "rerun: $rerun"
ab_start pgab "$1" "$2"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
serve() { # serve BIN DB: start kettle serve on a fresh database
	local port; port=$(free_port)
	"$work/$1" serve --addr 127.0.0.1:$port --db "$(pg_db "$2")" --data-dir "$work/data-$2" --access-log-sample "${ACCESS_LOG_SAMPLE:-0.01}" ${SERVE_ARGS:-} 2>"$work/serve-$2.log" &
	kpid=$!; url=http://127.0.0.1:$port
	for _ in $(seq 300); do curl -sf "$url/readyz" >/dev/null 2>&1 && return 0; sleep 0.1; done
	echo "not up: $url"; cat "$work/serve-$2.log"; exit 1
}
stop() { kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=; }
for r in $(seq "$ROUNDS"); do
	for v in A B; do
		serve $v single_${v,,}_$r
		"$work/pgbench" login --url "$url" -n "$NDEV" >"$work/devices.txt"
		export DEVICES="$work/devices.txt" BASE_EPOCH=$(( $(date +%s) - 7200 ))
		k0=$(proc_cpu $kpid); s0=$(pg_cpu)
		out=$(wrk -t2 -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "$url" | grep RESULT)
		k1=$(proc_cpu $kpid); s1=$(pg_cpu)
		echo "$out" | awk -v r=$r -v v=$v -v k=$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}') -v p=$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}') \
			'{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
			   printf "AB single round=%d bin=%s rps=%s p50_ms=%s p99_ms=%s non2xx=%s kettle_cpu_us_per_req=%.0f postgres_cpu_us_per_req=%.0f load=%s\n",
			   r, v, x["rps"], x["p50_ms"], x["p99_ms"], x["errors_status"], k / x["requests"] * 1e6, p / x["requests"] * 1e6, "'"$(cut -d' ' -f1 /proc/loadavg)"'" }'
		stop
		[ -n "$V1_CONNS" ] || continue
		serve $v v1_${v,,}_$r
		k0=$(proc_cpu $kpid); s0=$(pg_cpu)
		out=$("$work/pgbench" ingest --url "$url" --data-dir "$work/data-v1_${v,,}_$r" --devices "$NDEV" --batch 500 --conns "$V1_CONNS" --duration "$DURATION" --warmup 2s | grep RESULT)
		k1=$(proc_cpu $kpid); s1=$(pg_cpu)
		echo "$out" | awk -v r=$r -v v=$v -v k=$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}') -v p=$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}') \
			'{ for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
			   printf "AB v1 round=%d bin=%s rows_per_s=%s p50_ms=%s p99_ms=%s errors=%s kettle_cpu_us_per_row=%.2f postgres_cpu_us_per_row=%.2f load=%s\n",
			   r, v, x["rows_per_s"], x["p50_ms"], x["p99_ms"], x["errors"], k / x["stored"] * 1e6, p / x["stored"] * 1e6, "'"$(cut -d' ' -f1 /proc/loadavg)"'" }'
		stop
	done
done | tee "$work/ab.txt"
# (CPU per row includes the 2 s warm-up's work in the numerator: an overestimate, alike for A and B.)
ratios() { ab_ratios "$work/ab.txt" "$1" "$2"; } # ratios KIND FIELD: B/A per round, one a line
rec_begin pg-ab.sh "$rerun"
ab_record "$work/ab.txt" single rps req/s
ab_record "$work/ab.txt" single kettle_cpu_us_per_req µs/req
[ -z "$V1_CONNS" ] || ab_record "$work/ab.txt" v1 rows_per_s rows/s
[ -z "$V1_CONNS" ] || ab_record "$work/ab.txt" v1 kettle_cpu_us_per_row µs/row
rec_ratio "$(ratios single rps | median)"
rec_end
[ -n "$V1_CONNS" ] || { echo "RATIO B/A, median of $ROUNDS rounds: single req/s $(ratios single rps | median) (rounds: $(ratios single rps | tr '\n' ' '))"; exit 0; }
echo "RATIO B/A, median of $ROUNDS rounds: single req/s $(ratios single rps | median) (rounds: $(ratios single rps | tr '\n' ' '))"\
"; v1 rows/s $(ratios v1 rows_per_s | median) (rounds: $(ratios v1 rows_per_s | tr '\n' ' '))"
