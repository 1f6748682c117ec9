#!/usr/bin/env bash
# One run, one machine: the same load acknowledged after the PostgreSQL
# commit (direct, the default) and through the readings log (kettle serve
# --log: Kafka ×3 from deploy/kafka, acks=all, and 2 writers), each on a
# fresh database and topic:
#   single: case-study POST /measurement, one reading each (wrk, CONNS
#           connections, bench/measurement.lua);
#   batch:  POST /v1/measurements, BATCH readings each (pgbench ingest,
#           V1_CONNS connections).
# For each: acknowledged readings/s, upload p50/p99 (closed loop, from
# wrk/pgbench), and the CPU per reading of every process — kettle front,
# writers, the three brokers, PostgreSQL — counted until the writers have
# stored every acknowledged reading (GET /drained), so the log's deferred
# work is in. Appends one JSON line to bench/results.jsonl.
#
#   bench/log-vs-direct.sh
#   DURATION=20s CONNS=64 V1_CONNS=16 BATCH=100 DEVICES=2000 bench/log-vs-direct.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DURATION:=2s}" "${CONNS:=4}" "${V1_CONNS:=2}" "${BATCH:=10}" "${DEVICES:=10}" "${WARMUP:=2s}"
DURATION=${DURATION:-15s}
CONNS=${CONNS:-64}
V1_CONNS=${V1_CONNS:-16}
BATCH=${BATCH:-100}
NDEV=${DEVICES:-2000}
cmdline="DURATION=$DURATION CONNS=$CONNS V1_CONNS=$V1_CONNS BATCH=$BATCH DEVICES=$NDEV bench/log-vs-direct.sh"
command -v wrk >/dev/null || { echo "wrk missing: make deps"; exit 1; }
. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-logbench-XXXXXX)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	deploy/kafka/kafka.sh stop "$work/kafka" >/dev/null 2>&1 || true
	pg_stop
	rm -rf "$work"
}
trap cleanup EXIT
echo "rerun: $cmdline"
machine_line
build_kettle "$work"
bench_build "$work/pgbench" ./bench/pgbench
pg_start
t0=$(date +%s.%N)
deploy/kafka/kafka.sh start "$work/kafka"
echo "kafka: 3 nodes up in $(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN{printf "%.1f", b-a}') s"
LOG="kafka://$(deploy/kafka/kafka.sh bootstrap)"
# auth USER: kettle serve's flags to reach the brokers as USER (kafka.sh's
# TLS and SCRAM users; nothing with KAFKA_TLS=0)
auth() { [ "$(cat "$work/kafka/tls-mode")" = 1 ] && echo "--log-ca $work/kafka/tls/ca.crt --log-user $1 --log-password-file $work/kafka/users/$1.password" || true; }
brokers() { for n in 1 2 3; do cat "$work/kafka/node$n/pid"; done; }
cpu_of() { local t=0 p; for p in "$@"; do t=$(awk -v a=$t -v b=$(proc_cpu "$p") 'BEGIN{print a+b}'); done; echo "$t"; }

wait_url() { for _ in $(seq 600); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }
# start SIDE NAME: a front (and for the log, 2 writers) on a fresh database
start() {
	local dsn port; dsn=$(pg_db "$2"); port=$(free_port)
	front_url=http://127.0.0.1:$port; writers=(); writer_urls=()
	local logargs=()
	# the topic and group names kafka.sh's ACLs cover (kettle.…, kettle-…)
	[ "$1" = log ] && logargs=(--log "$LOG/kettle.bench.$2" --log-group "kettle-w-$2")
	# shellcheck disable=SC2046
	"$work/kettle" serve --addr 127.0.0.1:$port --db "$dsn" --data-dir "$work/data-$2" --log-level warn --access-log-sample 0 "${logargs[@]}" $([ "$1" = log ] && auth front) 2>"$work/front-$2.log" &
	front=$!; pids+=($front)
	wait_url "$front_url/readyz"
	if [ "$1" = log ]; then
		for i in 1 2; do
			local wp; wp=$(free_port)
			# shellcheck disable=SC2046
			"$work/kettle" serve --role writer --addr 127.0.0.1:$wp --db "$dsn" --data-dir "$work/data-$2" --log-level warn "${logargs[@]}" $(auth writer) 2>"$work/writer$i-$2.log" &
			writers+=($!); pids+=($!); writer_urls+=(http://127.0.0.1:$wp)
			wait_url "http://127.0.0.1:$wp/healthz"
		done
	fi
}
stop_all() { kill "$front" "${writers[@]}" 2>/dev/null || true; wait "$front" "${writers[@]}" 2>/dev/null || true; }
snap() { echo "$(proc_cpu $front) $(cpu_of "${writers[@]}") $(cpu_of $(brokers)) $(pg_cpu)"; }

declare -A fig
# phase SIDE KIND: run one measurement, fill fig[SIDE.KIND.*]
phase() {
	local side=$1 kind=$2 name=${1}_${2} out readings rate p50 p99 a b drain=0
	start "$side" "$name"
	if [ "$kind" = single ]; then
		"$work/pgbench" login --url "$front_url" -n "$NDEV" >"$work/devices-$name.txt"
		a=$(snap); local s0; s0=$(date +%s.%N)
		out=$(DEVICES="$work/devices-$name.txt" BASE_EPOCH=$(( $(date +%s) - 7200 )) wrk -t2 -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "$front_url" | grep RESULT)
		readings=$(echo "$out" | sed -n 's/.*requests=\([0-9]*\).*/\1/p')
		local bad; bad=$(echo "$out" | sed -n 's/.*errors_status=\([0-9]*\).*/\1/p'); readings=$((readings - bad))
		rate=$(echo "$out" | sed -n 's/.* rps=\([0-9.]*\).*/\1/p')
	else
		a=$(snap)
		out=$("$work/pgbench" ingest --url "$front_url" --data-dir "$work/data-$name" --devices "$NDEV" --batch "$BATCH" --conns "$V1_CONNS" --duration "$DURATION" --warmup 2s | grep RESULT)
		readings=$(echo "$out" | sed -n 's/.*stored=\([0-9]*\).*/\1/p')
		rate=$(echo "$out" | sed -n 's/.*rows_per_s=\([0-9.]*\).*/\1/p')
	fi
	p50=$(echo "$out" | sed -n 's/.*p50_ms=\([0-9.]*\).*/\1/p'); p99=$(echo "$out" | sed -n 's/.*p99_ms=\([0-9.]*\).*/\1/p')
	if [ "$side" = log ]; then
		local d0; d0=$(date +%s.%N)
		for _ in $(seq 1200); do curl -sf "${writer_urls[0]}/drained" >/dev/null 2>&1 && break; sleep 0.25; done
		drain=$(awk -v a=$d0 -v b=$(date +%s.%N) 'BEGIN{printf "%.1f", b-a}')
	fi
	b=$(snap)
	read -r f0 w0 k0 p0 <<<"$a"; read -r f1 w1 k1 p1 <<<"$b"
	us() { awk -v a=$1 -v b=$2 -v n=$readings 'BEGIN{printf "%.2f", (b-a)/n*1e6}'; }
	fig[$side.$kind.rate]=$rate; fig[$side.$kind.p50]=$p50; fig[$side.$kind.p99]=$p99
	fig[$side.$kind.front]=$(us $f0 $f1); fig[$side.$kind.writers]=$(us $w0 $w1); fig[$side.$kind.kafka]=$(us $k0 $k1); fig[$side.$kind.pg]=$(us $p0 $p1)
	# The direct path needs no Kafka: its total leaves out the idle
	# brokers (still printed, as what they cost sitting there).
	local kafka_in=${fig[$side.$kind.kafka]}; [ "$side" = direct ] && kafka_in=0
	fig[$side.$kind.total]=$(awk -v a=${fig[$side.$kind.front]} -v b=${fig[$side.$kind.writers]} -v c=$kafka_in -v d=${fig[$side.$kind.pg]} 'BEGIN{printf "%.2f", a+b+c+d}')
	fig[$side.$kind.drain]=$drain
	local count; count=$(curl -s -H "Authorization: Bearer $(cat "$work/data-$name/operator-token")" "$front_url/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p')
	printf "%-6s %-6s acked readings/s %8s  p50 %7s ms  p99 %8s ms  CPU µs/reading: front %7s writers %7s kafka %7s postgres %7s total %7s  (%s acked, %s stored, drain %ss; direct: total without the idle brokers)\n" \
		"$side" "$kind" "$rate" "$p50" "$p99" "${fig[$side.$kind.front]}" "${fig[$side.$kind.writers]}" "${fig[$side.$kind.kafka]}" "${fig[$side.$kind.pg]}" "${fig[$side.$kind.total]}" "$readings" "$count" "$drain"
	stop_all
}
writers=()
# Warm-up, not measured: the brokers' JIT compiles their hot paths under
# the first load (it cost the first measured phase ×50 in Kafka CPU).
start log warmup
"$work/pgbench" ingest --url "$front_url" --data-dir "$work/data-warmup" --devices "$NDEV" --batch 10 --conns "$CONNS" --duration "${WARMUP:-20s}" --warmup 0s >/dev/null
stop_all
echo "warm-up done (${WARMUP:-20s} of batches of 10 through the log)"
for kind in single batch; do
	for side in direct log; do phase $side $kind; done
done
ratio=$(awk -v a=${fig[direct.single.rate]} -v b=${fig[log.single.rate]} 'BEGIN{printf "%.3f", b/a}')
echo "RATIO log/direct acked readings/s: single $ratio, batch $(awk -v a=${fig[direct.batch.rate]} -v b=${fig[log.batch.rate]} 'BEGIN{printf "%.3f", b/a}')"
# The figure the run exists for first: acknowledged single readings/s
# through the log, against the direct path (its ceiling).
rec_begin log-vs-direct.sh "$cmdline"
rec_fig log.single.rate "${fig[log.single.rate]}" readings/s
rec_ceiling direct.single.rate "${fig[direct.single.rate]}" readings/s
rec_ratio "$ratio"
declare -A unit=([rate]=readings/s [p50]=ms [p99]=ms [front]="µs CPU/reading" [writers]="µs CPU/reading" [kafka]="µs CPU/reading"
	[pg]="µs CPU/reading" [total]="µs CPU/reading" [drain]=s)
for k in $(printf '%s\n' "${!fig[@]}" | sort); do
	[ "$k" = log.single.rate ] || rec_fig "$k" "${fig[$k]:-0}" "${unit[${k##*.}]}"
done
rec_end
