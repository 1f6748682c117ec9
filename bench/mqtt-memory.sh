#!/usr/bin/env bash
# Issue 47: what one MQTT connection costs a node, kettle serve (embedded
# store) side by side with a bare Mosquitto (Debian's; no auth, no storage,
# persistence off) under the same publisher: bench/mqttpub holding CONNS
# kettles, each sending one QoS 1 reading every INTERVAL (open model, one in
# flight). Per target: RSS per connection ((RSS at the end of the window −
# RSS before the first connect) / connections up), CPU per acknowledged
# message (the target's CPU over the window / PUBACKs), PUBACK p99, and for
# kettle serve its Go stack and heap per connection (/metrics).
#
# Targets run one after another, ROUNDS times interleaved (A B M A B M …), so
# that a neighbour's load on the shared machine falls on all of them alike:
#   A: KETTLE_A (a prebuilt kettle, e.g. main's; default: this tree's) with
#      A_ARGS / A_ENV (default: none)
#   B: KETTLE_B (a prebuilt kettle; default: this tree's) with B_ARGS /
#      B_ENV (default: none)
#   C: with KETTLE_C (a third prebuilt kettle) and C_ARGS / C_ENV, beside
#      A and B (before M), so that three builds share one run
#   M: Mosquitto
#
#   KETTLE_A=/tmp/kettle-main bench/mqtt-memory.sh                 # main, this tree, Mosquitto
#   CONNS=2000 HOLD=35 bench/mqtt-memory.sh                        # a quick look
#   KETTLE_A=/tmp/kettle-main B_ARGS="--gc-percent 400" bench/mqtt-memory.sh
#
# PROFILE=DIR: each kettle target's CPU profile over the hold (go tool
# pprof, from --debug-addr), into DIR/TARGETROUND.pprof with its top in
# .txt; the run is then printed, not recorded.
#
# Records one run in bench/results.jsonl. Bounded: each target runs
# WARMUP+HOLD seconds, every process it starts is killed at exit; traffic
# goes to 127.0.47.x only.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${CONNS:=10}" "${INTERVAL:=1s}" "${HOLD:=3}" "${WARMUP:=2}" "${CONNECT_RATE:=100}"
CONNS=${CONNS:-10000}
INTERVAL=${INTERVAL:-30s}
HOLD=${HOLD:-40}                     # measured seconds (> INTERVAL: every kettle sends in it)
CONNECT_RATE=${CONNECT_RATE:-2000}
WARMUP=${WARMUP:-$((CONNS / CONNECT_RATE + 15))}
ROUNDS=${ROUNDS:-1}
HOST=${HOST:-127.0.47.1}
MOSQUITTO=${MOSQUITTO:-/usr/sbin/mosquitto}
[ -x "$MOSQUITTO" ] || { echo "mosquitto missing: run make deps (Debian package mosquitto)" >&2; exit 1; }
[ "$(ulimit -n)" -gt $((CONNS + 200)) ] || { echo "open-file limit $(ulimit -n) too low for CONNS=$CONNS" >&2; exit 1; }

work=$(mktemp -d /tmp/kettle-mqttmem-XXXXXX)
spid=
cleanup() { [ -n "$spid" ] && kill "$spid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
if [ -n "${KETTLE_B:-}" ]; then cp "$KETTLE_B" "$work/B"; else bench_build "$work/B" ./cmd/kettle; fi
bench_build "$work/mqttpub" ./bench/mqttpub
cp "${KETTLE_A:-$work/B}" "$work/A"
targets="A B ${KETTLE_C:+C }M"
[ -z "${KETTLE_C:-}" ] || cp "$KETTLE_C" "$work/C"
[ -z "${PROFILE:-}" ] || { mkdir -p "$PROFILE"; export KETTLE_NO_RECORD=1; } # profiled: printed, not recorded
cmdline="CONNS=$CONNS INTERVAL=$INTERVAL HOLD=$HOLD ROUNDS=$ROUNDS ${KETTLE_A:+KETTLE_A=$KETTLE_A }${KETTLE_B:+KETTLE_B=$KETTLE_B }${KETTLE_C:+KETTLE_C=$KETTLE_C C_ARGS=\"${C_ARGS:-}\" }A_ARGS=\"${A_ARGS:-}\" A_ENV=\"${A_ENV:-}\" B_ARGS=\"${B_ARGS:-}\" B_ENV=\"${B_ENV:-}\" bench/mqtt-memory.sh"
echo "rerun: $cmdline"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"

rss_kib() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
port=21883
run() { # TARGET ROUND → one JSON object in $work/runs
	local t=$1 r=$2 secret="" hport mport
	port=$((port + 2)); mport=$port; hport=$((port + 1))
	local d="$work/$t$r"
	mkdir -p "$d"
	if [ "$t" = M ]; then
		printf 'listener %s %s\nallow_anonymous true\npersistence false\nmax_connections -1\nlog_dest none\n' "$mport" "$HOST" >"$d/mosquitto.conf"
		"$MOSQUITTO" -c "$d/mosquitto.conf" &
		spid=$!
		sleep 1
	else
		local args env
		case $t in
		A) args=${A_ARGS:-} env=${A_ENV:-} ;;
		C) args=${C_ARGS:-} env=${C_ENV:-} ;;
		*) args=${B_ARGS:-} env=${B_ENV:-} ;;
		esac
		[ -z "${PROFILE:-}" ] || args="$args --debug-addr $HOST:$((port + 1000))"
		# shellcheck disable=SC2086
		env $env "$work/$t" serve --data-dir "$d/data" --db "sqlite:$d/data/k.db" --addr "$HOST:$hport" \
			--mqtt-addr "$HOST:$mport" --mqtt-max-conns $((CONNS + 100)) --access-log-sample 0 --log-level warn $args >"$d/serve.log" 2>&1 &
		spid=$!
		for _ in $(seq 150); do curl -fsS "http://$HOST:$hport/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
		curl -fsS "http://$HOST:$hport/readyz" >/dev/null || { cat "$d/serve.log"; exit 1; }
		secret=$(cat "$d/data/secret")
		sleep 2
	fi
	local rss0
	rss0=$(rss_kib "$spid")
	"$work/mqttpub" -addr "$HOST:$mport" -conns "$CONNS" -interval "$INTERVAL" -connect-rate "$CONNECT_RATE" \
		-warmup "${WARMUP}s" -duration "${HOLD}s" ${secret:+-secret "$secret"} -pid "$spid" -json -label "$t" >"$d/pub.json" &
	local ppid=$!
	: >"$d/metrics"
	if [ -n "${PROFILE:-}" ] && [ "$t" != M ]; then
		(sleep "$WARMUP"; curl -fsS "http://$HOST:$((mport + 1000))/debug/pprof/profile?seconds=$((HOLD - 4))" -o "$PROFILE/$t$r.pprof" &&
			go tool pprof -top -nodecount=60 "$work/$t" "$PROFILE/$t$r.pprof" >"$PROFILE/$t$r.txt" 2>&1) &
	fi
	sleep $((WARMUP + HOLD - 2)) # Go's stack and heap while every kettle is still connected
	if [ "$t" != M ]; then curl -fsS "http://$HOST:$hport/metrics" >"$d/metrics" || true; fi
	wait "$ppid"
	kill "$spid"
	wait "$spid" 2>/dev/null || true
	spid=
	# prom NAME: a sample of the node's /metrics, or null (Mosquitto has none)
	prom() { awk -v m="$1" '$1 == m { v = $2 } END { print (v == "" ? "null" : v) }' "$d/metrics"; }
	jq -c --arg t "$t" --argjson rss0 "$rss0" --argjson stack "$(prom go_memstats_stack_inuse_bytes)" --argjson heap "$(prom go_memstats_heap_inuse_bytes)" '
		([.up, 1] | max) as $up | (.rss_kib | to_entries[0].value) as $rss | (.cpu_s | to_entries[0].value) as $cpu
		| {target: $t, up, rss_per_conn_kib: (($rss - $rss0) / $up), rss_kib: $rss, rss0_kib: $rss0,
		   cpu_ms_per_msg: ($cpu * 1000 / ([.acked, 1] | max)), cpu_pct: ($cpu / .seconds * 100), msgs_per_s, puback_p99_ms, failed}
		+ (if $stack then {stack_per_conn_kib: ($stack / $up / 1024)} else {} end)
		+ (if $heap then {heap_per_conn_kib: ($heap / $up / 1024)} else {} end)' "$d/pub.json" >>"$work/runs"
	tail -1 "$work/runs"
}
for r in $(seq "$ROUNDS"); do
	for t in $targets; do run "$t" "$r"; done
done

# The medians of the rounds, this tree's kettle first (the headline: its
# memory per connection, against Mosquitto's as the ceiling).
rec_begin mqtt-memory.sh "$cmdline"
declare -A name=([A]=kettle_a [B]=kettle [C]=kettle_c [M]=mosquitto)
declare -A unit=([rss_per_conn_kib]=KiB [cpu_ms_per_msg]=ms [puback_p99_ms]=ms [up]=connections [stack_per_conn_kib]=KiB [heap_per_conn_kib]=KiB)
med() { # TARGET KEY: the median over the rounds, or nothing
	local v; v=$(jq -r --arg t "$1" --arg k "$2" 'select(.target == $t) | .[$k] // empty' "$work/runs")
	[ -z "$v" ] || echo "$v" | rec median
}
for t in B A ${KETTLE_C:+C} M; do
	for k in rss_per_conn_kib cpu_ms_per_msg puback_p99_ms up stack_per_conn_kib heap_per_conn_kib; do
		v=$(med "$t" "$k")
		[ -z "$v" ] || rec_fig "${name[$t]}_$k" "$(printf %.3f "$v")" "${unit[$k]}"
	done
done
b=$(med B rss_per_conn_kib) m=$(med M rss_per_conn_kib)
if [ -n "$b" ] && awk -v m="${m:-0}" 'BEGIN { exit !(m > 0) }'; then
	rec_ceiling mosquitto_rss_per_conn_kib "$(printf %.3f "$m")" KiB
	rec_ratio "$(awk -v b="$b" -v m="$m" 'BEGIN { printf "%.2f", b / m }')"
fi
rec_end
