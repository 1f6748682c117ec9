# Sourced by bench scripts: collect the figures of a run, then append them as
# one record to bench/results.jsonl (bench/record.py has the format).
#
#   . bench/lib/record.sh
#   rec_begin ingest.sh "DEVICES=$NDEV DURATION=$DURATION bench/ingest.sh"
#   rec_fig "kettle serve" "$rk" req/s        # as often as there are figures
#   rec_ceiling "bare handler" "$rb" req/s    # optional
#   rec_ratio "$ratio"                        # optional
#   rec_end
#
# Python embedded in a script appends the same lines ("figure NAME=VALUE:UNIT",
# "ceiling NAME=VALUE:UNIT", "ratio N") to the file named by $KETTLE_REC_FIGS.
# Recording never fails the run.

rec_begin() { # rec_begin SCRIPT COMMAND
	REC_BENCH=$1 REC_COMMAND=$2
	KETTLE_REC_FIGS=$(mktemp /tmp/kettle-rec-XXXXXX)
	export KETTLE_REC_FIGS
}
rec_fig() { echo "figure $1=$2:$3" >>"$KETTLE_REC_FIGS"; }     # rec_fig NAME VALUE UNIT
rec_ceiling() { echo "ceiling $1=$2:$3" >>"$KETTLE_REC_FIGS"; } # rec_ceiling NAME VALUE UNIT
rec_ratio() { echo "ratio $1" >>"$KETTLE_REC_FIGS"; }           # rec_ratio N
rec_end() {
	[ -n "${KETTLE_REC_FIGS:-}" ] || return 0
	python3 "$(git rev-parse --show-toplevel 2>/dev/null || echo .)/bench/record.py" \
		--bench "$REC_BENCH" --command "$REC_COMMAND" --from "$KETTLE_REC_FIGS" || true
	rm -f "$KETTLE_REC_FIGS"
	KETTLE_REC_FIGS=
}

# rec_swarm RESULTS_JSON [LABEL]: the figures of a kettle swarm run (its
# --out DIR/results.json): each endpoint's p99 and errors, the run's
# errors, and the audit's lost and duplicated readings, each name prefixed
# with LABEL.
rec_swarm() {
	python3 - "$1" "${2:-}" <<'PY' || true
import json, os, sys
path, label = sys.argv[1], sys.argv[2]
pre = label + " " if label else ""
try:
    r = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"record: {path}: {e}; swarm figures left out", file=sys.stderr)
    sys.exit(0)
t = r.get("totals", {})
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    for name in sorted(t.get("endpoints", {})):
        e = t["endpoints"][name]
        out.write(f"figure {pre}{name} p99={e['p99_ms']}:ms\n")
        out.write(f"figure {pre}{name} req/s={e['per_second']}:req/s\n")
    out.write(f"figure {pre}errors={t.get('errors', 0)}:requests\n")
    a = r.get("audit")
    if a:
        out.write(f"figure {pre}audit lost={a['lost']}:readings\n")
        out.write(f"figure {pre}audit duplicated={a['duplicated']}:readings\n")
PY
}

# rec_results FILE [LABEL]: a figure for every numeric KEY=VALUE of every
# "RESULT NAME KEY=VALUE…" line in FILE (what bench/pgbench prints), named
# "LABEL NAME KEY", its unit read from the key (…_ms, …_per_s, bytes…).
rec_results() {
	python3 - "$1" "${2:-}" <<'PY' || true
import os, re, sys
path, label = sys.argv[1], sys.argv[2]
pre = label + " " if label else ""
units = [("_us_per_row", "µs/row"), ("_us_per_req", "µs/req"), ("_us_per_request", "µs/req"), ("rows_per_s", "rows/s"),
         ("_per_s", "/s"), ("rps", "req/s"), ("_ms", "ms"), ("seconds", "s"), ("_s", "s"), ("bytes", "bytes"),
         ("_pct", "%"), ("ratio", "ratio"), ("_mib", "MiB")]
def unit(key):
    for suffix, u in units:
        if key.endswith(suffix) or key.startswith(suffix.strip("_")):
            return u
    return "count"
try:
    lines = open(path).read().splitlines()
except OSError as e:
    print(f"record: {path}: {e}; figures left out", file=sys.stderr)
    sys.exit(0)
with open(os.environ["KETTLE_REC_FIGS"], "a") as out:
    for line in lines:
        f = line.split()
        if len(f) < 3 or f[0] != "RESULT":
            continue
        for k, v in re.findall(r"(\w+)=(-?[\d.]+(?:e[-+]?\d+)?)(?=\s|$)", line):
            out.write(f"figure {pre}{f[1]} {k}={v}:{unit(k)}\n")
PY
}
