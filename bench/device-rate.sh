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
DEVICES=${DEVICES:-5000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-60s}
RUNAWAY_CONNS=${RUNAWAY_CONNS:-16} RATE=${RATE:-1} BURST=${BURST:-10} MODE=${MODE:-device}
case $MODE in device | login) ;; *) echo "MODE must be device or login, got $MODE" >&2; exit 2 ;; esac
. bench/pg-cluster.sh # machine_line, build_kettle, free_port
work=$(mktemp -d /tmp/kettle-rate-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT
rerun="MODE=$MODE DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION RUNAWAY_CONNS=$RUNAWAY_CONNS RATE=$RATE BURST=$BURST bench/device-rate.sh"
echo "rerun: $rerun"
rec_begin device-rate.sh "$rerun"
machine_line
build_kettle "$work"
secs=${DURATION%s}
wrk_for=$((secs - 20))
((wrk_for >= 5)) || { echo "DURATION must be at least 25s"; exit 2; }

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
	runaway=$(curl -sf -X POST "http://127.0.0.1:$port/login" -d '{"username":"runaway"}' | python3 -c 'import json, sys; print(json.load(sys.stdin)["username"])')
	echo "$runaway" >"$dir/runaway.txt"
	echo "--- $name: kettle serve $* ; $DEVICES kettles every $INTERVAL for $DURATION; runaway ($MODE), $RUNAWAY_CONNS connections, from 10 s for ${wrk_for}s"
	"$work/kettle" swarm --target "http://127.0.0.1:$port" --data-dir "$dir" --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --server-pid "$kpid" --postgres-pid -1 --out "$dir/out" --report=false --slo-p99 10s >"$dir/swarm.log" 2>&1 &
	local spid=$!
	sleep 10
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
	stored=$(curl -sf -H "Authorization: Bearer $(cat "$dir/operator-token")" "http://127.0.0.1:$port/v1/devices/$runaway" | python3 -c 'import json, sys; print(json.load(sys.stdin)["measurements"])')
	python3 - "$dir/out/results.json" "$dir/swarm.log" "$dir/wrk.log" "$name" "$stored" "$wrk_for" "$MODE" "$registered" "$rss" "$dir/newcomers.txt" <<'EOF'
import json, os, re, sys
res, log, wrk, name, stored, wrk_for, mode, registered, rss, newcomers = sys.argv[1:]
r = json.load(open(res))
t = r["totals"]
win = []
for line in open(log):
    m = re.match(r"\[\s*(\d+)s\]", line)
    if m:
        win.append({e: float(v) for e, v in re.findall(r"(\w+) [\d.]+/s p50 [\d.]+ms p99 ([\d.]+)ms", line)})
worst = lambda ep: max((w.get(ep, 0) for w in win), default=0)
summ = dict(re.findall(r"^  (\w+)\s+\d+ req .* p99\s+([\d.]+) ms", open(log).read(), re.M))
p99 = lambda ep: float(summ.get(ep, "nan"))
w = dict(re.findall(r"(\w+)=([\d.]+)", next((l for l in open(wrk) if l.startswith("RESULT")), "")))
req = float(w.get("requests", 0)); refused = float(w.get("errors_status", 0))
srv = [s["procs"]["server"]["cpu_pct"] for s in r["system"]["samples"] if "server" in s.get("procs", {})]
what = ("runaway_stored=%s runaway_stored_per_s=%.1f" % (stored, float(stored) / float(wrk_for)) if mode == "device"
        else "devices_registered=%s" % registered)
if mode == "login" and os.path.exists(newcomers):
    nc = [l.split() for l in open(newcomers) if l.strip()]
    ok = [float(s) for c, s in nc if c == "200"]
    what += " newcomers=%d newcomers_registered=%d newcomers_refused_429=%d newcomers_max_s=%.3f" % (
        len(nc), len(ok), sum(1 for c, _ in nc if c == "429"), max((float(s) for _, s in nc), default=0))
print("RATE %s fleet_requests=%d fleet_errors=%d fleet_p99_upload_ms=%.2f fleet_p99_command_ms=%.2f worst5s_p99_upload_ms=%.2f worst5s_p99_command_ms=%.2f "
      "runaway_rps=%.0f runaway_refused=%d %s server_cpu_pct_mean=%.0f server_rss_mib=%s" % (
    name, t["requests"], t["errors"], p99("measurement"), p99("command"), worst("measurement"), worst("command"),
    req / float(wrk_for), refused, what, sum(srv) / max(len(srv), 1), rss))
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    out.write("figure %s: fleet upload p99=%.2f:ms\n" % (name, p99("measurement")))
    out.write("figure %s: fleet errors=%d:requests\n" % (name, t["errors"]))
    out.write("figure %s: runaway=%.0f:req/s\n" % (name, req / float(wrk_for)))
    if mode == "device":
        out.write("figure %s: runaway readings stored=%s:readings\n" % (name, stored))
    else:
        out.write("figure %s: devices registered=%s:devices\n" % (name, registered))
    out.write("figure %s: server CPU=%.0f:%%\n" % (name, sum(srv) / max(len(srv), 1)))
EOF
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
