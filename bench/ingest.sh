#!/usr/bin/env bash
# Acknowledged single-measurement requests/s on the embedded store, against a
# bare JSON-decoding handler, with the same client (wrk) in the same run.
#
#   bench/ingest.sh                  # defaults below
#   DEVICES=5000 DURATION=30s CONNS=128 bench/ingest.sh
#   KETTLE_BIN=/tmp/kettle.old bench/ingest.sh   # a built binary instead of this tree's
#   KETTLE_A=/tmp/kettle.old ROUNDS=3 bench/ingest.sh  # two builds, alternating, B/A
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
[ -z "${KETTLE_A:-}" ] || cp "$KETTLE_A" "$work/kettle_a"
bench_build "$work/bare" ./bench/bare

wait_up() { for _ in $(seq 100); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }
cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; } # user + system ticks
field() { echo "$2" | sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; } # field KEY RESULT_LINE

"$work/bare" --addr 127.0.0.1:$PORT_B 2>"$work/bare.log" & pids+=($!)

# side BIN ROUND: kettle serve from BIN on a fresh SQLite file, NDEV devices
# registered, one wrk window; appends "BIN rps cpu_us stored errs" to $work/sides.
side() {
	local bin=$1 d="$work/data-$1-$2" kpid
	"$work/$bin" serve --addr 127.0.0.1:$PORT_K --db "sqlite:$d/kettle.db" --data-dir "$d" \
		--access-log-sample "${ACCESS_LOG_SAMPLE:-0.01}" ${SERVE_ARGS:-} 2>"$work/serve-$bin-$2.log" &
	kpid=$!; pids+=($kpid)
	wait_up "http://127.0.0.1:$PORT_K/healthz"
	echo "registering $NDEV devices through POST /login ..."
	for _ in $(seq "$NDEV"); do
		curl -s -XPOST "http://127.0.0.1:$PORT_K/login" -d '{"username":"bench"}'; echo
	done | sed -n 's/.*"username":"\([^"]*\)".*/\1/p' >"$work/devices.txt"
	[ "$(wc -l <"$work/devices.txt")" = "$NDEV" ] || { echo "registration failed"; exit 1; }
	export DEVICES="$work/devices.txt" BASE_EPOCH=$(( $(date +%s) - 7200 ))
	echo "--- kettle serve ($bin, round $2), SQLite, 200 after commit ---"
	local k0 k1 kett tok stored reqs errs cpu_us
	k0=$(cpu "$kpid")
	kett=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_K" | grep RESULT)
	k1=$(cpu "$kpid")
	echo "$kett"
	tok=$(cat "$d/operator-token")
	stored=$(curl -s -H "Authorization: Bearer $tok" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p')
	reqs=$(field requests "$kett"); errs=$(field errors_status "$kett")
	cpu_us=$(awk -v a="$k0" -v b="$k1" -v n="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN { if (n > 0) printf "%.1f", (b - a) / hz / n * 1e6 }')
	echo "stored rows (GET /v1/statistics measurement_count): $stored; wrk requests: $reqs; non-2xx: $errs; kettle serve CPU $cpu_us µs a request"
	echo "$bin $(field rps "$kett") $cpu_us $stored $errs" >>"$work/sides"
	kill "$kpid"; wait "$kpid" 2>/dev/null || true
}

# KETTLE_A: a second build, run before this one and the bare handler in
# each of ROUNDS rounds (A, B, bare, A, B, bare, …), so that a shared
# machine's noise falls on both; the record then has A's figures and B/A.
ROUNDS=${ROUNDS:-1}
echo "wrk: $THREADS threads, $CONNS connections, $DURATION, $NDEV devices, $ROUNDS round(s)${KETTLE_A:+, A: $KETTLE_A}; machine: $(nproc) cores"
for r in $(seq "$ROUNDS"); do
	[ -z "${KETTLE_A:-}" ] || side kettle_a "$r"
	side kettle "$r"
	echo "--- bare JSON-decoding handler (no store), round $r ---"
	bare=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$PORT_B" | grep RESULT)
	echo "$bare"
	echo "bare $(field rps "$bare") 0 0 0" >>"$work/sides"
done
med() { awk -v b="$1" -v c="$2" '$1 == b { print $c }' "$work/sides" | rec median; } # med BIN COLUMN
rb=$(med bare 2) rk=$(med kettle 2) cpu_us=$(med kettle 3) stored=$(med kettle 4) errs=$(med kettle 5)
ratio=$(awk -v k="$rk" -v b="$rb" 'BEGIN { printf "%.3f", k/b }')
echo "ratio kettle/bare = $ratio ($rk / $rb req/s)"
if [ -n "${KETTLE_A:-}" ]; then
	ra=$(med kettle_a 2) cpu_a=$(med kettle_a 3)
	echo "ratio kettle_a/bare = $(awk -v k="$ra" -v b="$rb" 'BEGIN { printf "%.3f", k/b }') ($ra / $rb req/s)"
	echo "B/A: req/s $(awk -v b="$rk" -v a="$ra" 'BEGIN { printf "%.3f", b/a }'), CPU a request $(awk -v b="$cpu_us" -v a="$cpu_a" 'BEGIN { printf "%.3f", b/a }')"
fi
rec_begin ingest.sh "DEVICES=$NDEV DURATION=$DURATION CONNS=$CONNS THREADS=$THREADS ROUNDS=$ROUNDS ACCESS_LOG_SAMPLE=${ACCESS_LOG_SAMPLE:-0.01}${SERVE_ARGS:+ SERVE_ARGS=\"$SERVE_ARGS\"}${KETTLE_BIN:+ KETTLE_BIN=$KETTLE_BIN}${KETTLE_A:+ KETTLE_A=$KETTLE_A} bench/ingest.sh"
rec_fig "kettle serve, acknowledged" "$rk" req/s
rec_fig "stored rows" "$stored" rows
rec_fig "kettle serve CPU a request" "$cpu_us" µs/req
rec_fig "non-2xx" "$errs" responses
if [ -n "${KETTLE_A:-}" ]; then
	rec_fig "kettle serve A, acknowledged" "$ra" req/s
	rec_fig "kettle serve A CPU a request" "$cpu_a" µs/req
	rec_fig "B/A req/s" "$(awk -v b="$rk" -v a="$ra" 'BEGIN { printf "%.3f", b/a }')" ratio
	rec_fig "B/A CPU a request" "$(awk -v b="$cpu_us" -v a="$cpu_a" 'BEGIN { printf "%.3f", b/a }')" ratio
fi
rec_ceiling "bare JSON-decoding handler" "$rb" req/s
rec_ratio "$ratio"
rec_end
