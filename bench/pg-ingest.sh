#!/usr/bin/env bash
# Issue 3 benchmarks 2 and 3 on a throwaway PostgreSQL cluster, against
# `kettle serve --db postgres://…`:
#   2. batched ingest, POST /v1/measurements with batches of 500 readings of
#      one device (a kettle uploading its backlog), acknowledged rows/s, for
#      each client concurrency in V1_CONNS (kettle serve on a fresh database
#      each), against the ceiling: a raw binary COPY of as many identical rows
#      (the count the ingest stored) into a fresh scratch table of the same
#      shape, right after it in the same run, with rows encoded by hand (the
#      stricter ceiling, used for the ratio) and with pgx's CopyFrom;
#      V1_ROUNDS times (default 1) at each concurrency, with the median ratio;
#   3. acknowledged single-measurement requests/s (case-study POST
#      /measurement, many devices, wrk + bench/measurement.lua as
#      bench/ingest.sh) against the bare JSON-decoding handler (bench/bare)
#      driven by the same client in the same run, for each wrk concurrency in
#      CONNS, ROUNDS times (bare then kettle serve, kettle serve on a fresh
#      database each time): the ratio of each round, their median at each
#      concurrency, and the ratio of the two peaks. One run of each swings
#      by several per cent on a shared machine, hence the rounds.
# Every phase also reports CPU seconds per row or request of each process
# (client, kettle serve, postgres): on a shared machine they are steadier
# than rates.
#
#   bench/pg-ingest.sh
#   DURATION=30s CONNS="256" V1_CONNS="64" DEVICES=4000 SERVE_ARGS="--writers 3" bench/pg-ingest.sh
#
# WARM_ROWS (default 12000000): rows of the warm-up COPY before everything,
# not counted; it leaves the cluster's WAL files made and recycled and its
# shared_buffers touched, as in a server in service (see the warm-up below).
#
# WAIT=1: after each kettle serve run, the bare handler once more with
# --delay set to that run's median latency (bare-wait): a handler that only
# waits as long as kettle serve's requests wait for their commit, no store.
# Its CPU per request against the plain bare handler's is what the wait alone
# costs (at 1024 connections, Little's law makes that wait ~30 ms whatever
# the server does with it).
#
# PROFILE=S (with OUT=DIR, default the work dir, removed at exit): during
# each single-measurement run, from its middle, a machine-wide perf record
# (cpu-clock, call graphs: `perf report --sort comm,dso` splits it by
# process) into OUT/bare-CONNS-ROUND.perf or OUT/kettle-CONNS-ROUND.perf, and
# of kettle serve an S-second Go CPU profile (its --debug-addr),
# OUT/kettle-CONNS-ROUND.pprof.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh # free_port, bench_build, rec_*
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${DURATION:=2s}" "${CONNS:=4}" "${ROUNDS:=1}" "${V1_CONNS:=2}" "${V1_DEVICES:=10}" "${WARM_ROWS:=1000}"
NDEV=${DEVICES:-2000}
DURATION=${DURATION:-20s}
CONNS=${CONNS-64 256 1024}   # wrk connections (benchmark 3), one run each
THREADS=${THREADS:-2}
V1_CONNS=${V1_CONNS-64 128}  # pgbench ingest connections (benchmark 2; 128 = 64,000 readings in flight, under the ingest queue); "" skips it
V1_ROUNDS=${V1_ROUNDS:-1}     # batched: runs (ingest, then its ceiling) at each of V1_CONNS, and their median
V1_DEVICES=${V1_DEVICES:-2000}
CEIL_STREAMS=${CEIL_STREAMS:-4} # the ceiling's parallel COPY streams (kettle serve writes with 2)
PORT_K=${PORT_K:-$(free_port)}
PORT_B=${PORT_B:-$(free_port)}
ROUNDS=${ROUNDS:-3}   # single readings: rounds of (bare, kettle serve) at each of CONNS
PROFILE=${PROFILE:-0}
WAIT=${WAIT:-0}
PORT_W=$(free_port)
PORT_D=$(free_port)
command -v wrk >/dev/null || { echo "wrk missing: apt-get install -y wrk"; exit 1; }
. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-pgbench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pg_stop; rm -rf "$work"; }
trap cleanup EXIT
OUT=${OUT:-$work}; mkdir -p "$OUT"
rerun="${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }${WARM_ROWS:+WARM_ROWS=$WARM_ROWS }$( ((WAIT == 0)) || echo "WAIT=$WAIT ")DEVICES=$NDEV DURATION=$DURATION CONNS=\"$CONNS\" ROUNDS=$ROUNDS THREADS=$THREADS V1_CONNS=\"$V1_CONNS\" V1_ROUNDS=$V1_ROUNDS V1_DEVICES=$V1_DEVICES CEIL_STREAMS=$CEIL_STREAMS SERVE_ARGS=\"${SERVE_ARGS:-}\" bench/pg-ingest.sh"
echo "rerun: $rerun"
rec_begin pg-ingest.sh "$rerun"
machine_line
build_kettle "$work"
bench_build "$work/bare" ./bench/bare
bench_build "$work/pgbench" ./bench/pgbench
pg_start
pg_settings
ceil_dsn=$(pg_db ceiling)
wait_up() { for _ in $(seq 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }
# serve DB DATA_DIR: start kettle serve on a fresh database DB at PORT_K; sets kpid
serve() {
	"$work/kettle" serve --addr 127.0.0.1:$PORT_K --db "$(pg_db "$1")" --data-dir "$2" \
		--access-log-sample "${ACCESS_LOG_SAMPLE:-0.01}" ${SERVE_ARGS:-} \
		$( ((PROFILE > 0)) && echo "--debug-addr 127.0.0.1:$PORT_D") 2>"$2.log" & pids+=($!)
	kpid=${pids[-1]}
	wait_up "http://127.0.0.1:$PORT_K/readyz"
}

# ceiling ENCODER ROWS: one raw COPY run of ROWS rows into a fresh scratch
# table; prints its RESULT and a CPU line
ceiling() {
	local s0 s1 out; s0=$(pg_cpu)
	out=$( { /usr/bin/time -f "__CPU %U %S" "$work/pgbench" ceiling --dsn "$ceil_dsn" --rows ingest --devices "$V1_DEVICES" --batch 500 \
		--total "$2" --chunk-rows 20000 --workers "$CEIL_STREAMS" --encoder "$1"; } 2>&1 ); sleep 1; s1=$(pg_cpu)
	echo "$out" | grep RESULT
	echo "$out" | awk -v s0="$s0" -v s1="$s1" -v r="$2" '/^__CPU/ { printf "CPU ceiling client_s=%.2f postgres_s=%.2f µs_per_row=%.2f\n", $2+$3, s1-s0, ($2+$3+s1-s0)/r*1e6 }'
	pg_sql ceiling "CHECKPOINT" >/dev/null
}
rate() { sed -n 's/.*rows_per_s=\([0-9]*\).*/\1/p'; }
# batches: kettle serve's ingest batches so far: readings, batches, commit seconds
batches() { curl -s "http://127.0.0.1:$PORT_K/metrics" | awk '/^kettle_ingest_batch_rows_sum/ { r = $2 } /^kettle_ingest_batch_rows_count/ { c = $2 }
	/^kettle_ingest_commit_seconds_sum/ { s = $2 } END { print r + 0, c + 0, s + 0 }'; }
# batch_line BEFORE AFTER: the batches between two readings of batches, as means
batch_line() { awk -v a="$1" -v b="$2" 'BEGIN { split(a, p); split(b, q); r = q[1] - p[1]; c = q[2] - p[2]; s = q[3] - p[3]
	printf "kettle serve batches: %d, %.1f readings each, commit %.2f ms each (means)\n", c, r / c, s / c * 1000 }'; }
cpurow() { sed -n 's/.*µs_per_row=\([0-9.]*\).*/\1/p'; }
# Warm-up, not counted: the first heavy write into a fresh cluster also
# creates its WAL segment files (later ones recycle them) and is the first
# to touch shared_buffers' memory; without it the first ceiling pays for
# that alone. It must be as large as what one ingest writes (up to ~12
# million rows, ~3 GB of WAL): a smaller one leaves the first round's ingest
# creating and zero-filling most of its WAL files, where the ceiling after it
# (and every later round) finds them recycled (docs/performance.md). Two
# checkpoints after it recycle its files (as pg_warm_wal's do).
ceiling raw "${WARM_ROWS:-12000000}" >/dev/null
pg_sql postgres CHECKPOINT >/dev/null

# Each concurrency: kettle serve on a fresh database, the ingest, then the
# ceiling COPYing as many of the same rows (the count the ingest stored) into
# a fresh scratch table: COPY slows as the table and its index grow (into an
# empty table, 2,000,000 rows went in at 885,375 rows/s; 4,000,000 at 519,058
# in another run), so both sides start empty and end the same size.
v1summary=()
for vc in $V1_CONNS; do
	v1ratios=()
	for vr in $(seq "$V1_ROUNDS"); do
		echo "--- POST /v1/measurements, batches of 500 readings of one device, $vc connections, $V1_DEVICES devices, $DURATION, round $vr of $V1_ROUNDS; kettle serve --db postgres (fresh database) ${SERVE_ARGS:-} ---"
		serve "kettle_v1_${vc}_$vr" "$work/data-v1-$vc-$vr"
		k0=$(proc_cpu "$kpid"); s0=$(pg_cpu); m0=$(batches)
		v1out=$( { /usr/bin/time -f "__CPU %U %S" "$work/pgbench" ingest --url "http://127.0.0.1:$PORT_K" --data-dir "$work/data-v1-$vc-$vr" --devices "$V1_DEVICES" \
			--batch 500 --conns "$vc" --duration "$DURATION" --warmup 0s; } 2>&1 )
		k1=$(proc_cpu "$kpid"); s1=$(pg_cpu); m1=$(batches)
		kill "$kpid"; wait "$kpid" 2>/dev/null || true
		echo "$v1out" | grep -v __CPU
		batch_line "$m0" "$m1"
		sv=$(echo "$v1out" | sed -n 's/.*stored=\([0-9]*\).*/\1/p')
		rv=$(echo "$v1out" | grep RESULT | rate)
		v1cpu=$(echo "$v1out" | awk -v vc="$vc" -v rv="$rv" -v sv="$sv" -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v pg="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" \
			'/^__CPU/ { cl = $2 + $3; printf "v1 conns=%d rows_per_s=%d CPU µs/row %.2f = pgbench client %.2f + kettle serve %.2f + postgres %.2f\n", vc, rv, (cl + k + pg) / sv * 1e6, cl / sv * 1e6, k / sv * 1e6, pg / sv * 1e6 }')
		echo "$v1cpu"
		# The ingest's database goes before the ceiling runs, so that the
		# COPY, like the ingest, starts with shared_buffers free: with the
		# ingest's (clean) pages still in them, the COPY would spend
		# PostgreSQL's CPU evicting them (docs/performance.md).
		pg_sql postgres "DROP DATABASE kettle_v1_${vc}_$vr" >/dev/null
		pg_sql postgres "CHECKPOINT" >/dev/null
		echo "--- ceiling: raw binary COPY of pgbench ingest's rows ($sv, as many as the ingest stored; 20000-row COPYs, $CEIL_STREAMS streams) into a fresh scratch table of measurements' shape (day partitions, (device, t) primary key, each COPY into its day's partition when it falls in one); encoder raw (by hand), then pgx (CopyFrom) ---"
		c=$(ceiling raw "$sv"); echo "$c"
		p=$(ceiling pgx "$sv"); echo "$p"
		awk -v vc="$vc" -v s="$rv" -v c="$(echo "$c" | rate)" -v p="$(echo "$p" | rate)" -v cu="$(echo "$c" | cpurow)" -v iu="$(echo "$v1cpu" | awk '{ print $6 }')" 'BEGIN {
			printf "RATIO v1 ingest/ceiling = %.3f at %d connections (ingest %d rows/s acknowledged; raw-encoded COPY of as many rows %d rows/s); against pgx CopyFrom (%d rows/s): %.3f; at equal CPU (%.2f µs/row for the COPY, %.2f for ingest): %.3f; goal >= 0.75\n", s/c, vc, s, c, p, s/p, cu, iu, cu/iu }'
		v1ratios+=("$(awk -v s="$rv" -v c="$(echo "$c" | rate)" 'BEGIN { printf "%.3f", s/c }')")
	done
	v1summary+=("RATIO v1 ingest/ceiling at $vc connections: median $(printf '%s\n' "${v1ratios[@]}" | median) of $V1_ROUNDS rounds (${v1ratios[*]}); goal >= 0.75")
	rec_fig "v1 ingest/raw COPY at $vc connections, median of rounds" "$(printf '%s\n' "${v1ratios[@]}" | median)" ratio
done
((${#v1summary[@]} == 0)) || printf '%s\n' "${v1summary[@]}"

[ -n "$CONNS" ] || exit 0
# start_bare PORT NAME [FLAG...]: the bare handler on PORT, its pid in
# bare_pid once it answers
start_bare() {
	local port=$1 name=$2; shift 2
	"$work/bare" --addr 127.0.0.1:$port "$@" 2>"$work/$name.log" & pids+=($!)
	bare_pid=$!
	for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
}
start_bare "$PORT_B" bare
bpid=$bare_pid
export DEVICES="$work/devices.txt"
# the bare handler takes any UUID; each kettle serve run registers its own
for _ in $(seq "$NDEV"); do cat /proc/sys/kernel/random/uuid; done >"$DEVICES"
base0=$(( $(date +%s) - 7200 ))
export BASE_EPOCH=$base0 # every kettle serve run starts on an empty table: no duplicates
count() { curl -s -H "Authorization: Bearer $tok" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p'; }
# drive NAME PORT PID CONNS: one wrk run, its RESULT and CPU µs per request
drive() {
	local k0 k1 s0 s1 x0 x1 m0 m1 out n prof=(); k0=$(proc_cpu "$3"); s0=$(pg_cpu)
	x0=$(awk '/^ctxt/ { print $2 }' /proc/stat); [ "$1" = kettle ] && m0=$(batches)
	if ((PROFILE > 0)); then # from the middle of the run, in the background
		local d=${DURATION%s}
		[ "$1" = kettle ] && (sleep $(((d - PROFILE) / 2)); curl -fsS --max-time $((PROFILE + 30)) -o "$OUT/kettle-$4-$5.pprof" \
			"http://127.0.0.1:$PORT_D/debug/pprof/profile?seconds=$PROFILE") & prof+=($!)
		(sleep $(((d - PROFILE) / 2)); perf record -q -a -e cpu-clock -g -o "$OUT/$1-$4-$5.perf" -- sleep "$PROFILE" >/dev/null 2>&1) & prof+=($!)
	fi
	out=$( { /usr/bin/time -f "__CPU %U %S" wrk -t"$THREADS" -c"$4" -d"$DURATION" -s bench/measurement.lua "http://127.0.0.1:$2"; } 2>&1 )
	k1=$(proc_cpu "$3"); s1=$(pg_cpu); x1=$(awk '/^ctxt/ { print $2 }' /proc/stat); [ "$1" = kettle ] && m1=$(batches)
	((${#prof[@]} == 0)) || wait "${prof[@]}"
	echo "$out" | grep RESULT
	n=$(echo "$out" | sed -n 's/.*requests=\([0-9]*\).*/\1/p')
	# context switches of the whole machine; kettle serve's batches (rows and
	# commit time, means over the run)
	awk -v t="$1" -v n="$n" -v x="$((x1 - x0))" 'BEGIN { printf "context switches %s: %.2f a request (machine)\n", t, x / n }'
	[ "$1" = kettle ] && batch_line "$m0" "$m1"
	echo "$out" | awk -v t="$1" -v n="$n" -v k="$(awk -v a=$k0 -v b=$k1 'BEGIN{print b-a}')" -v pg="$(awk -v a=$s0 -v b=$s1 'BEGIN{print b-a}')" \
		'/^__CPU/ { printf "CPU %s µs/request: wrk %.1f server %.1f postgres %.1f\n", t, ($2+$3)/n*1e6, k/n*1e6, pg/n*1e6 }'
}
# batches: kettle serve's batch rows sum, batch count and commit seconds sum
rps() { sed -n 's/.*rps=\([0-9.]*\).*/\1/p'; }
best_b=0; best_k=0; run=0; summary=()
for c in $CONNS; do
	ratios=()
	for r in $(seq "$ROUNDS"); do
		echo "--- wrk: $THREADS threads, $c connections, $DURATION, $NDEV devices, round $r of $ROUNDS: bare JSON-decoding handler (no store), then kettle serve (PostgreSQL, fresh database, 200 after commit) ---"
		bare=$(drive bare "$PORT_B" "$bpid" "$c" "$r"); echo "$bare"
		# kettle serve on a fresh database each run, so that every run
		# starts from the same (empty) table whatever ran before it
		run=$((run + 1))
		serve "kettle_single_$run" "$work/data-single-$run"
		tok=$(cat "$work/data-single-$run/operator-token")
		"$work/pgbench" login --url "http://127.0.0.1:$PORT_K" -n "$NDEV" >"$work/devices.txt"
		[ "$(grep -c . "$work/devices.txt")" = "$NDEV" ] || { echo "registration failed"; exit 1; }
		pg_sql "kettle_single_$run" "CHECKPOINT" >/dev/null
		before=$(count)
		kett=$(drive kettle "$PORT_K" "$kpid" "$c" "$r"); echo "$kett"
		after=$(count)
		kill "$kpid"; wait "$kpid" 2>/dev/null || true
		reqs=$(echo "$kett" | sed -n 's/.*requests=\([0-9]*\).*/\1/p')
		errs=$(echo "$kett" | sed -n 's/.*errors_status=\([0-9]*\).*/\1/p')
		echo "stored rows during wrk (GET /v1/statistics measurement_count delta): $((after - before)); wrk requests: $reqs; non-2xx: $errs"
		# more stored than counted: requests in flight when wrk stopped counting
		[ "$((after - before))" -ge "$((reqs - errs))" ] || echo "WARNING: $((reqs - errs - after + before)) acknowledged requests stored no new row (duplicates): this run does not measure new readings"
		rb=$(echo "$bare" | rps); rk=$(echo "$kett" | rps)
		if ((WAIT > 0)); then # the bare handler holding each request as long as kettle serve's median
			wait_ms=$(echo "$kett" | sed -n 's/.*p50_ms=\([0-9.]*\).*/\1/p')
			start_bare "$PORT_W" bare-wait --delay "${wait_ms}ms"
			wpid=$bare_pid
			echo "bare-wait: the bare handler with --delay ${wait_ms}ms (kettle serve's p50 in this round)"
			drive bare-wait "$PORT_W" "$wpid" "$c" "$r"
			kill "$wpid"; wait "$wpid" 2>/dev/null || true
		fi
		ratio=$(awk -v k="$rk" -v b="$rb" 'BEGIN { printf "%.3f", k/b }'); ratios+=("$ratio")
		awk -v k="$rk" -v b="$rb" -v c="$c" -v x="$ratio" -v r="$r" 'BEGIN { printf "RATIO kettle(postgres)/bare = %s at %d connections, round %d (%.0f / %.0f req/s); goal >= 0.50\n", x, c, r, k, b }'
		best_b=$(awk -v a="$best_b" -v b="$rb" 'BEGIN { print (b > a ? b : a) }'); best_k=$(awk -v a="$best_k" -v b="$rk" 'BEGIN { print (b > a ? b : a) }')
	done
	summary+=("RATIO kettle(postgres)/bare at $c connections: median $(printf '%s\n' "${ratios[@]}" | median) of $ROUNDS rounds (${ratios[*]}); goal >= 0.50")
	rec_fig "single readings kettle/bare at $c connections, median of rounds" "$(printf '%s\n' "${ratios[@]}" | median)" ratio
done
printf '%s\n' "${summary[@]}"
awk -v k="$best_k" -v b="$best_b" -v c="$CONNS" 'BEGIN { printf "RATIO of peaks over connections %s: kettle(postgres) %.0f / bare %.0f req/s = %.3f; goal >= 0.50\n", c, k, b, k/b }'
rec_fig "single readings, kettle serve peak" "$best_k" req/s
rec_ceiling "single readings, bare handler peak" "$best_b" req/s
rec_ratio "$(awk -v k="$best_k" -v b="$best_b" 'BEGIN { if (b > 0) printf "%.3f", k/b }')"
rec_end
