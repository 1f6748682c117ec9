# Sourced by bench scripts: collect the figures of a run, then append them as
# one record to bench/results.jsonl through the Go recorder,
# internal/results/cmd/record (its doc has the format).
#
#   . bench/lib/record.sh
#   rec_begin ingest.sh "DEVICES=$NDEV DURATION=$DURATION bench/ingest.sh"
#   rec_fig "kettle serve" "$rk" req/s        # as often as there are figures
#   rec_ceiling "bare handler" "$rb" req/s    # optional
#   rec_ratio "$ratio"                        # optional
#   rec_end
#
# A failed record (a figure without a number, a log that cannot be written)
# fails the run: rec_end exits non-zero under set -e.
#
# SMOKE=1: the bench's smoke mode (tiny sizes, seconds; bench/smoke_test.go
# runs every script so). The record is checked and, unless KETTLE_RESULTS
# names a log, not written.

REC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# A command that ends the run (set -e) says which, where: a benchmark that
# cannot start fails loudly, not with nothing printed.
set -o errtrace
trap 'rec_rc=$?; echo "${BASH_SOURCE[0]#"$REC_ROOT"/}: line $LINENO: \"$BASH_COMMAND\" failed (exit $rec_rc)" >&2' ERR

# The recorder, built once per run into the checkout's bin/ (go build is
# incremental), or KETTLE_RECORD_BIN: a prebuilt one, which the smoke test
# passes to every script. Exported, so that nested scripts reuse it.
if [ -z "${KETTLE_RECORD_BIN:-}" ]; then
	(cd "$REC_ROOT" && go build -o bin/record ./internal/results/cmd/record)
	export KETTLE_RECORD_BIN=$REC_ROOT/bin/record
fi
rec() { "$KETTLE_RECORD_BIN" "$@"; } # rec CMD ARGS…: see internal/results/cmd/record

rec_begin() { # rec_begin SCRIPT COMMAND
	REC_BENCH=$1 REC_COMMAND=$2
	KETTLE_REC_FIGS=$(mktemp /tmp/kettle-rec-XXXXXX)
	export KETTLE_REC_FIGS
}
rec_fig() { echo "figure $1=$2:$3" >>"$KETTLE_REC_FIGS"; }     # rec_fig NAME VALUE UNIT
rec_ceiling() { echo "ceiling $1=$2:$3" >>"$KETTLE_REC_FIGS"; } # rec_ceiling NAME VALUE UNIT
rec_ratio() { echo "ratio $1" >>"$KETTLE_REC_FIGS"; }           # rec_ratio N
rec_end() {
	[ -n "${KETTLE_REC_FIGS:-}" ] || { echo "rec_end without rec_begin" >&2; return 1; }
	rec append "$REC_BENCH" "$REC_COMMAND" "$KETTLE_REC_FIGS"
	rm -f "$KETTLE_REC_FIGS"
	KETTLE_REC_FIGS=
}

# rec_swarm RESULTS_JSON [LABEL]: the figures of a kettle swarm run (its
# --out DIR/results.json): each endpoint's p99 and rate, the run's errors,
# and the audit's lost and duplicated readings, each name prefixed with LABEL.
rec_swarm() { rec swarm "$1" "${2:-}" >>"$KETTLE_REC_FIGS"; }

# rec_results FILE [LABEL]: a figure for every numeric KEY=VALUE of every
# "RESULT NAME KEY=VALUE…" line in FILE (what bench/pgbench prints), named
# "LABEL NAME KEY", its unit read from the key (…_ms, …_per_s, bytes…).
rec_results() { rec results "$1" "${2:-}" >>"$KETTLE_REC_FIGS"; }

# rec_lines: the figure, ceiling and ratio lines on stdin (checked at rec_end).
rec_lines() { cat >>"$KETTLE_REC_FIGS"; }

# rec_json FILE NAME=PATH:UNIT…: figures from a JSON document's numbers
# (PATH: .totals.acked; a trailing '?' when it may be absent).
rec_json() { rec json "$@" >>"$KETTLE_REC_FIGS"; }

# bench_build OUT PKG: go build PKG (./cmd/kettle, ./bench/pgbench, …) to
# OUT, or copy the binary of that name from $KETTLE_BENCH_BINS, where the
# smoke test builds each once for every script.
bench_build() {
	if [ -n "${KETTLE_BENCH_BINS:-}" ] && [ -x "$KETTLE_BENCH_BINS/${2##*/}" ]; then
		cp "$KETTLE_BENCH_BINS/${2##*/}" "$1"
		return
	fi
	go build -o "$1" "$2"
}

# free_port: a TCP port free on 127.0.0.1 now.
free_port() { rec free-port; }
