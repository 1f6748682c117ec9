#!/usr/bin/env bash
# One runaway kettle against the fleet, with and without a per-device rate
# (kettle serve --device-rate), in one run, everything on 127.0.0.1, the
# embedded store.
#
# The fleet: kettle swarm, DEVICES kettles (v1, one connection each, a
# reading and a poll every INTERVAL), DURATION. The runaway: one kettle of
# the case-study protocol whose firmware posts readings in a loop (wrk,
# RUNAWAY_CONNS connections, every request a new device time), from 10 s
# after the fleet starts until 10 s before it ends. Printed for each run:
# the fleet's upload and poll p99 over the run and in its worst 5 s window,
# its errors and audit; the runaway's requests/s, how many it was refused
# (429) and how many of its readings were stored; kettle serve's CPU.
#
#   bench/device-rate.sh
#   DEVICES=2000 DURATION=40s bench/device-rate.sh   # quicker
#
# KETTLE_BIN: a prebuilt kettle. Traffic stays on 127.0.0.1 and every
# phase stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICES=${DEVICES:-5000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-60s}
RUNAWAY_CONNS=${RUNAWAY_CONNS:-16} RATE=${RATE:-1} BURST=${BURST:-10}
. bench/pg-cluster.sh # machine_line, build_kettle, free_port
work=$(mktemp -d /tmp/kettle-rate-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT
echo "rerun: DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION RUNAWAY_CONNS=$RUNAWAY_CONNS RATE=$RATE BURST=$BURST bench/device-rate.sh"
machine_line
build_kettle "$work"
secs=${DURATION%s}
wrk_for=$((secs - 20))
((wrk_for >= 5)) || { echo "DURATION must be at least 25s"; exit 2; }

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
	echo "--- $name: kettle serve $* ; $DEVICES kettles every $INTERVAL for $DURATION; one runaway kettle, $RUNAWAY_CONNS connections, from 10 s for ${wrk_for}s"
	"$work/kettle" swarm --target "http://127.0.0.1:$port" --data-dir "$dir" --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --server-pid "$kpid" --postgres-pid -1 --out "$dir/out" --report=false --slo-p99 10s >"$dir/swarm.log" 2>&1 &
	local spid=$!
	sleep 10
	DEVICES="$dir/runaway.txt" BASE_EPOCH=$(($(date +%s) - 3600)) \
		wrk -t2 -c"$RUNAWAY_CONNS" -d"${wrk_for}s" -s bench/measurement.lua "http://127.0.0.1:$port" >"$dir/wrk.log" 2>&1 || true
	wait "$spid" || echo "  (swarm exited $?: see its summary)"
	grep -E '^  (measurement|command|requests|audit:)' "$dir/swarm.log" | sed "s/^ /  [$name]/"
	local stored
	stored=$(curl -sf -H "Authorization: Bearer $(cat "$dir/operator-token")" "http://127.0.0.1:$port/v1/devices/$runaway" | python3 -c 'import json, sys; print(json.load(sys.stdin)["measurements"])')
	python3 - "$dir/out/results.json" "$dir/swarm.log" "$dir/wrk.log" "$name" "$stored" "$wrk_for" <<'EOF'
import json, re, sys
res, log, wrk, name, stored, wrk_for = sys.argv[1:]
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
print("RATE %s fleet_requests=%d fleet_errors=%d fleet_p99_upload_ms=%.2f fleet_p99_command_ms=%.2f worst5s_p99_upload_ms=%.2f worst5s_p99_command_ms=%.2f "
      "runaway_rps=%.0f runaway_refused=%d runaway_stored=%s runaway_stored_per_s=%.1f server_cpu_pct_mean=%.0f" % (
    name, t["requests"], t["errors"], p99("measurement"), p99("command"), worst("measurement"), worst("command"),
    req / float(wrk_for), refused, stored, float(stored) / float(wrk_for), sum(srv) / max(len(srv), 1)))
EOF
	kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
}
run no-limit
run limit --device-rate "$RATE" --device-burst "$BURST"
