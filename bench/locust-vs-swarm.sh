#!/usr/bin/env bash
# The same fleet driven by `kettle swarm` and by Locust (contrib/locust),
# one after the other against one `kettle serve` on a fresh SQLite data dir:
# requests/s achieved and load-generator CPU per request, side by side.
#
#   bench/locust-vs-swarm.sh                       # 2000 kettles, 2 s interval, 40 s each
#   DEVICES=500 INTERVAL=5 DURATION=30 API=v0 bench/locust-vs-swarm.sh
#
# CPU is the generator process's user+system time from /usr/bin/time (Locust:
# one process, the way most people run it; it uses one core at most;
# its start-up, about 0.7 CPU-s of Python imports, is included). The
# swarm runs on SWARM_PROCS cores (GOMAXPROCS; default 1, as Locust's one
# process; 0: all), with --audit=false and --sample=false, since Locust
# neither audits nor samples the machine, and with its SLO gates off: this
# compares the cost of generating load; the swarm's summary still shows
# latency.
# The server's CPU per request in each run is printed too, as a check that
# both runs asked the same work of it.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${INTERVAL:=1}" "${DURATION:=3}"
NDEV=${DEVICES:-2000}
INTERVAL=${INTERVAL:-2}   # seconds
DURATION=${DURATION:-40}  # seconds, each run
API=${API:-v1}
PROCS=${SWARM_PROCS:-1}
command -v locust >/dev/null || { echo "locust missing: apt-get install -y python3-locust (or make deps)"; exit 1; }
work=$(mktemp -d /tmp/kettle-locust-vs-swarm-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

bench_build "$work/kettle" ./cmd/kettle
port=$(free_port)
url="http://127.0.0.1:$port"
# A clean environment for every process: KETTLE_* are flags' env twins.
for v in $(env | sed -n 's/^\(KETTLE_[A-Z_]*\)=.*/\1/p' | grep -vx 'KETTLE_RESULTS\|KETTLE_REC_FIGS\|KETTLE_RECORD_BIN\|KETTLE_BENCH_BINS'); do unset "$v"; done

"$work/kettle" serve --addr "127.0.0.1:$port" --db "sqlite:$work/data/kettle.db" --data-dir "$work/data" \
	--access-log-sample 0 2>"$work/serve.log" & spid=$!; pids+=($spid)
for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "$url/healthz" >/dev/null || { echo "kettle serve did not start:"; cat "$work/serve.log"; exit 1; }

hz=$(getconf CLK_TCK)
server_cpu() { awk -v hz="$hz" '{ print ($14 + $15) / hz }' "/proc/$spid/stat"; }
stored() { curl -s -H "Authorization: Bearer $(cat "$work/data/operator-token")" "$url/v1/statistics" | jq .measurement_count; }

offered=$(awk -v n="$NDEV" -v i="$INTERVAL" 'BEGIN { printf "%.0f", 2 * n / i }')
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); Locust $(dpkg-query -W -f='${Version}' python3-locust 2>/dev/null) on $(head -1 "$(command -v locust)" | sed 's/^#!//') $($(head -1 "$(command -v locust)" | sed 's/^#!//') --version 2>&1)"
echo "fleet: $NDEV kettles, $API, interval ${INTERVAL}s, ${DURATION}s per run: offered ≈ $offered req/s (a measurement and a command poll per kettle per interval); swarm GOMAXPROCS ${PROCS/#0/all cores}"

# --- kettle swarm ---
s0=$(server_cpu); n0=$(stored)
swarm_env=()
[ "$PROCS" -gt 0 ] && swarm_env=(GOMAXPROCS="$PROCS")
env "${swarm_env[@]}" /usr/bin/time -f "%U %S %M" -o "$work/swarm.time" \
	"$work/kettle" swarm --target "$url" --data-dir "$work/data" --api "$API" --devices "$NDEV" \
	--interval "${INTERVAL}s" --duration "${DURATION}s" --audit=false --sample=false --slo-p99 0 --max-error-rate -1 \
	--out "$work/swarm" >"$work/swarm.log" 2>&1 || { echo "kettle swarm failed:"; tail -20 "$work/swarm.log"; exit 1; }
s1=$(server_cpu); n1=$(stored)
sed -n '/^swarm summary/,$p' "$work/swarm.log" | sed 's/^/  swarm| /'
read -r su ss srss <"$work/swarm.time"
sreq=$(jq .totals.requests "$work/swarm/results.json")
serr=$(jq .totals.errors "$work/swarm/results.json")

sleep 2
# --- Locust: same fleet, same interval, same duration ---
tok_env=(KETTLE_SECRET="$(cat "$work/data/secret")")
s2=$(server_cpu); n2=$(stored)
(cd contrib/locust && env PYTHONDONTWRITEBYTECODE=1 KETTLE_API="$API" KETTLE_INTERVAL="$INTERVAL" "${tok_env[@]}" \
	/usr/bin/time -f "%U %S %M" -o "$work/locust.time" \
	locust -f locustfile.py --headless -u "$NDEV" -r "$NDEV" -t "${DURATION}s" --host "$url" \
	--only-summary --csv "$work/locust" >"$work/locust.log" 2>&1) || true  # exits 1 on any failure: reported below
s3=$(server_cpu); n3=$(stored)
sed -n '/Type *Name *# reqs/,/Aggregated/p' "$work/locust.log" | sed 's/^/  locust| /'
read -r lu ls lrss <"$work/locust.time"
# The console summary is printed after the users stopped (the CSV can be a second stale).
lreq=$(awk '/Aggregated/ { print $2; exit }' "$work/locust.log")
lerr=$(awk '/Aggregated/ { sub(/\(.*/, "", $3); print $3; exit }' "$work/locust.log")
cpuwarn=$(grep -c "CPU usage above 90%" "$work/locust.log" || true)

# Steady rate, after the first interval's ramp: the swarm's own figure
# (after hatching); Locust's from its per-second history, from t=10s on.
ssteady=$(jq '[.totals.endpoints[].per_second] | add' "$work/swarm/results.json")
lsteady=$(awk -F, 'NR > 1 && $4 == "Aggregated" { ts[++n] = $1; c[n] = $18 }
	END { for (i = 1; i <= n; i++) if (ts[i] >= ts[1] + 10 && ts[n] > ts[i]) { print (c[n] - c[i]) / (ts[n] - ts[i]); exit }; print 0 }' "$work/locust_stats_history.csv")

result() { # who requests errors user-s sys-s maxrss-KiB steady-req/s server-cpu-s stored
	awk -v who="$1" -v req="$2" -v err="$3" -v u="$4" -v s="$5" -v rss="$6" -v steady="$7" -v scpu="$8" -v st="$9" \
		-v d="$DURATION" -v off="$offered" 'BEGIN {
		printf "RESULT %-6s %6d req = %4.0f req/s (steady %4.0f) of %d offered, errors %d, stored %d | generator CPU %5.2f s (%2.0f%% of a core) = %5.1f CPU-µs/req, max RSS %3d MiB | server %5.1f CPU-µs/req\n",
			who, req, req / d, steady, off, err, st, u + s, 100 * (u + s) / d, 1e6 * (u + s) / req, rss / 1024, 1e6 * scpu / req }'
}
echo
result swarm "$sreq" "$serr" "$su" "$ss" "$srss" "$ssteady" "$(awk -v a="$s0" -v b="$s1" 'BEGIN { print b - a }')" "$((n1 - n0))"
result locust "$lreq" "$lerr" "$lu" "$ls" "$lrss" "$lsteady" "$(awk -v a="$s2" -v b="$s3" 'BEGIN { print b - a }')" "$((n3 - n2))"
awk -v sr="$sreq" -v su="$su" -v ss="$ss" -v lr="$lreq" -v lu="$lu" -v ls="$ls" 'BEGIN {
	printf "RATIO  locust/swarm CPU per request = %.1f×; requests achieved locust/swarm = %.2f\n", ((lu + ls) / lr) / ((su + ss) / sr), lr / sr }'
if [ "$cpuwarn" -gt 0 ]; then
	echo "NOTE   Locust warned $cpuwarn× \"CPU usage above 90%\": its one process could not keep up, so it offered less than asked (closed model: it waits, it does not queue)."
fi
awk -v lr="$lreq" -v d="$DURATION" -v off="$offered" -v st="$lsteady" 'BEGIN { if (st < 0.95 * off)
	printf "NOTE   Locust fell behind: %.0f req/s steady, %.0f over the run, of %d offered (closed model: the shortfall is load never sent).\n", st, lr / d, off }'
# One record of the run in bench/results.jsonl; its ratio is Locust's CPU
# per request over the swarm's.
rec_begin locust-vs-swarm.sh "DEVICES=$NDEV INTERVAL=$INTERVAL DURATION=$DURATION API=$API SWARM_PROCS=$PROCS bench/locust-vs-swarm.sh"
s_us=$(awk -v r="$sreq" -v u="$su" -v s="$ss" 'BEGIN { printf "%.1f", 1e6 * (u + s) / r }')
l_us=$(awk -v r="$lreq" -v u="$lu" -v s="$ls" 'BEGIN { printf "%.1f", 1e6 * (u + s) / r }')
rec_fig offered "$offered" req/s
rec_fig swarm_steady "$(printf %.1f "$ssteady")" req/s
rec_fig locust_steady "$(printf %.1f "$lsteady")" req/s
rec_fig swarm_cpu_per_request "$s_us" CPU-us
rec_fig locust_cpu_per_request "$l_us" CPU-us
rec_fig swarm_max_rss "$(awk -v k="$srss" 'BEGIN { printf "%.1f", k / 1024 }')" MiB
rec_fig locust_max_rss "$(awk -v k="$lrss" 'BEGIN { printf "%.1f", k / 1024 }')" MiB
rec_fig swarm_gomaxprocs "$( ((PROCS > 0)) && echo "$PROCS" || nproc)" cores
rec_ceiling "swarm_cpu_per_request_target (1/3 of Locust's)" "$(awk -v l="$l_us" 'BEGIN { printf "%.1f", l / 3 }')" CPU-us
rec_ratio "$(awk -v l="$l_us" -v s="$s_us" 'BEGIN { printf "%.2f", l / s }')"
rec_end
