#!/usr/bin/env bash
# Acknowledged single-measurement requests/s on the embedded store, against a
# bare JSON-decoding handler, with the same client (wrk) in the same run.
#
#   bench/ingest.sh                  # defaults below
#   DEVICES=5000 DURATION=30s CONNS=128 bench/ingest.sh
#   KETTLE_BIN=/tmp/kettle.old bench/ingest.sh   # a built binary instead of this tree's
#
# Prints one RESULT line per side and the ratio. Everything runs on
# 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DURATION:=2s}" "${CONNS:=4}"
NDEV=${DEVICES:-2000}
DURATION=${DURATION:-20s}
CONNS=${CONNS:-64}
THREADS=${THREADS:-2}
PORT_K=${PORT_K:-18480}
PORT_B=${PORT_B:-18490}
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk (or make deps)"; exit 1; }
work=$(mktemp -d /tmp/kettle-bench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

if [ -n "${KETTLE_BIN:-}" ]; then cp "$KETTLE_BIN" "$work/kettle"; else bench_build "$work/kettle" ./cmd/kettle; fi
bench_build "$work/bare" ./bench/bare

wait_up() { for _ in $(seq 100); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }

"$work/bare" --addr 127.0.0.1:$PORT_B 2>"$work/bare.log" & pids+=($!)
"$work/kettle" serve --addr 127.0.0.1:$PORT_K --db "sqlite:$work/data/kettle.db" --data-dir "$work/data" \
	--access-log-sample "${ACCESS_LOG_SAMPLE:-0.01}" ${SERVE_ARGS:-} 2>"$work/serve.log" & pids+=($!)
kpid=$!
wait_up "http://127.0.0.1:$PORT_K/healthz"

echo "registering $NDEV devices through POST /login ..."
for _ in $(seq "$NDEV"); do
	curl -s -XPOST "http://127.0.0.1:$PORT_K/login" -d '{"username":"bench"}'; echo
done | sed -n 's/.*"username":"\([^"]*\)".*/\1/p' >"$work/devices.txt"
[ "$(wc -l <"$work/devices.txt")" = "$NDEV" ] || { echo "registration failed"; exit 1; }

export DEVICES="$work/devices.txt" BASE_EPOCH=$(( $(date +%s) - 7200 ))
echo "wrk: $THREADS threads, $CONNS connections, $DURATION, $NDEV devices; machine: $(nproc) cores"
echo "--- bare JSON-decoding handler (no store) ---"
bare=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_B" | grep RESULT)
echo "$bare"
echo "--- kettle serve, SQLite, 200 after commit ---"
cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; } # user + system ticks
k0=$(cpu "$kpid")
kett=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_K" | grep RESULT)
k1=$(cpu "$kpid")
echo "$kett"
tok=$(cat "$work/data/operator-token")
stored=$(curl -s -H "Authorization: Bearer $tok" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p')
reqs=$(echo "$kett" | sed -n 's/.*requests=\([0-9]*\).*/\1/p')
errs=$(echo "$kett" | sed -n 's/.*errors_status=\([0-9]*\).*/\1/p')
cpu_us=$(awk -v a="$k0" -v b="$k1" -v n="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN { if (n > 0) printf "%.1f", (b - a) / hz / n * 1e6 }')
echo "stored rows (GET /v1/statistics measurement_count): $stored; wrk requests: $reqs; non-2xx: $errs; kettle serve CPU $cpu_us µs a request"
rb=$(echo "$bare" | sed -n 's/.*rps=\([0-9.]*\).*/\1/p'); rk=$(echo "$kett" | sed -n 's/.*rps=\([0-9.]*\).*/\1/p')
ratio=$(awk -v k="$rk" -v b="$rb" 'BEGIN { printf "%.3f", k/b }')
echo "ratio kettle/bare = $ratio ($rk / $rb req/s)"
rec_begin ingest.sh "DEVICES=$NDEV DURATION=$DURATION CONNS=$CONNS THREADS=$THREADS ACCESS_LOG_SAMPLE=${ACCESS_LOG_SAMPLE:-0.01}${SERVE_ARGS:+ SERVE_ARGS=\"$SERVE_ARGS\"}${KETTLE_BIN:+ KETTLE_BIN=$KETTLE_BIN} bench/ingest.sh"
rec_fig "kettle serve, acknowledged" "$rk" req/s
rec_fig "stored rows" "$stored" rows
rec_fig "kettle serve CPU a request" "$cpu_us" µs/req
rec_fig "non-2xx" "$errs" responses
rec_ceiling "bare JSON-decoding handler" "$rb" req/s
rec_ratio "$ratio"
rec_end
