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
DEVICES=${DEVICES:-18000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-120s} HATCH=${HATCH:-600}
WAIT=${WAIT:-5ms} PAIRS=${PAIRS:-2}
. bench/pg-cluster.sh # machine_line, build_kettle, free_port
work=$(mktemp -d /tmp/kettle-batchwait-XXXXXX) kpid= spid=
cleanup() {
	for p in $spid $kpid; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
rerun="DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION HATCH=$HATCH WAIT=$WAIT PAIRS=$PAIRS bench/batch-wait.sh"
echo "rerun: $rerun"
rec_begin batch-wait.sh "$rerun"
machine_line
build_kettle "$work"
secs=${DURATION%s}
ramp=$(((DEVICES + HATCH - 1) / HATCH))
from=$((ramp + 10)) to=$((secs - 10))
((to - from >= 20)) || { echo "DURATION must leave 20 s of steady window after the ramp (${ramp}s) + 10 s and before the last 10 s"; exit 2; }

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
	sleep $((from - (SECONDS - began)))
	local t0 m0 t1 m1
	t0=$(awk '{ print $14 + $15 }' /proc/$kpid/stat)
	m0=$(curl -sf "$url/metrics")
	sleep $((to - from))
	t1=$(awk '{ print $14 + $15 }' /proc/$kpid/stat)
	m1=$(curl -sf "$url/metrics")
	wait "$spid" || echo "  (swarm exited $?: see its summary)"
	spid=
	kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
	python3 - "$name" "$*" "$t0" "$t1" "$((to - from))" "$from" "$to" "$dir/swarm.log" <(echo "$m0") <(echo "$m1") <<'EOF'
import re, statistics, sys
name, args, t0, t1, span, lo, hi, log, m0, m1 = sys.argv[1:]
tick = 100.0  # USER_HZ
def metrics(path):
    out = {}
    for line in open(path):
        if line.startswith("#"):
            continue
        parts = line.rsplit(" ", 1)
        if len(parts) == 2:
            out[parts[0]] = out.get(parts[0], 0.0) + float(parts[1])
    return out
a, b = metrics(m0), metrics(m1)
def total(m, prefix):
    return sum(v for k, v in m.items() if k.startswith(prefix))
reqs = total(b, "kettle_http_request_duration_seconds_count") - total(a, "kettle_http_request_duration_seconds_count")
txs = b.get("kettle_ingest_batch_rows_count", 0) - a.get("kettle_ingest_batch_rows_count", 0)
rows = b.get("kettle_ingest_batch_rows_sum", 0) - a.get("kettle_ingest_batch_rows_sum", 0)
cpu_s = (float(t1) - float(t0)) / tick
p50s, p99s = [], []
text = open(log).read()
for m in re.finditer(r"^\[\s*(\d+)s\].*?measurement [\d.]+/s p50 ([\d.]+)ms p99 ([\d.]+)ms", text, re.M):
    t = int(m.group(1))
    if int(lo) + 5 <= t <= int(hi):
        p50s.append(float(m.group(2))); p99s.append(float(m.group(3)))
errors = re.search(r"^  requests \d+, errors (\d+)", text, re.M)
audit = re.search(r"^  audit: (.*)$", text, re.M)
print("RUN %s serve_args=%r server_cpu_us_per_request=%.1f server_cpu_pct=%.1f requests_per_s=%.0f transactions_per_s=%.1f readings_per_transaction=%.2f "
      "upload_p50_ms_median_of_windows=%.2f upload_p99_ms_worst_window=%.2f fleet_errors=%s audit=%r" % (
    name, args, cpu_s * 1e6 / max(reqs, 1), cpu_s * 100 / float(span), reqs / float(span), txs / float(span), rows / max(txs, 1),
    statistics.median(p50s) if p50s else float("nan"), max(p99s) if p99s else float("nan"),
    errors.group(1) if errors else "?", audit.group(1) if audit else "?"))
EOF
}

: >"$work/runs"
for i in $(seq "$PAIRS"); do
	run "none-$i" | tee -a "$work/runs"
	run "wait-$i" --batch-wait "$WAIT" | tee -a "$work/runs"
done
python3 - "$work/runs" "$WAIT" <<'EOF'
import re, statistics, sys
cpu = {}
for line in open(sys.argv[1]):
    m = re.match(r"RUN (\w+)-(\d+) .*server_cpu_us_per_request=([\d.]+)", line)
    if m:
        cpu.setdefault(int(m.group(2)), {})[m.group(1)] = float(m.group(3))
ratios = [p["wait"] / p["none"] for _, p in sorted(cpu.items()) if "wait" in p and "none" in p]
print("RATIO server CPU a request, --batch-wait %s against none: median %.3f of %d pairs (%s)" % (
    sys.argv[2], statistics.median(ratios), len(ratios), " ".join("%.3f" % r for r in ratios)))
import os
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    for side in ("none", "wait"):
        v = [p[side] for p in cpu.values() if side in p]
        if v:
            out.write("figure server CPU a request, %s (median)=%.1f:µs/req\n" % (side, statistics.median(v)))
    if ratios:
        out.write("ratio %.3f\n" % statistics.median(ratios))
EOF
rec_end
