#!/usr/bin/env bash
# A/B of GET /v1/statistics latency between two kettle binaries on one
# seeded PostgreSQL database, interleaved in one run (a shared machine loads
# both alike): kettle seed fills DEVICES kettles × DAYS days at INTERVAL
# (the rollups hold one row per hour of it: 696 for 29 days, however many
# kettles), then ROUNDS × (A, B), each kettle serve started on the seeded
# database in turn, N sequential requests on one keep-alive connection
# (bench/pgbench stats) of the open range (all history: hours_of_day), of
# the bounded range over the whole seeded history (the rollups of every
# hour) and of one kettle's history, a page of 1,000 readings (GET
# /v1/devices/ID/measurements, as the dashboard's charts read it). Prints
# every round and the median ratios B/A of p50 and p99.
#
#   bench/pg-stats-ab.sh OLD_KETTLE_BIN NEW_KETTLE_BIN
#   ROUNDS=5 N=4000 DEVICES=2000 DAYS=29 bench/pg-stats-ab.sh bin/kettle.old bin/kettle
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${ROUNDS:=1}" "${N:=20}" "${DEVICES:=10}" "${DAYS:=2}"
[ $# = 2 ] || { echo "usage: $0 A_KETTLE_BIN B_KETTLE_BIN" >&2; exit 2; }
ROUNDS=${ROUNDS:-5}
N=${N:-2000}
NDEV=${DEVICES:-500}
DAYS=${DAYS:-29}
INTERVAL=${INTERVAL:-15m}
END=${END:-$(date -u +%Y-%m-%dT00:00:00Z)}
. bench/lib/pg-cluster.sh
rerun="ROUNDS=$ROUNDS N=$N DEVICES=$NDEV DAYS=$DAYS INTERVAL=$INTERVAL END=$END bench/pg-stats-ab.sh $1 $2"
echo "rerun: $rerun"
rec_begin pg-stats-ab.sh "$rerun"
ab_start pgstats "$1" "$2"
machine_line
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
dsn=$(pg_db stats)
"$work/A" seed --db "$dsn" --devices "$NDEV" --days "$DAYS" --interval "$INTERVAL" --end "$END" --quiet | tail -1
from=$(date -u -d "$END - $DAYS days" +%Y-%m-%dT%H:%M:%SZ)
range="from=$from&to=$END"
mkdir -p "$work/data"
for r in $(seq "$ROUNDS"); do
	for v in A B; do
		port=$(free_port)
		"$work/$v" serve --addr 127.0.0.1:$port --db "$dsn" --data-dir "$work/data" 2>"$work/serve-$v-$r.log" &
		kpid=$!
		for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
		if [ -z "${dev:-}" ]; then # the first kettle in id order: its history is the third query
			dev=$(curl -sf -H "Authorization: Bearer $(cat "$work/data/operator-token")" "http://127.0.0.1:$port/v1/devices?limit=1" | jq -r '.devices[0].id')
		fi
		for q in open bounded history; do
			qs=""; path=/v1/statistics
			[ "$q" = bounded ] && qs=$range
			[ "$q" = history ] && qs="$range&limit=1000" && path=/v1/devices/$dev/measurements
			"$work/pgbench" stats --url "http://127.0.0.1:$port" --data-dir "$work/data" -n "$N" --query "$qs" --path "$path" |
				awk -v r=$r -v v=$v -v q=$q '/^RESULT (statistics|get)/ { for (i = 1; i <= NF; i++) { split($i, kv, "="); x[kv[1]] = kv[2] }
					printf "AB stats round=%d bin=%s range=%s p50_ms=%s p99_ms=%s max_ms=%s measurement_count=%s bytes=%s load=%s\n", r, v, q, x["p50_ms"], x["p99_ms"], x["max_ms"], x["measurement_count"], x["bytes"], "'"$(cut -d' ' -f1 /proc/loadavg)"'" }'
		done
		kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
	done
done | tee "$work/ab.txt"
ratios() { ab_ratios "$work/ab.txt" stats "$2" "range=$1"; } # ratios RANGE FIELD: B/A per round, one a line
for q in open bounded history; do
	echo "RATIO B/A $q, median of $ROUNDS rounds: p50 $(ratios $q p50_ms | median) (rounds: $(ratios $q p50_ms | tr '\n' ' ')); p99 $(ratios $q p99_ms | median) (rounds: $(ratios $q p99_ms | tr '\n' ' '))"
	for f in p50_ms p99_ms; do
		for v in A B; do
			rec_fig "$v $q $f, median of rounds" "$(awk -v q="range=$q" -v v="bin=$v" -v f="$f" '$1 == "AB" && index($0, " " q " ") && index($0, " " v " ") {
				for (i = 3; i <= NF; i++) { split($i, p, "="); if (p[1] == f) print p[2] } }' "$work/ab.txt" | median)" ms
		done
		rec_fig "B/A $q $f, median of rounds" "$(ratios $q $f | median)" ratio
	done
done
rec_end
