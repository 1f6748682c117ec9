#!/usr/bin/env bash
# What --batch-wait buys at the fleet's own rate on the embedded store:
# kettle serve without it (commit at once) and with --batch-wait WAIT,
# alternated PAIRS times, each under the same fleet, everything on
# 127.0.0.1.
#
# The fleet: kettle swarm, DEVICES v1 kettles (one connection each, a
# reading and a poll every INTERVAL), started at HATCH a second, for
# DURATION. The steady window runs from 10 s after the last kettle started
# until 10 s before the end; in it: kettle serve's CPU (/proc, user +
# system) a request and in all, the ingest transactions and the readings
# they held (kettle_ingest_batch_rows), and the fleet's upload latency (the
# median of its 5 s windows' p50, and the worst window's p99). Then the
# swarm's errors and audit (every acknowledged reading stored). At the end,
# each pair's ratio of server CPU a request, WAIT against none, and their
# median.
#
#   bench/batch-wait.sh
#   WAIT=2ms PAIRS=3 bench/batch-wait.sh
#
# KETTLE_BIN: a prebuilt kettle. Every run stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${INTERVAL:=2s}" "${DURATION:=7s}" "${PAIRS:=1}" "${SETTLE:=1}" "${STEADY:=2}"
DEVICES=${DEVICES:-18000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-120s} HATCH=${HATCH:-600}
WAIT=${WAIT:-5ms} PAIRS=${PAIRS:-2}
SETTLE=${SETTLE:-10} STEADY=${STEADY:-20} # seconds left out after the ramp and before the end; the least steady window
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port
work=$(mktemp -d /tmp/kettle-batchwait-XXXXXX) kpid= spid=
cleanup() {
	for p in $spid $kpid; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
rerun="DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION HATCH=$HATCH WAIT=$WAIT PAIRS=$PAIRS SETTLE=$SETTLE bench/batch-wait.sh"
echo "rerun: $rerun"
rec_begin batch-wait.sh "$rerun"
machine_line
build_kettle "$work"
secs=${DURATION%s}
ramp=$(((DEVICES + HATCH - 1) / HATCH))
from=$((ramp + SETTLE)) to=$((secs - SETTLE))
((to - from >= STEADY)) || { echo "DURATION must leave $STEADY s of steady window after the ramp (${ramp}s) + $SETTLE s and before the last $SETTLE s"; exit 2; }

# run NAME [SERVE ARGS...]: one kettle serve under the fleet; prints a RUN line.
run() {
	local name=$1 dir="$work/$1" port url
	shift
	mkdir -p "$dir"
	port=$(free_port)
	url=http://127.0.0.1:$port
	"$work/kettle" serve --addr 127.0.0.1:$port --db "sqlite:$dir/kettle.db" --data-dir "$dir" --log-level warn --access-log-sample 0 "$@" 2>"$dir/serve.log" &
	kpid=$!
	for _ in $(seq 300); do curl -sf "$url/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
	"$work/kettle" swarm --target "$url" --data-dir "$dir" --devices "$DEVICES" --interval "$INTERVAL" --hatch-rate "$HATCH" \
		--duration "$DURATION" --server-pid "$kpid" --postgres-pid -1 --out "$dir/out" --report=false --slo-p99 10s >"$dir/swarm.log" 2>&1 &
	spid=$!
	local began=$SECONDS
	local settle=$((from - (SECONDS - began)))
	sleep $((settle > 0 ? settle : 0))
	local t0 m0 t1 m1
	t0=$(awk '{ print $14 + $15 }' /proc/$kpid/stat)
	m0=$(curl -sf "$url/metrics")
	sleep $((to - from))
	t1=$(awk '{ print $14 + $15 }' /proc/$kpid/stat)
	m1=$(curl -sf "$url/metrics")
	wait "$spid" || echo "  (swarm exited $?: see its summary)"
	spid=
	kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
	# the metrics' growth over the steady window: a name, or a prefix* (every labelled series)
	local reqs txs rows p99 p50 errors audit
	delta() { awk -v m="$1" 'FNR == 1 { f++ } /^#/ { next } ($1 == m || (m ~ /\*$/ && index($1, substr(m, 1, length(m) - 1)) == 1)) { s[f] += $NF }
		END { print s[2] - s[1] }' <(echo "$m0") <(echo "$m1"); }
	reqs=$(delta 'kettle_http_request_duration_seconds_count*')
	txs=$(delta kettle_ingest_batch_rows_count) rows=$(delta kettle_ingest_batch_rows_sum)
	read -r p99 p50 _ < <(rec windows "$dir/swarm.log" measurement $((from + 5)) "$to")
	errors=$(sed -n 's/^  requests [0-9]*, errors \([0-9]*\).*/\1/p' "$dir/swarm.log")
	audit=$(sed -n 's/^  audit: //p' "$dir/swarm.log")
	awk -v name="$name" -v args="$*" -v cpu="$(((t1 - t0)))" -v hz="$(getconf CLK_TCK)" -v span=$((to - from)) -v reqs="$reqs" -v txs="$txs" -v rows="$rows" \
		-v p50="$p50" -v p99="$p99" -v errors="${errors:-?}" -v audit="${audit:-?}" 'BEGIN {
		s = cpu / hz
		printf "RUN %s serve_args=\"%s\" server_cpu_us_per_request=%.1f server_cpu_pct=%.1f requests_per_s=%.0f transactions_per_s=%.1f readings_per_transaction=%.2f upload_p50_ms_median_of_windows=%s upload_p99_ms_worst_window=%s fleet_errors=%s audit=\"%s\"\n",
			name, args, s * 1e6 / (reqs > 0 ? reqs : 1), s * 100 / span, reqs / span, txs / span, rows / (txs > 0 ? txs : 1), p50, p99, errors, audit }'
}

: >"$work/runs"
for i in $(seq "$PAIRS"); do
	run "none-$i" | tee -a "$work/runs"
	run "wait-$i" --batch-wait "$WAIT" | tee -a "$work/runs"
done
# cpu SIDE: server CPU a request of each run of SIDE (none, wait), in pair order
cpu() { sed -n "s/^RUN $1-[0-9]* .*server_cpu_us_per_request=\([0-9.]*\).*/\1/p" "$work/runs"; }
ratios=$(paste <(cpu none) <(cpu wait) | awk '{ printf "%.3f\n", $2 / $1 }')
ratio=$(echo "$ratios" | rec median)
echo "RATIO server CPU a request, --batch-wait $WAIT against none: median $ratio of $PAIRS pairs ($(echo $ratios))"
rec_fig "server CPU a request, none (median)" "$(cpu none | rec median)" µs/req
rec_fig "server CPU a request, wait (median)" "$(cpu wait | rec median)" µs/req
rec_ratio "$ratio"
rec_end
