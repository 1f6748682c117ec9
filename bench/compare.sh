#!/usr/bin/env bash
# kettle report --baseline on real runs: ROUNDS rounds, each one swarm of
# DEVICES kettles for DURATION seconds against a fresh `kettle serve` built
# from BASE_BIN (the baseline, A) and one against CAND_BIN (the candidate,
# B), in turn, the first of each pair alternating (A B, B A, A B, …: the
# second run of a pair fared better in the recorded rounds, so the order
# falls on both sides too); then each round's B is compared with its A, and
# the first k rounds pooled (k = 2 … ROUNDS: kettle report --baseline
# A1,…,Ak Bk --pool B1,…), whose intervals are the spread between runs.
# Prints each comparison's line, how many rounds came out regressed /
# improved / within noise alone, and how many figures each pool flagged;
# records them.
#
#   bench/compare.sh                                  # the tree against itself
#   CAND_BIN=/tmp/kettle-slow bench/compare.sh        # a candidate build
#   ROUNDS=5 DURATION=120 bench/compare.sh
#   KEEP=DIR bench/compare.sh                         # keep each round's runs in DIR
#   JUDGE=DIR bench/compare.sh                        # compare runs kept in DIR again
#                                                     # (e.g. under new thresholds), no new runs
#
# A deliberately slow candidate (never committed): add
# `time.Sleep(5 * time.Millisecond)` at the top of httpapi's v1Measurements,
# `go build -o /tmp/kettle-slow ./cmd/kettle`, then `git checkout httpapi`.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${DURATION:=3}" "${INTERVAL:=1}" "${ROUNDS:=1}"
NDEV=${DEVICES:-2000}
DURATION=${DURATION:-60} # seconds, each run
INTERVAL=${INTERVAL:-30} # seconds
ROUNDS=${ROUNDS:-3}
LABEL=${LABEL:-}
. bench/lib/record.sh
work=$(mktemp -d /tmp/kettle-compare-XXXXXX)
spid=
cleanup() { [ -n "$spid" ] && kill "$spid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

bench_build "$work/kettle" ./cmd/kettle
BASE_BIN=${BASE_BIN:-$work/kettle}
CAND_BIN=${CAND_BIN:-$work/kettle}
for v in $(env | sed -n 's/^\(KETTLE_[A-Z_]*\)=.*/\1/p' | grep -vx 'KETTLE_RESULTS\|KETTLE_REC_FIGS\|KETTLE_RECORD_BIN\|KETTLE_BENCH_BINS' || true); do unset "$v"; done
if [ -n "${JUDGE:-}" ]; then
	ROUNDS=$(find "$JUDGE" -maxdepth 1 -name 'a*' | wc -l)
	DURATION=$(jq -r .params.duration_s "$JUDGE/a1/results.json")
	NDEV=$(jq -r .params.devices "$JUDGE/a1/results.json")
	INTERVAL=$(jq -r .params.interval_s "$JUDGE/a1/results.json")
fi
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "A: $BASE_BIN  B: $CAND_BIN  ($NDEV kettles, ${DURATION}s, interval ${INTERVAL}s, $ROUNDS rounds)"

# run BIN OUT: a fresh kettle serve from BIN, one swarm (this tree's) into OUT.
run() {
	local bin=$1 out=$2 port url
	port=$(free_port)
	url="http://127.0.0.1:$port"
	rm -rf "$work/data"
	"$bin" serve --addr "127.0.0.1:$port" --db "sqlite:$work/data/kettle.db" --data-dir "$work/data" \
		--access-log-sample 0 --log-level warn 2>"$work/serve.log" & spid=$!
	for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
	curl -sf "$url/healthz" >/dev/null || { echo "kettle serve did not start:"; cat "$work/serve.log"; exit 1; }
	"$work/kettle" swarm --target "$url" --data-dir "$work/data" --devices "$NDEV" --interval "${INTERVAL}s" \
		--duration "${DURATION}s" --slo-p99 0 --max-error-rate -1 --out "$out" >"$out.log" 2>&1 ||
		{ echo "kettle swarm failed:"; tail -20 "$out.log"; exit 1; }
	kill "$spid"; wait "$spid" 2>/dev/null || true; spid=
}

regressed=0 improved=0 noise=0 ratios=()
for r in $(seq "$ROUNDS"); do
	if [ -n "${JUDGE:-}" ]; then
		mkdir -p "$work/a$r" "$work/b$r"
		cp "$JUDGE/a$r/results.json" "$work/a$r/" && cp "$JUDGE/b$r/results.json" "$work/b$r/"
	elif [ $((r % 2)) = 1 ]; then
		run "$BASE_BIN" "$work/a$r"
		run "$CAND_BIN" "$work/b$r"
	else
		run "$CAND_BIN" "$work/b$r"
		run "$BASE_BIN" "$work/a$r"
	fi
	rc=0
	"$work/kettle" report --baseline "$work/a$r/results.json" "$work/b$r/results.json" -o "$work/b$r/report.html" \
		>"$work/cmp$r.log" 2>&1 || rc=$?
	line=$(sed -n 's/^  comparison: \([a-z]\)/\1/p' "$work/cmp$r.log" | head -1)
	echo "round $r (exit $rc): $line"
	grep -E '^  [✗!✓] ' "$work/cmp$r.log" || true
	ratios+=("$(jq -r '[.figures[] | select(.name == "measurement.p50" or .name == "measurement.p99") | .estimate] | @tsv' "$work/b$r/compare.json")")
	case "$line" in
	regressed*) regressed=$((regressed + 1)) ;;
	improved*) improved=$((improved + 1)) ;;
	*) noise=$((noise + 1)) ;;
	esac
	[ -n "${KEEP:-}" ] && mkdir -p "$KEEP" && cp -r "$work/a$r" "$KEEP/a$r" && cp -r "$work/b$r" "$KEEP/b$r"
done
echo "rounds: $ROUNDS; regressed $regressed, improved $improved, within noise or passed $noise"

# The first k rounds pooled: how many rounds a verdict takes.
pools=()
for k in $(seq 2 "$ROUNDS"); do
	as=$(seq -f "$work/a%g" 1 "$k" | paste -sd,)
	more=$(seq -f "$work/b%g" 1 $((k - 1)) | paste -sd,)
	rc=0
	"$work/kettle" report --baseline "$as" "$work/b$k/results.json" --pool "$more" -o "$work/pool$k/report.html" \
		>"$work/pool$k.log" 2>&1 || rc=$?
	line=$(sed -n 's/^  comparison: \([a-z]\)/\1/p' "$work/pool$k.log" | head -1)
	echo "rounds 1-$k pooled (exit $rc): $line"
	grep -E '^  [✗!✓] ' "$work/pool$k.log" || true
	pools+=("$k $(jq -r '[([.figures[] | select(.status == "regressed")] | length), ([.figures[] | select(.status == "improved")] | length),
		(.figures[] | select(.name == "measurement.p50" or .name == "measurement.p99") | .estimate)] | @tsv' "$work/pool$k/compare.json")")
done

cand=
[ "$CAND_BIN" != "$work/kettle" ] && cand="CAND_BIN=$CAND_BIN "
[ -z "${JUDGE:-}" ] || cand="JUDGE=$JUDGE "
rec_begin compare.sh "${cand}DEVICES=$NDEV DURATION=$DURATION INTERVAL=$INTERVAL ROUNDS=$ROUNDS bench/compare.sh"
pre=${LABEL:+$LABEL }
# First the rounds and what the pool of them all says (the headline), then
# each round alone, then each pool of the first k rounds.
rec_fig "${pre}rounds" "$ROUNDS" rounds
if [ "${#pools[@]}" -gt 0 ]; then
	read -r _ reg imp _ <<<"${pools[-1]}"
	rec_fig "${pre}all rounds pooled, figures regressed" "$reg" figures
	rec_fig "${pre}all rounds pooled, figures improved" "$imp" figures
fi
rec_fig "${pre}rounds regressed" "$regressed" rounds
rec_fig "${pre}rounds improved" "$improved" rounds
rec_fig "${pre}rounds within noise" "$noise" rounds
for r in $(seq "$ROUNDS"); do
	read -r p50 p99 <<<"${ratios[$((r - 1))]}"
	rec_fig "${pre}round $r measurement p50 B/A" "$p50" ratio
	rec_fig "${pre}round $r measurement p99 B/A" "$p99" ratio
done
for p in "${pools[@]}"; do
	read -r k reg imp p50 p99 <<<"$p"
	rec_fig "${pre}rounds 1-$k pooled, figures regressed" "$reg" figures
	rec_fig "${pre}rounds 1-$k pooled, figures improved" "$imp" figures
	rec_fig "${pre}rounds 1-$k pooled, measurement p50 B/A" "$p50" ratio
	rec_fig "${pre}rounds 1-$k pooled, measurement p99 B/A" "$p99" ratio
done
rec_end
