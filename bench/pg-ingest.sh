#!/usr/bin/env bash
# Issue 3 benchmarks 2 and 3 on a throwaway PostgreSQL cluster, against
# `kettle serve --db postgres://…`:
#   2. batched ingest, POST /v1/measurements with batches of 500 readings of
#      one device (a kettle uploading its backlog), acknowledged rows/s, against
#      the ceiling: a raw binary COPY of the identical rows into a scratch
#      table of the same shape, measured before and after in the same run;
#   3. acknowledged single-measurement requests/s (case-study POST
#      /measurement, many devices, wrk + bench/measurement.lua as
#      bench/ingest.sh) against the bare JSON-decoding handler (bench/bare)
#      driven by the same client in the same run.
#
#   bench/pg-ingest.sh
#   DURATION=30s CONNS=32 DEVICES=4000 SERVE_ARGS="--writers 3" bench/pg-ingest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
NDEV=${DEVICES:-2000}
DURATION=${DURATION:-20s}
CONNS=${CONNS:-64}            # wrk connections (benchmark 3)
THREADS=${THREADS:-2}
V1_CONNS=${V1_CONNS:-16}      # pgbench ingest connections (benchmark 2)
V1_DEVICES=${V1_DEVICES:-2000}
CEIL_ROWS=${CEIL_ROWS:-2000000}
PORT_K=${PORT_K:-$(free_port)}
PORT_B=${PORT_B:-$(free_port)}
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
. bench/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-pgbench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pg_stop; rm -rf "$work"; }
trap cleanup EXIT
echo "rerun: ${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }DEVICES=$NDEV DURATION=$DURATION CONNS=$CONNS THREADS=$THREADS V1_CONNS=$V1_CONNS V1_DEVICES=$V1_DEVICES CEIL_ROWS=$CEIL_ROWS SERVE_ARGS=\"${SERVE_ARGS:-}\" bench/pg-ingest.sh"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
# KETTLE_BIN: a prebuilt kettle (e.g. when the working tree has unrelated work in progress)
if [ -n "${KETTLE_BIN:-}" ]; then cp "$KETTLE_BIN" "$work/kettle"; else go build -o "$work/kettle" ./cmd/kettle; fi
go build -o "$work/bare" ./bench/bare
go build -o "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
ceil_dsn=$(pg_db ceiling)
dsn=$(pg_db kettle)
wait_up() { for _ in $(seq 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }


ceiling() {
	local s0 s1 out; s0=$(pg_cpu)
	out=$( { /usr/bin/time -f "__CPU %U %S" "$work/pgbench" ceiling --dsn "$ceil_dsn" --rows ingest --devices "$V1_DEVICES" --batch 500 \
		--total "$CEIL_ROWS" --chunk-rows 20000 --workers 3; } 2>&1 ); sleep 1; s1=$(pg_cpu)
	echo "$out" | grep RESULT
	echo "$out" | awk -v s0="$s0" -v s1="$s1" '/^__CPU/ { printf "CPU ceiling client_s=%.2f postgres_s=%.2f\n", $2+$3, s1-s0 }'
	pg_sql ceiling "CHECKPOINT" >/dev/null
}
echo "--- ceiling (before): raw binary COPY of pgbench ingest's rows ($CEIL_ROWS, 20000-row COPYs, 3 streams) into a scratch table (device, t primary key) ---"
c1=$(ceiling); echo "$c1"

"$work/kettle" serve --addr 127.0.0.1:$PORT_K --db "$dsn" --data-dir "$work/data" \
	--access-log-sample "${ACCESS_LOG_SAMPLE:-0.01}" ${SERVE_ARGS:-} 2>"$work/serve.log" & pids+=($!)
wait_up "http://127.0.0.1:$PORT_K/readyz"
echo "--- POST /v1/measurements, batches of 500 readings of one device, $V1_CONNS connections, $V1_DEVICES devices, $DURATION; kettle serve --db postgres ${SERVE_ARGS:-} ---"
kpid=${pids[-1]}; k0=$(proc_cpu "$kpid"); s0=$(pg_cpu)
v1out=$( { /usr/bin/time -f "__CPU %U %S" "$work/pgbench" ingest --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data" --devices "$V1_DEVICES" \
	--batch 500 --conns "$V1_CONNS" --duration "$DURATION" --warmup 0s; } 2>&1 )
k1=$(proc_cpu "$kpid"); s1=$(pg_cpu)
v1=$(echo "$v1out" | grep RESULT); echo "$v1out" | grep -v __CPU
echo "$v1out" | awk -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v s0="$s0" -v s1="$s1" '/^__CPU/ { printf "CPU ingest client_s=%.2f kettle_serve_s=%.2f postgres_s=%.2f\n", $2+$3, k, s1-s0 }' | tee "$work/ingest.cpu"
pg_sql kettle "CHECKPOINT" >/dev/null
echo "--- ceiling (after) ---"
c2=$(ceiling); echo "$c2"
rv=$(echo "$v1" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p')
r1=$(echo "$c1" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p'); r2=$(echo "$c2" | sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p')
awk -v s="$rv" -v a="$r1" -v b="$r2" 'BEGIN { c=(a+b)/2; printf "RATIO v1 ingest/ceiling = %.3f (ingest %d rows/s acknowledged; ceiling %d / %d rows/s before / after, mean %.0f); goal >= 0.75\n", s/c, s, a, b, c }'
sv=$(echo "$v1" | sed -n 's/.*stored=\([0-9]*\).*/\1/p')
{ echo "$c1"; echo "$c2"; cat "$work/ingest.cpu"; } | awk -v sv="$sv" -v cr="$CEIL_ROWS" '
	/^CPU ceiling/ { split($3, a, "="); split($4, b, "="); cc += a[2] + b[2]; cn++ }
	/^CPU ingest/ { split($3, a, "="); split($4, k, "="); split($5, b, "="); cl = a[2]; ks = k[2]; pg = b[2] }
	END { cu = cc / cn / cr * 1e6; printf "CPU per row: ceiling %.2f µs (client + postgres); v1 ingest %.2f µs = pgbench client %.2f + kettle serve %.2f + postgres %.2f (counted over the measured window, warm-up 0)\n", cu, (cl + ks + pg) / sv * 1e6, cl / sv * 1e6, ks / sv * 1e6, pg / sv * 1e6 }'

echo "--- case-study POST /measurement: registering $NDEV devices through POST /login ---"
"$work/pgbench" login --url "http://127.0.0.1:$PORT_K" -n "$NDEV" >"$work/devices.txt"
[ "$(grep -c . "$work/devices.txt")" = "$NDEV" ] || { echo "registration failed"; exit 1; }
"$work/bare" --addr 127.0.0.1:$PORT_B 2>"$work/bare.log" & pids+=($!)
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT_B/" && break; sleep 0.1; done
export DEVICES="$work/devices.txt" BASE_EPOCH=$(( $(date +%s) - 7200 ))
echo "wrk: $THREADS threads, $CONNS connections, $DURATION, $NDEV devices"
echo "--- bare JSON-decoding handler (no store) ---"
bare=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_B" | grep RESULT)
echo "$bare"
echo "--- kettle serve, PostgreSQL, 200 after commit ---"
tok=$(cat "$work/data/operator-token")
before=$(curl -s -H "Authorization: Bearer $tok" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p')
kett=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_K" | grep RESULT)
echo "$kett"
after=$(curl -s -H "Authorization: Bearer $tok" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p')
reqs=$(echo "$kett" | sed -n 's/.*requests=\([0-9]*\).*/\1/p')
errs=$(echo "$kett" | sed -n 's/.*errors_status=\([0-9]*\).*/\1/p')
echo "stored rows during wrk (GET /v1/statistics measurement_count delta): $((after - before)); wrk requests: $reqs; non-2xx: $errs"
rb=$(echo "$bare" | sed -n 's/.*rps=\([0-9.]*\).*/\1/p'); rk=$(echo "$kett" | sed -n 's/.*rps=\([0-9.]*\).*/\1/p')
awk -v k="$rk" -v b="$rb" 'BEGIN { printf "RATIO kettle(postgres)/bare = %.3f (%.0f / %.0f req/s); goal >= 0.50\n", k/b, k, b }'
