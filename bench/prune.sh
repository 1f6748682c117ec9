#!/usr/bin/env bash
# Stale registrations pruned while a fleet runs, everything on 127.0.0.1.
#
# kettle serve (STORE=sqlite, default, or STORE=postgres on a throwaway
# cluster) with --login-rate 0 --max-devices 0; a fleet (kettle swarm,
# DEVICES v1 kettles, a reading and a poll every INTERVAL) for the whole
# run; from 10 s in, a flood of POST /login for FLOOD (wrk, 16
# connections): every request registers a device that never reports. Once
# the last of them is older than AGE (at least 10m, the server's floor), a
# dry run, then POST /v1/devices/prune {"older_than": AGE}; the fleet runs
# on for 60 s after it and stops by itself.
#
# Printed: devices registered before and after, the dry run's and the
# prune's answers (removed, took_ms), kettle serve's live heap (after a
# forced collection) and RSS before the flood, after it and 10 s after the
# prune, and the fleet's upload and poll p99 over the run
# and in its worst 5 s window during the prune and outside it; its errors
# and audit (every acknowledged reading stored, none lost).
#
#   bench/prune.sh
#   STORE=postgres bench/prune.sh
#   FLOOD=10s DEVICES=1000 bench/prune.sh   # quicker (the 10 minutes stay)
#
# KETTLE_BIN: a prebuilt kettle. Traffic stays on 127.0.0.1; every phase
# stops by itself (the run takes AGE + FLOOD + ~100 s).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICES=${DEVICES:-2000} INTERVAL=${INTERVAL:-30s} FLOOD=${FLOOD:-30s} AGE=${AGE:-10m} STORE=${STORE:-sqlite}
case $STORE in sqlite | postgres) ;; *) echo "STORE must be sqlite or postgres, got $STORE" >&2; exit 2 ;; esac
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port, pg_start, pg_db
work=$(mktemp -d /tmp/kettle-prune-XXXXXX) kpid= spid=
cleanup() {
	for p in $spid $kpid; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	[ "$STORE" = postgres ] && pg_stop
	rm -rf "$work"
}
trap cleanup EXIT
rerun="STORE=$STORE DEVICES=$DEVICES INTERVAL=$INTERVAL FLOOD=$FLOOD AGE=$AGE bench/prune.sh"
echo "rerun: $rerun"
rec_begin prune.sh "$rerun"
machine_line
build_kettle "$work"
age_s=$(python3 -c "import re,sys; v=sys.argv[1]; u={'s':1,'m':60,'h':3600,'d':86400}; print(int(float(v[:-1])*u[v[-1]]))" "$AGE")
flood_s=${FLOOD%s}
db="sqlite:$work/kettle.db"
if [ "$STORE" = postgres ]; then
	pg_start
	pg_settings
	db=$(pg_db prune)
fi
port=$(free_port) dport=$(free_port)
url=http://127.0.0.1:$port
"$work/kettle" serve --addr 127.0.0.1:$port --db "$db" --data-dir "$work" --log-level info --access-log-sample 0 \
	--login-rate 0 --max-devices 0 --debug-addr 127.0.0.1:$dport 2>"$work/serve.log" &
kpid=$!
for _ in $(seq 300); do curl -sf "$url/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
op="Authorization: Bearer $(cat "$work/operator-token")"
metric() { curl -sf "$url/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }
# mem: kettle serve's live heap (bytes allocated right after a collection
# that /debug/pprof/heap?gc=1 forces) and RSS, MiB
mem() {
	curl -sf "http://127.0.0.1:$dport/debug/pprof/heap?gc=1" >/dev/null
	echo "live heap $(metric go_memstats_alloc_bytes | python3 -c 'import sys; print(round(float(sys.stdin.read()) / 1048576))') MiB, RSS $(awk '/^VmRSS/ { printf "%.0f", $2 / 1024 }' /proc/"$kpid"/status) MiB"
}
duration=$((10 + flood_s + age_s + 5 + 60 + 15))
"$work/kettle" swarm --target "$url" --data-dir "$work" --devices "$DEVICES" --interval "$INTERVAL" \
	--duration "${duration}s" --server-pid "$kpid" --postgres-pid -1 --out "$work/out" --report=false --slo-p99 10s >"$work/swarm.log" 2>&1 &
spid=$!
t0=$(date +%s)
sleep 10
echo "before the flood: registered $(metric kettle_devices_registered); $(mem)"
wrk -t2 -c16 -d"$FLOOD" -s bench/login.lua "$url/login" | grep RESULT | sed 's/^/flood: /'
flooded=$(date +%s)
echo "after the flood: registered $(metric kettle_devices_registered); $(mem)"
sleep $((age_s + 5 - ($(date +%s) - flooded)))
echo "dry run: $(curl -sf -X POST -H "$op" "$url/v1/devices/prune" -d "{\"older_than\":\"$AGE\",\"dry_run\":true}")"
p0=$(($(date +%s) - t0))
pr=$(curl -sf -X POST -H "$op" "$url/v1/devices/prune" -d "{\"older_than\":\"$AGE\"}")
echo "prune:   $pr"
python3 - "$pr" <<'EOF' || true
import json, os, sys
r = json.loads(sys.argv[1])
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    out.write("figure devices removed=%d:devices\n" % r["removed"])
    out.write("figure prune took=%s:ms\n" % r["took_ms"])
    out.write("figure devices left=%d:devices\n" % r["devices_registered"])
EOF
p1=$(($(date +%s) - t0 + 1))
sleep 10
echo "10 s after: registered $(metric kettle_devices_registered), pruned_total $(metric kettle_devices_pruned_total); $(mem)"
wait "$spid" || echo "(swarm exited $?: see its summary)"
spid=
grep -E '^  (measurement|command|requests|audit:)' "$work/swarm.log"
python3 - "$work/swarm.log" "$p0" "$p1" <<'EOF'
import re, sys
log, p0, p1 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
during, other = [], []
for line in open(log):
    m = re.match(r"\[\s*(\d+)s\]", line)
    if m:
        s = int(m.group(1))
        w = {e: float(v) for e, v in re.findall(r"(\w+) [\d.]+/s p50 [\d.]+ms p99 ([\d.]+)ms", line)}
        (during if p0 <= s <= p1 + 5 else other).append(w)
worst = lambda ws, ep: max((w.get(ep, 0) for w in ws), default=0)
print("PRUNE fleet worst 5 s p99 upload / poll: during the prune %.2f / %.2f ms (%d windows), otherwise %.2f / %.2f ms" % (
    worst(during, "measurement"), worst(during, "command"), len(during), worst(other, "measurement"), worst(other, "command")))
import os
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    out.write("figure fleet upload worst 5 s p99 during the prune=%.2f:ms\n" % worst(during, "measurement"))
    out.write("figure fleet upload worst 5 s p99 otherwise=%.2f:ms\n" % worst(other, "measurement"))
EOF
grep -E 'devices pruned' "$work/serve.log" | tail -1 || true
rec_swarm "$work/out/results.json" fleet
rec_end
