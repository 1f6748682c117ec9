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
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so);
# the prune runs at once, so it finds nothing AGE old to remove.
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${INTERVAL:=2s}" "${FLOOD:=2s}" "${EDGE:=1}" "${AGE_WAIT:=0}" "${TAIL:=3}"
DEVICES=${DEVICES:-2000} INTERVAL=${INTERVAL:-30s} FLOOD=${FLOOD:-30s} AGE=${AGE:-10m} STORE=${STORE:-sqlite}
EDGE=${EDGE:-10} TAIL=${TAIL:-75} # seconds of the fleet alone before the flood and after the prune
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
age_s=$(awk -v v="$AGE" 'BEGIN { u["s"] = 1; u["m"] = 60; u["h"] = 3600; u["d"] = 86400; printf "%d", substr(v, 1, length(v) - 1) * u[substr(v, length(v))] }')
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
	echo "live heap $(metric go_memstats_alloc_bytes | awk '{ printf "%.0f", $1 / 1048576 }') MiB, RSS $(awk '/^VmRSS/ { printf "%.0f", $2 / 1024 }' /proc/"$kpid"/status) MiB"
}
age_wait=${AGE_WAIT:-$((age_s + 5))} # the flood's age when it is pruned
duration=$((EDGE + flood_s + age_wait + TAIL))
"$work/kettle" swarm --target "$url" --data-dir "$work" --devices "$DEVICES" --interval "$INTERVAL" \
	--duration "${duration}s" --server-pid "$kpid" --postgres-pid -1 --out "$work/out" --report=false --slo-p99 10s >"$work/swarm.log" 2>&1 &
spid=$!
t0=$(date +%s)
sleep "$EDGE"
echo "before the flood: registered $(metric kettle_devices_registered); $(mem)"
wrk -t2 -c16 -d"$FLOOD" -s bench/login.lua "$url/login" | grep RESULT | sed 's/^/flood: /'
flooded=$(date +%s)
echo "after the flood: registered $(metric kettle_devices_registered); $(mem)"
aged=$((age_wait - ($(date +%s) - flooded)))
sleep $((aged > 0 ? aged : 0))
echo "dry run: $(curl -sf -X POST -H "$op" "$url/v1/devices/prune" -d "{\"older_than\":\"$AGE\",\"dry_run\":true}")"
p0=$(($(date +%s) - t0))
pr=$(curl -sf -X POST -H "$op" "$url/v1/devices/prune" -d "{\"older_than\":\"$AGE\"}")
echo "prune:   $pr"
rec_fig "devices removed" "$(jq .removed <<<"$pr")" devices
rec_fig "prune took" "$(jq .took_ms <<<"$pr")" ms
rec_fig "devices left" "$(jq .devices_registered <<<"$pr")" devices
p1=$(($(date +%s) - t0 + 1))
sleep "$EDGE"
echo "$EDGE s after: registered $(metric kettle_devices_registered), pruned_total $(metric kettle_devices_pruned_total); $(mem)"
wait "$spid" || echo "(swarm exited $?: see its summary)"
spid=
grep -E '^  (measurement|command|requests|audit:)' "$work/swarm.log"
# The fleet's worst 5 s window p99 during the prune (its windows from p0 to
# p1 + 5 s) and otherwise (the worst of the windows before and after).
read -r during _ nd < <(rec windows "$work/swarm.log" measurement "$p0" $((p1 + 5)))
read -r duringc _ < <(rec windows "$work/swarm.log" command "$p0" $((p1 + 5)))
read -r before _ < <(rec windows "$work/swarm.log" measurement 0 $((p0 - 1)))
read -r after _ < <(rec windows "$work/swarm.log" measurement $((p1 + 6)) -1)
read -r beforec _ < <(rec windows "$work/swarm.log" command 0 $((p0 - 1)))
read -r afterc _ < <(rec windows "$work/swarm.log" command $((p1 + 6)) -1)
other=$(awk -v a="$before" -v b="$after" 'BEGIN { print (a > b ? a : b) }') otherc=$(awk -v a="$beforec" -v b="$afterc" 'BEGIN { print (a > b ? a : b) }')
echo "PRUNE fleet worst 5 s p99 upload / poll: during the prune $during / $duringc ms ($nd windows), otherwise $other / $otherc ms"
rec_fig "fleet upload worst 5 s p99 during the prune" "$during" ms
rec_fig "fleet upload worst 5 s p99 otherwise" "$other" ms
grep -E 'devices pruned' "$work/serve.log" | tail -1 || true
rec_swarm "$work/out/results.json" fleet
rec_end
