#!/usr/bin/env bash
# Synchronous vs asynchronous standby, one run: the topology of
# deploy/cluster.sh with one kettle serve node, brought up twice (Patroni
# synchronous_mode true, then false), and against that node the same open-model
# load twice: single readings (v1, one reading a request) and batched uploads
# (v1, --batch 10). Prints, for each, acknowledged readings/s, the upload p50
# and p99, and the CPU seconds of every process (kettle serve, each
# PostgreSQL member with its backends, each Patroni, etcd, the swarm), then
# the sync/async ratios; appends one JSON line to bench/results.jsonl.
#
#   flock -w 900 /tmp/kettle-heavy.lock bench/ha-sync.sh
#
# Environment: DEVICES (2000), INTERVAL (2s), DURATION (30s), BATCH (10),
# KETTLE_HA_NET (127.0.44).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICES=${DEVICES:-2000}
INTERVAL=${INTERVAL:-2s}
DURATION=${DURATION:-30s}
BATCH=${BATCH:-10}
export KETTLE_HA_NET=${KETTLE_HA_NET:-127.0.44}
export KETTLE_HA_NODES=1
export KETTLE_HA_SERVE_ARGS="--access-log-sample 0 --log-level warn"
bench_build bin/kettle ./cmd/kettle
export KETTLE_BIN=$PWD/bin/kettle
out=$(mktemp -d /tmp/kha-bench-XXXX)
chmod 755 "$out" # Patroni runs as postgres and reads its files under it
trap 'deploy/cluster.sh down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

# cpu DIR: CPU seconds so far of each process of the topology, as JSON.
cpu() { python3 bench/lib/topo_cpu.py "$1"; }

run() { # mode kind args…
	local mode=$1 kind=$2; shift 2
	local dir=$KETTLE_HA_DIR
	local before after
	before=$(cpu "$dir")
	bin/kettle swarm --target "http://$KETTLE_HA_NET.21:8080" --api v1 --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --data-dir "$dir/kettle1" --out "$out/$mode-$kind" --report=false --sample=false \
		--slo-p99 0 --max-error-rate -1 "$@" >"$out/$mode-$kind.log" 2>&1
	after=$(cpu "$dir")
	python3 - "$out/$mode-$kind/results.json" "$before" "$after" "$mode" "$kind" "$(deploy/cluster.sh leader)" >>"$out/rows.jsonl" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1])); b = json.loads(sys.argv[2]); a = json.loads(sys.argv[3])
ep = r["totals"]["endpoints"]["measurement"]
cpu = {k: round(a[k] - b.get(k, 0), 2) for k in a if not k.endswith("_rss_bytes")}
print(json.dumps({"mode": sys.argv[4], "kind": sys.argv[5], "primary": sys.argv[6],
    "acked_per_s": r["totals"]["acked"] / r["totals"]["wall_seconds"], "upload_p50_ms": ep["p50_ms"],
    "upload_p99_ms": ep["p99_ms"], "errors": r["totals"]["errors"], "swarm_cpu_s": r["totals"]["cpu_seconds"],
    "lost": (r.get("audit") or {}).get("lost"), "cpu_s": cpu}))
EOF
	tail -1 "$out/rows.jsonl"
}

for mode in true false; do
	export KETTLE_HA_DIR=$out/topo-$mode KETTLE_HA_SYNC=$mode
	deploy/cluster.sh up >/dev/null
	run "$mode" single
	run "$mode" batched --batch "$BATCH"
	deploy/cluster.sh down >/dev/null
done

python3 - "$out/rows.jsonl" "bench/ha-sync.sh (DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION BATCH=$BATCH)" <<'EOF'
import json, subprocess, sys, datetime, os
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {(r["mode"], r["kind"]): r for r in rows}
figs = []
for r in rows:
    m = "sync" if r["mode"] == "true" else "async"
    for k in ("acked_per_s", "upload_p50_ms", "upload_p99_ms"):
        figs.append({"name": f"{m}_{r['kind']}_{k}", "value": round(r[k], 3), "unit": k.split("_")[-1]})
    for p, s in r["cpu_s"].items():
        figs.append({"name": f"{m}_{r['kind']}_cpu_{p}", "value": s, "unit": "s"})
ratios = {}
for kind in ("single", "batched"):
    s, a = by[("true", kind)], by[("false", kind)]
    ratios[kind + "_p99_sync_over_async"] = s["upload_p99_ms"] / max(a["upload_p99_ms"], 1e-9)
    ratios[kind + "_p50_sync_over_async"] = s["upload_p50_ms"] / max(a["upload_p50_ms"], 1e-9)
    ps, pa = s["cpu_s"].get("postgres" + s["primary"][2:], 0), a["cpu_s"].get("postgres" + a["primary"][2:], 0)
    ratios[kind + "_primary_cpu_sync_over_async"] = ps / max(pa, 1e-9)
for k, v in ratios.items():
    figs.append({"name": k, "value": round(v, 3), "unit": "ratio"})
    print(f"{k}: {v:.2f}")
for r in rows:
    print(json.dumps(r))
cpu_model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
line = {"bench": "ha-sync.sh", "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": {"cores": os.cpu_count(), "cpu_model": cpu_model, "loadavg": " ".join(open("/proc/loadavg").read().split()[:3])},
    "command": sys.argv[2], "figures": figs, "ratio": round(ratios["single_p99_sync_over_async"], 3)}
with open("bench/results.jsonl", "a") as f:
    f.write(json.dumps(line) + "\n")
print("appended to bench/results.jsonl")
EOF
