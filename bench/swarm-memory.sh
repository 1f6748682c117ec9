#!/usr/bin/env bash
# What a simulated HTTP kettle costs the simulator in memory: one `kettle
# swarm` of SMALL kettles and one of DEVICES kettles, both on a shared pool of
# CONNS connections against one `kettle serve` (SQLite, fresh data dir), each
# running until every kettle has reported at least once. Prints the swarm's
# peak RSS, RSS per kettle (peak / kettles) and the marginal cost
# ((peak − small run's peak) / (kettles − small kettles)).
#
#   bench/swarm-memory.sh                          # 200,000 kettles at 30 s
#   DEVICES=50000 DURATION=70 bench/swarm-memory.sh
#
# DURATION must exceed the interval plus the hatching: a kettle that never
# ticked holds less state than one that did, so the run counts the kettles
# the audit found readings of and prints them beside the total.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=200}" "${SMALL:=20}" "${CONNS:=10}" "${INTERVAL:=1}" "${DURATION:=3}"
NDEV=${DEVICES:-200000}
SMALL=${SMALL:-2000}
CONNS=${CONNS:-1000}
INTERVAL=${INTERVAL:-30}  # seconds
DURATION=${DURATION:-100} # seconds, each run
API=${API:-v1}
. bench/lib/record.sh
work=$(mktemp -d /tmp/kettle-swarm-memory-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

bench_build "$work/kettle" ./cmd/kettle
port=$(free_port)
url="http://127.0.0.1:$port"
# A clean environment for the processes (KETTLE_* are flags' env twins); the
# results log's own settings stay.
for v in $(env | sed -n 's/^\(KETTLE_[A-Z_]*\)=.*/\1/p' | grep -vx 'KETTLE_RESULTS\|KETTLE_REC_FIGS\|KETTLE_RECORD_BIN\|KETTLE_BENCH_BINS'); do unset "$v"; done

"$work/kettle" serve --addr "127.0.0.1:$port" --db "sqlite:$work/data/kettle.db" --data-dir "$work/data" \
	--access-log-sample 0 --log-level warn 2>"$work/serve.log" & spid=$!; pids+=($spid)
for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "$url/healthz" >/dev/null || { echo "kettle serve did not start:"; cat "$work/serve.log"; exit 1; }
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"

# run N OUT: one swarm of N kettles (new random device ids, so the audit of
# each run sees only its own kettles); prints "peak_rss_bytes kettles_audited errors requests".
run() {
	local n=$1 out=$2
	"$work/kettle" swarm --target "$url" --data-dir "$work/data" --api "$API" --devices "$n" \
		--conns "$CONNS" --interval "${INTERVAL}s" --duration "${DURATION}s" --sample=false \
		--slo-p99 0 --max-error-rate -1 --report=false \
		--out "$work/$out" >"$work/$out.log" 2>&1 || { echo "kettle swarm ($n) failed:"; tail -20 "$work/$out.log"; exit 1; }
	jq -r '[.totals.max_rss_bytes, (.audit.devices // 0), .totals.errors, .totals.requests] | @tsv' "$work/$out/results.json"
}

read -r small_rss small_dev small_err small_req < <(run "$SMALL" small)
echo "small: $SMALL kettles, peak RSS $small_rss B, kettles with readings $small_dev, requests $small_req, errors $small_err"
read -r big_rss big_dev big_err big_req < <(run "$NDEV" big)
echo "large: $NDEV kettles, peak RSS $big_rss B, kettles with readings $big_dev, requests $big_req, errors $big_err"

per=$(awk -v r="$big_rss" -v n="$NDEV" 'BEGIN { printf "%.1f", r / n }')
marg=$(awk -v a="$small_rss" -v b="$big_rss" -v s="$SMALL" -v n="$NDEV" 'BEGIN { printf "%.1f", (b - a) / (n - s) }')
echo "RSS per simulated kettle: $per B (peak / kettles); marginal $marg B ((peak − the $SMALL-kettle run's) / extra kettles); goal ≤ 1024 B"

rec_begin swarm-memory.sh "DEVICES=$NDEV SMALL=$SMALL CONNS=$CONNS INTERVAL=$INTERVAL DURATION=$DURATION API=$API bench/swarm-memory.sh"
rec_fig "kettles" "$NDEV" kettles
rec_fig "kettles with readings stored" "$big_dev" kettles
rec_fig "swarm peak RSS" "$big_rss" bytes
rec_fig "RSS per simulated kettle" "$per" B/kettle
rec_fig "marginal RSS per simulated kettle" "$marg" B/kettle
rec_fig "errors" "$big_err" requests
rec_ceiling "goal" 1024 B/kettle
rec_end
