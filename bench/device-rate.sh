#!/usr/bin/env bash
# A runaway client against the fleet, with and without the server's limits,
# in one run, everything on 127.0.0.1, the embedded store.
#
# The fleet: kettle swarm, DEVICES kettles (v1, one connection each, a
# reading and a poll every INTERVAL), DURATION. The runaway, from 10 s after
# the fleet starts until 10 s before it ends (wrk, RUNAWAY_CONNS
# connections, in a loop):
#   MODE=device (default): one kettle of the case-study protocol posting
#     readings (every request a new device time); kettle serve without a
#     per-kettle rate, then with --device-rate RATE --device-burst BURST;
#   MODE=login: POST /login, registering a new device each time (anyone may
#     call it); kettle serve with --login-rate 0 --max-devices 0, then with
#     its defaults (--login-rate 100 --login-burst 20000 --max-devices
#     1000000), then with --login-rate-per-source RATE besides (bursts of
#     100, its default). Meanwhile new kettles log in from another address
#     (127.0.0.2), one every 0.5 s: how many were registered, refused, and
#     the longest a login took.
# Printed for each run: the fleet's upload and poll p99 over the run and in
# its worst 5 s window, its errors and audit; the runaway's requests/s and
# how many it was refused (non-2xx); MODE=device: its readings stored;
# MODE=login: devices registered; kettle serve's mean CPU and final RSS.
#
#   bench/device-rate.sh
#   MODE=login bench/device-rate.sh
#   DEVICES=2000 DURATION=40s bench/device-rate.sh   # quicker
#
# KETTLE_BIN: a prebuilt kettle. Traffic stays on 127.0.0.1 and every
# phase stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${INTERVAL:=2s}" "${DURATION:=7s}" "${EDGE:=1}" "${RUNAWAY_CONNS:=2}"
DEVICES=${DEVICES:-5000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-60s}
RUNAWAY_CONNS=${RUNAWAY_CONNS:-16} RATE=${RATE:-1} BURST=${BURST:-10} MODE=${MODE:-device}
EDGE=${EDGE:-10} # seconds of the fleet alone before and after the runaway
case $MODE in device | login) ;; *) echo "MODE must be device or login, got $MODE" >&2; exit 2 ;; esac
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port
work=$(mktemp -d /tmp/kettle-rate-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT
rerun="MODE=$MODE DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION RUNAWAY_CONNS=$RUNAWAY_CONNS RATE=$RATE BURST=$BURST EDGE=$EDGE bench/device-rate.sh"
echo "rerun: $rerun"
rec_begin device-rate.sh "$rerun"
machine_line
build_kettle "$work"
secs=${DURATION%s}
wrk_for=$((secs - 2 * EDGE))
((wrk_for >= 5)) || { echo "DURATION must be at least $((2 * EDGE + 5))s"; exit 2; }

# newcomers URL SECONDS OUT: new kettles logging in from another address
# (127.0.0.2) while the runaway loops, one every 0.5 s for SECONDS; each
# line of OUT is the status and the seconds it took.
newcomers() {
	local end=$((SECONDS + $2))
	: >"$3"
	while ((SECONDS < end)); do
		curl -s -o /dev/null -w '%{http_code} %{time_total}\n' --max-time 10 --interface 127.0.0.2 \
			-X POST "$1" -d '{"username":"newcomer"}' >>"$3" || echo "000 10" >>"$3"
		sleep 0.5
	done
}

# run NAME [SERVE ARGS...]
run() {
	local name=$1 dir="$work/$1" port
	shift
	mkdir -p "$dir"
	port=$(free_port)
	"$work/kettle" serve --addr 127.0.0.1:$port --db "sqlite:$dir/kettle.db" --data-dir "$dir" --log-level warn --access-log-sample 0 "$@" 2>"$dir/serve.log" &
	kpid=$!
	for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
	local runaway
	runaway=$(curl -sf -X POST "http://127.0.0.1:$port/login" -d '{"username":"runaway"}' | jq -r .username)
	echo "$runaway" >"$dir/runaway.txt"
	echo "--- $name: kettle serve $* ; $DEVICES kettles every $INTERVAL for $DURATION; runaway ($MODE), $RUNAWAY_CONNS connections, from $EDGE s for ${wrk_for}s"
	"$work/kettle" swarm --target "http://127.0.0.1:$port" --data-dir "$dir" --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --server-pid "$kpid" --postgres-pid -1 --out "$dir/out" --report=false --slo-p99 10s >"$dir/swarm.log" 2>&1 &
	local spid=$!
	sleep "$EDGE"
	local script=bench/measurement.lua url=http://127.0.0.1:$port
	local ppid=
	if [ "$MODE" = login ]; then
		script=bench/login.lua url=$url/login
		newcomers "$url" "$wrk_for" "$dir/newcomers.txt" &
		ppid=$!
	fi
	DEVICES="$dir/runaway.txt" BASE_EPOCH=$(($(date +%s) - 3600)) \
		wrk -t2 -c"$RUNAWAY_CONNS" -d"${wrk_for}s" -s "$script" "$url" >"$dir/wrk.log" 2>&1 || true
	[ -n "$ppid" ] && wait "$ppid"
	wait "$spid" || echo "  (swarm exited $?: see its summary)"
	grep -E '^  (measurement|command|requests|audit:)' "$dir/swarm.log" | sed "s/^ /  [$name]/"
	local stored registered rss
	registered=$(curl -sf "http://127.0.0.1:$port/metrics" | awk '$1 == "kettle_devices_registered" { print $2 }')
	rss=$(awk '/^VmRSS/ { printf "%.0f", $2 / 1024 }' /proc/"$kpid"/status)
	stored=$(curl -sf -H "Authorization: Bearer $(cat "$dir/operator-token")" "http://127.0.0.1:$port/v1/devices/$runaway" | jq .measurements)
	local res=$dir/out/results.json p99 p99c worst worstc req refused cpu what
	p99=$(jq '.totals.endpoints.measurement.p99_ms // 0' "$res") p99c=$(jq '.totals.endpoints.command.p99_ms // 0' "$res")
	read -r worst _ < <(rec windows "$dir/swarm.log" measurement 0 -1)
	read -r worstc _ < <(rec windows "$dir/swarm.log" command 0 -1)
	req=$(sed -n 's/^RESULT .*requests=\([0-9]*\).*/\1/p' "$dir/wrk.log") refused=$(sed -n 's/^RESULT .*errors_status=\([0-9]*\).*/\1/p' "$dir/wrk.log")
	req=$(awk -v r="${req:-0}" -v s="$wrk_for" 'BEGIN { printf "%.0f", r / s }')
	cpu=$(jq '[.system.samples[] | .procs.server.cpu_pct // empty] | if length > 0 then add / length else 0 end | round' "$res")
	if [ "$MODE" = device ]; then
		what="runaway_stored=$stored runaway_stored_per_s=$(awk -v n="$stored" -v s="$wrk_for" 'BEGIN { printf "%.1f", n / s }')"
	else
		what="devices_registered=$registered$(awk '{ n++; if ($1 == 200) ok++; if ($1 == 429) no++; if ($2 > m) m = $2 }
			END { printf " newcomers=%d newcomers_registered=%d newcomers_refused_429=%d newcomers_max_s=%.3f", n, ok, no, m }' "$dir/newcomers.txt")"
	fi
	echo "RATE $name fleet_requests=$(jq .totals.requests "$res") fleet_errors=$(jq .totals.errors "$res") fleet_p99_upload_ms=$p99 fleet_p99_command_ms=$p99c" \
		"worst5s_p99_upload_ms=$worst worst5s_p99_command_ms=$worstc runaway_rps=$req runaway_refused=${refused:-0} $what server_cpu_pct_mean=$cpu server_rss_mib=$rss"
	rec_fig "$name: fleet upload p99" "$p99" ms
	rec_fig "$name: fleet errors" "$(jq .totals.errors "$res")" requests
	rec_fig "$name: runaway" "$req" req/s
	if [ "$MODE" = device ]; then rec_fig "$name: runaway readings stored" "$stored" readings; else rec_fig "$name: devices registered" "$registered" devices; fi
	rec_fig "$name: server CPU" "$cpu" %
	kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
}
if [ "$MODE" = device ]; then
	run no-limit
	run limit --device-rate "$RATE" --device-burst "$BURST"
else
	run no-limit --login-rate 0 --max-devices 0
	run defaults
	run per-source --login-rate-per-source "$RATE"
fi
rec_end
