#!/usr/bin/env bash
# Issue 7: 100,000 MQTT kettles held at their 30 s cadence, QoS 1, PUBACK
# after the commit, commands by subscription, on this machine.
#
# One process holds at most ~19,800 sockets here (open files: 20,000, hard),
# so the fleet is split: NODES kettle serve processes on ONE throwaway
# PostgreSQL (each reloads its device cache from the store, --cache-refresh),
# each with its own embedded MQTT listener capped at NODE_CAP connections,
# and the distributed lab drives them: WORKERS kettle swarm worker processes
# and one controller (kettle swarm --workers), worker i → node i mod NODES,
# each worker from its own source addresses (SRC_PER_SWARM of them from
# ADDR_NET.11). Each worker provisions its shard through the operator API
# (POST /v1/devices) on its node. Connects are ramped over RAMP seconds
# (whole intervals: an even cadence after); once every kettle is connected
# the fleet is held for HOLD seconds, and that window is measured:
#   connections per node, readings/s acknowledged vs DEVICES/interval,
#   PUBACK p50/p99 (from the lab's one results.json: the workers' histograms
#   merged exactly by the controller), RSS (KiB per connection) and CPU of
#   every node, worker and PostgreSQL, errors and reconnects;
# then the controller audits every worker's kettles once (acked = stored,
# lost 0, duplicated 0) and the run is recorded in bench/results.jsonl.
#
#   bench/mqtt-fleet.sh                          # 100,000 kettles, 6 nodes + 6 workers, hold 180 s
#   DEVICES=4000 NODES=2 WORKERS=3 RAMP=30 HOLD=60 bench/mqtt-fleet.sh   # a small rehearsal
#   OUT=results/mqtt-fleet bench/mqtt-fleet.sh   # keep logs and results.json
#
# Bounded: every Go process gets GOMEMLIMIT (soft) and a watchdog aborts the
# run (killing everything it started) if their RSS together passes MEM_CAP_MIB
# (PostgreSQL is bounded by its own settings: shared_buffers, work_mem);
# the swarms stop by themselves (--duration), the script kills whatever is
# still running after DEADLINE seconds, and the EXIT trap stops every process
# it started and the database. Traffic goes to 127.0.0.x only.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${NODES:=1}" "${INTERVAL:=1}" "${RAMP:=2}" "${HOLD:=2}" "${CONNECT_WAIT:=6}" "${LAB_TAIL:=6}"
DEVICES=${DEVICES:-100000}
NODES=${NODES:-6}
NODE_CAP=${NODE_CAP:-17500}        # --mqtt-max-conns per node (< open-file limit)
INTERVAL=${INTERVAL:-30}           # seconds between a kettle's readings
# RAMP: seconds over which the kettles connect (hatch rate = DEVICES/RAMP);
# default: whole intervals, at least 3, at most CONNECT_RATE connects/s. A
# connect costs a node and a swarm far more than a reading (session,
# subscription, retained command), on top of the fleet already connected:
# 100,000 over 3 intervals is 1,100/s.
CONNECT_RATE=${CONNECT_RATE:-170}
RAMP=${RAMP:-$(((DEVICES / CONNECT_RATE / INTERVAL + 1) > 3 ? (DEVICES / CONNECT_RATE / INTERVAL + 1) * INTERVAL : 3 * INTERVAL))}
HOLD=${HOLD:-$((6 * INTERVAL))}    # seconds measured after every kettle connected
MEM_CAP_MIB=${MEM_CAP_MIB:-14336}  # all our Go processes together (RSS); over it: abort
GOMEMLIMIT_MIB=${GOMEMLIMIT_MIB:-2048}
GOGC_PCT=${GOGC_PCT:-100}          # GOGC: higher means fewer GCs (each scans ~2 goroutine stacks per connection) but more RSS (400 passed MEM_CAP at 100,000)
SWARM_GOGC_PCT=${SWARM_GOGC_PCT:-$GOGC_PCT} # GOGC of the swarms alone (each GC scans one reader goroutine's stack per kettle)
# GOMAXPROCS of every node and swarm: 12 Go processes share 2 cores and each
# needs a fraction of one; a second P only adds idle spinning and futex
# wake-ups (10,000 kettles, 2+2 processes: per kettle, nodes 1.14 → 0.96
# CPU-ms/min and swarms 0.85 → 0.68 with 1).
MAXPROCS=${MAXPROCS:-1}
# Each node commits what arrived within BATCH_WAIT in one transaction, with
# WRITERS transactions at once. At a kettle's cadence the fleet's rate is
# low (~550 readings/s per node at 100,000) and most of the cost, ours and
# PostgreSQL's, is per commit: 100 ms and one writer → ~55 rows per commit
# instead of a few (10,000 kettles, 2+2 processes, side by side with 20 ms
# and 2 writers: per kettle, nodes 0.88 → 0.56 CPU-ms/min, PostgreSQL
# 15.7% → 3.8% of a core) for at most 100 ms more PUBACK latency.
# CACHE_REFRESH: each node rescans every
# device (all 100,000) this often to see what the other nodes committed; an
# MQTT kettle's commands come from the node it is connected to, which
# commits its readings, so only other nodes' overrides wait for it. The
# scan costs nodes × devices rows per period: at 30 s, 100,000 kettles on
# six nodes, it was 19% of a node's CPU (0.55 of 2.84 s in node 0's
# profile of the hold), plus the GC of its garbage and PostgreSQL serving
# 20,000 rows/s; 120 s takes three quarters of that off.
BATCH_WAIT=${BATCH_WAIT:-100ms}
WRITERS=${WRITERS:-1}
# GODEBUG of nodes and swarms: gcshrinkstackoff=1 keeps a goroutine's stack
# at the size it grew to. Otherwise every GC shrinks the stacks of idle
# connections (one goroutine each in a swarm; a node holds none on Linux)
# and the next
# message grows them again: copies both ways, and more RSS, not less
# (10,000 kettles, 2+2 processes, side by side without it: per kettle, nodes
# 0.64 → 0.55 CPU-ms/min and 81.8 → 62.7 KiB RSS; swarms unchanged in CPU,
# +3.4 KiB).
GODEBUG_RUN=${GODEBUG_RUN-gcshrinkstackoff=1}
CACHE_REFRESH=${CACHE_REFRESH:-120s}
# SRC_PER_SWARM: source addresses per worker (ADDR_NET.11, .12, …). bind() to
# an address with port 0 takes ephemeral ports of one parity first, half of
# the ~28,000: past ~14,000 connections from one address every new one
# searched the whole used half in the kernel (both 100,000-kettle runs of
# 2026-11-22 with one address per swarm stalled at ~84,000 connected, 14,000
# per swarm, the machine half in the kernel, until the connects ended).
SRC_PER_SWARM=${SRC_PER_SWARM:-4}
SERVE_ARGS=${SERVE_ARGS:-}
SWARM_ARGS=${SWARM_ARGS:-}
# SWARM_BIN_ODD=path: odd-numbered swarms run that kettle binary instead of
# this tree's (an A/B of two simulators side by side in one run, e.g. a
# build of main: git worktree add /tmp/main main && go build -o /tmp/kettle-main ./cmd/kettle there).
SWARM_BIN_ODD=${SWARM_BIN_ODD:-}
OUT=${OUT:-}
# PROFILE=S: take an S-second CPU profile of node 0 and swarm 0 from the
# middle of the hold (their --debug-addr), into OUT (or the work dir).
PROFILE=${PROFILE:-0}
per=$(((DEVICES + NODES - 1) / NODES))
fdmax=$(ulimit -Hn)
# WORKERS: kettle swarm worker processes (one MQTT connection per kettle:
# each holds at most ~19,800); ADDR_NET: the /24 their control listeners
# (ADDR_NET.200+i) and source addresses (ADDR_NET.11+) come from.
WORKERS=${WORKERS:-$NODES}
ADDR_NET=${ADDR_NET:-127.0.0}
wper=$(((DEVICES + WORKERS - 1) / WORKERS))
((wper <= fdmax - 300)) || { echo "DEVICES/WORKERS = $wper: more than one worker's open files: raise WORKERS"; exit 1; }
((per <= NODE_CAP)) || { echo "DEVICES/NODES = $per > NODE_CAP $NODE_CAP: raise NODES"; exit 1; }
((NODE_CAP + 300 <= fdmax)) || { echo "NODE_CAP $NODE_CAP too close to the open-file limit $fdmax"; exit 1; }
# A kettle's first reading is due when it connects, so connects spread over
# a whole number of intervals give an even cadence afterwards; a hold of a
# whole number of intervals sees every kettle the same number of times.
((RAMP % INTERVAL == 0 && HOLD % INTERVAL == 0)) || echo "note: RAMP and HOLD are not multiples of INTERVAL: readings/s in the hold will not be DEVICES/INTERVAL exactly"
ramp=$RAMP
HATCH=$(awk -v d="$DEVICES" -v r="$RAMP" 'BEGIN{printf "%.2f", d/r}')
CONNECT_WAIT=${CONNECT_WAIT:-$((ramp + 90))} # give up waiting for "all connected" after this
LAB_TAIL=${LAB_TAIL:-30}                    # seconds the lab runs past the hold
dur=$((CONNECT_WAIT + HOLD + LAB_TAIL))     # each swarm's --duration (it stops by itself)
DEADLINE=${DEADLINE:-$((dur + 900))}        # whole run incl. provisioning and audit; then kill
expect=$(awk -v d="$DEVICES" -v i="$INTERVAL" 'BEGIN{printf "%.1f", d/i}')
. bench/lib/record.sh # free_port, bench_build, rec_*

. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-mqttfleet-XXXXXX)
pids=()
cleanup() {
	set +e
	local p t
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
	for t in $(seq 60); do # a node drains and disconnects its kettles: give it 30 s, then SIGKILL
		alive=0
		for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
		((alive)) || break
		((t == 60)) && for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null && echo "cleanup: pid $p did not stop in 30 s: killed"; done
		sleep 0.5
	done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
	pg_stop
	if [ -n "$OUT" ]; then mkdir -p "$OUT" && cp -r "$work"/*.log "$work"/lab "$OUT"/ 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
t_start=$(date +%s)
echo "rerun: DEVICES=$DEVICES NODES=$NODES NODE_CAP=$NODE_CAP RAMP=$RAMP CONNECT_RATE=$CONNECT_RATE HOLD=$HOLD INTERVAL=$INTERVAL PROFILE=$PROFILE BATCH_WAIT=$BATCH_WAIT WRITERS=$WRITERS GODEBUG_RUN=$GODEBUG_RUN CACHE_REFRESH=$CACHE_REFRESH MEM_CAP_MIB=$MEM_CAP_MIB GOMEMLIMIT_MIB=$GOMEMLIMIT_MIB GOGC_PCT=$GOGC_PCT SWARM_GOGC_PCT=$SWARM_GOGC_PCT MAXPROCS=$MAXPROCS SERVE_ARGS=\"$SERVE_ARGS\" SWARM_ARGS=\"$SWARM_ARGS\" SWARM_BIN_ODD=$SWARM_BIN_ODD SRC_PER_SWARM=$SRC_PER_SWARM bench/mqtt-fleet.sh"
echo "machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), open files $fdmax, load average $(cut -d' ' -f1-3 /proc/loadavg) (shared: compare within a run)"
echo "plan: $DEVICES kettles = $WORKERS workers × $wper → $NODES nodes × $per (cap $NODE_CAP each), hatch $HATCH/s (ramp ~${ramp}s), hold ${HOLD}s, lab --duration ${dur}s, deadline ${DEADLINE}s"
bench_build "$work/kettle" ./cmd/kettle
bench_build "$work/mqttfleet" ./bench/mqttfleet
pg_start
pg_settings
PG_PID=$(head -1 "$PG_DIR/data/postmaster.pid")
SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
OPTOK=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export GOMEMLIMIT="${GOMEMLIMIT_MIB}MiB" GOGC="$GOGC_PCT" GOMAXPROCS="$MAXPROCS" GODEBUG="$GODEBUG_RUN"

# --- nodes ----------------------------------------------------------------------
node_pids=() http=() mq=() ndbg=() sdbg=()
for i in $(seq 0 $((NODES - 1))); do
	http[i]=$(free_port) mq[i]=$(free_port)
	dbg=
	if ((PROFILE > 0 && i == 0)); then
		ndbg[i]=$(free_port) sdbg[i]=$(free_port)
		dbg="--debug-addr 127.0.0.1:${ndbg[i]}"
	fi
	"$work/kettle" serve --db "$PG_DSN" --data-dir "$work/n$i" --addr "127.0.0.1:${http[i]}" \
		--secret "$SECRET" --operator-token "$OPTOK" --max-conns 256 \
		--mqtt-addr "127.0.0.1:${mq[i]}" --mqtt-max-conns "$NODE_CAP" \
		--pg-pool 4 --writers "$WRITERS" --batch-wait "$BATCH_WAIT" --cache-refresh "$CACHE_REFRESH" --access-log-sample 0 --log-level warn $dbg $SERVE_ARGS >"$work/node$i.log" 2>&1 &
	node_pids[i]=$!
	pids+=("$!")
done
for i in $(seq 0 $((NODES - 1))); do
	for _ in $(seq 150); do curl -fsS "http://127.0.0.1:${http[i]}/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
	curl -fsS "http://127.0.0.1:${http[i]}/readyz" >/dev/null || { echo "node $i did not start:"; tail -5 "$work/node$i.log"; exit 1; }
done
base_rss=()
for i in $(seq 0 $((NODES - 1))); do base_rss[i]=$(awk '/VmRSS/{print $2}' "/proc/${node_pids[i]}/status"); done
echo "nodes: $(for i in $(seq 0 $((NODES - 1))); do printf 'n%d pid %d mqtt :%d  ' "$i" "${node_pids[i]}" "${mq[i]}"; done)"

# --- watchdog: bound the memory of everything we started --------------------------
rss_kib() { awk '/VmRSS/{print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
pg_rss_kib() { # postmaster and its children (shared buffers counted once per process that touched them: an upper bound)
	local s=0 p
	for p in $PG_PID $(pgrep -P "$PG_PID" 2>/dev/null); do s=$((s + $(rss_kib "$p"))); done
	echo "$s"
}
(
	while sleep 2; do
		tot=0
		for p in $(cat "$work/pids" 2>/dev/null); do tot=$((tot + $(rss_kib "$p"))); done
		if ((tot > MEM_CAP_MIB * 1024)); then
			echo "WATCHDOG: our processes hold $((tot / 1024)) MiB RSS > MEM_CAP_MIB $MEM_CAP_MIB: aborting the run" | tee "$work/aborted"
			for p in $(cat "$work/pids"); do [ "$p" != "$PG_PID" ] && kill "$p" 2>/dev/null; done
			exit 0
		fi
	done
) &
WD=$!
pids+=("$WD")
echo "${node_pids[*]}" >"$work/pids"

# --- the lab: WORKERS kettle swarm worker processes, one controller ----------------
# The controller (kettle swarm --workers) splits the fleet over the workers
# (kettle i on worker i mod WORKERS), worker i loading node i mod NODES;
# it starts them at one common time, merges their per-second histograms
# into one results.json and audits every shard once, at the end.
swarm_pids=() waddrs=() wport=$(free_port)
LAB_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
for i in $(seq 0 $((WORKERS - 1))); do
	dbg=
	((PROFILE > 0 && i == 0)) && dbg="--debug-addr 127.0.0.1:${sdbg[0]}"
	bin=$work/kettle
	[ -n "$SWARM_BIN_ODD" ] && ((i % 2 == 1)) && bin=$SWARM_BIN_ODD
	waddrs[i]="$ADDR_NET.$((200 + i)):$wport"
	GOGC=$SWARM_GOGC_PCT KETTLE_TOKEN=$LAB_TOKEN "$bin" swarm worker --listen "${waddrs[i]}" \
		--source-addrs "$ADDR_NET.$((11 + SRC_PER_SWARM * i))-$ADDR_NET.$((10 + SRC_PER_SWARM * (i + 1)))" $dbg >"$work/worker$i.log" 2>&1 &
	swarm_pids[i]=$!
	pids+=("$!")
done
for i in $(seq 0 $((WORKERS - 1))); do
	for _ in $(seq 100); do grep -q "listening on" "$work/worker$i.log" && break; sleep 0.1; done
	grep -q "listening on" "$work/worker$i.log" || { echo "worker $i did not start:"; tail -5 "$work/worker$i.log"; exit 1; }
done
targets=$(for i in $(seq 0 $((NODES - 1))); do printf 'http://127.0.0.1:%s,' "${http[i]}"; done)
mtargets=$(for i in $(seq 0 $((NODES - 1))); do printf '127.0.0.1:%s,' "${mq[i]}"; done)
KETTLE_WORKER_TOKEN=$LAB_TOKEN "$work/kettle" swarm --protocol mqtt --target "${targets%,}" --mqtt-target "${mtargets%,}" \
	--workers "$(IFS=,; echo "${waddrs[*]}")" --operator-token "$OPTOK" --devices "$DEVICES" --hatch-rate "$HATCH" \
	--interval "${INTERVAL}s" --duration "${dur}s" --seed 1 --sample=false --report=false --out "$work/lab" \
	$SWARM_ARGS >"$work/lab.log" 2>&1 &
ctl_pid=$!
pids+=("$ctl_pid")
echo "${node_pids[*]} ${swarm_pids[*]}" >"$work/pids"
swarm_end=$(($(date +%s) + dur)) # the lab stops by itself then: the hold must end before
echo "lab: controller pid $ctl_pid, $WORKERS workers (pids ${swarm_pids[*]}) at ${waddrs[*]}, hatch $HATCH kettles/s over the fleet, sources $ADDR_NET.11..$ADDR_NET.$((10 + SRC_PER_SWARM * WORKERS)) ($SRC_PER_SWARM each)"

metric() { # PORT NAME: value of an unlabelled metric; -1 when the node does not answer
	# `|| true`: with pipefail, a node that does not answer would fail the
	# caller's assignment (R[i]=$(metric …)) and set -e would end the run.
	{ curl -fsS --max-time 10 "http://127.0.0.1:$1/metrics" 2>/dev/null || true; } | awk -v n="$2" '$1==n{printf "%d", $2+0; f=1} END{if(!f) printf "-1"}'
}
conns_all() { # sum over the nodes that answer; a node that does not is reported, not counted as 0 connections
	local s=0 i v miss=0
	for i in $(seq 0 $((NODES - 1))); do
		v=$(metric "${http[i]}" kettle_mqtt_connections)
		if ((v < 0)); then miss=$((miss + 1)); else s=$((s + v)); fi
	done
	((miss > 0)) && echo "  ($miss node(s) did not answer /metrics within 10 s)" >&2
	echo "$s"
}
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat" 2>/dev/null || echo -1; }
pg_ticks() { local s=0 p; for p in $PG_PID $(pgrep -P "$PG_PID" 2>/dev/null); do s=$((s + $(cpu_ticks "$p"))); done; echo "$s"; }
machine() { awk '/^cpu /{print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat; }
alive() { kill -0 "$ctl_pid" 2>/dev/null; }

# --- ramp: wait until every kettle is connected ------------------------------------
t_ramp=$(date +%s)
c=0
while :; do
	sleep 5
	[ -e "$work/aborted" ] && exit 1
	c=$(conns_all)
	el=$(($(date +%s) - t_ramp))
	echo "  ramp +${el}s: $c of $DEVICES connected; load $(cut -d' ' -f1 /proc/loadavg); RSS nodes+swarms $(($(for p in $(cat "$work/pids"); do rss_kib "$p"; done | paste -sd+ | bc) / 1024)) MiB"
	((c >= DEVICES)) && break
	((el >= CONNECT_WAIT || $(date +%s) + 60 >= swarm_end)) && { echo "  not all connected after ${el}s: holding with $c"; break; }
	alive || { echo "every swarm ended during the ramp"; tail -3 "$work"/swarm*.log; exit 1; }
done
echo "all connected after $(($(date +%s) - t_ramp))s (connects ramped at $HATCH/s)"

# --- hold: measure the steady fleet ------------------------------------------------
snap() { # → arrays: R (readings_total), W (withheld), U (unacked), X (refused), C (conns) per node; T (cpu ticks) per pid
	local i
	for i in $(seq 0 $((NODES - 1))); do
		R[i]=$(metric "${http[i]}" kettle_mqtt_readings_total)
		W[i]=$(metric "${http[i]}" kettle_mqtt_puback_withheld_total)
		U[i]=$(metric "${http[i]}" kettle_mqtt_unacked_total)
		X[i]=$(metric "${http[i]}" kettle_mqtt_connects_refused_total)
		C[i]=$(metric "${http[i]}" kettle_mqtt_connections)
		TN[i]=$(cpu_ticks "${node_pids[i]}")
	done
	for i in $(seq 0 $((WORKERS - 1))); do TS[i]=$(cpu_ticks "${swarm_pids[i]}"); done
	TP=$(pg_ticks)
	M=$(machine)
}
declare -a R W U X C TN TS
snap
R0=("${R[@]}") W0=("${W[@]}") U0=("${U[@]}") X0=("${X[@]}") TN0=("${TN[@]}") TS0=("${TS[@]}") TP0=$TP M0=$M
h0=$(date +%s)
load0=$(cut -d' ' -f1-3 /proc/loadavg)
minc=$c
hold_end=$((h0 + HOLD))
((hold_end > swarm_end - LAB_TAIL * 2 / 3)) && { hold_end=$((swarm_end - LAB_TAIL * 2 / 3)); echo "  (hold shortened to $((hold_end - h0))s: the swarms end at their --duration)"; }
if ((PROFILE > 0)); then # from the middle of the hold, in the background
	pdir=${OUT:-$work}
	mkdir -p "$pdir"
	pstart=$(((hold_end - h0 - PROFILE) / 2))
	( sleep $((pstart > 0 ? pstart : 0))
	  curl -fsS --max-time $((PROFILE + 30)) -o "$pdir/node0.cpu.pprof" "http://127.0.0.1:${ndbg[0]}/debug/pprof/profile?seconds=$PROFILE" &
	  curl -fsS --max-time $((PROFILE + 30)) -o "$pdir/swarm0.cpu.pprof" "http://127.0.0.1:${sdbg[0]}/debug/pprof/profile?seconds=$PROFILE" &
	  wait ) &
	echo "  profiling node 0 and swarm 0 for ${PROFILE}s from hold +${pstart}s into $pdir/{node0,swarm0}.cpu.pprof"
fi
while (($(date +%s) < hold_end)); do
	left=$((hold_end - $(date +%s)))
	sleep $((left < 10 ? (left > 0 ? left : 1) : 10))
	[ -e "$work/aborted" ] && exit 1
	c=$(conns_all)
	((c < minc)) && minc=$c
	(((($(date +%s) - h0) % 30) < 10)) && echo "  hold +$(($(date +%s) - h0))s: $c connected; load $(cut -d' ' -f1 /proc/loadavg)"
done
h1=$(date +%s)
snap
load1=$(cut -d' ' -f1-3 /proc/loadavg)
win=$((h1 - h0))
echo
echo "=== hold window ${win}s (load average at start $load0, at end $load1) ==="
read -r mb0 mt0 <<<"$M0"
read -r mb1 mt1 <<<"$M"
echo "machine busy $(awk -v a=$((mb1 - mb0)) -v b=$((mt1 - mt0)) 'BEGIN{printf "%.0f", 100*a/b}')% of $(nproc) cores (everyone's load, ours included)"
tck=$(getconf CLK_TCK)
tr=0 tw=0 tu=0 tx=0 tc=0 nrss=0 srss=0
printf "%-6s %8s %10s %9s %9s %10s %10s %8s %8s %8s\n" node conns readings/s CPU% RSS_MiB KiB/conn +KiB/conn withheld unacked refused
for i in $(seq 0 $((NODES - 1))); do
	r=$((R[i] - R0[i])) w=$((W[i] - W0[i])) u=$((U[i] - U0[i])) x=$((X[i] - X0[i]))
	rss=$(rss_kib "${node_pids[i]}")
	printf "%-6s %8d %10.1f %9.1f %9d %10.1f %10.1f %8d %8d %8d\n" "n$i" "${C[i]}" "$(awk -v r=$r -v w=$win 'BEGIN{print r/w}')" \
		"$(awk -v t=$((TN[i] - TN0[i])) -v w=$win -v k="$tck" 'BEGIN{print 100*t/k/w}')" $((rss / 1024)) \
		"$(awk -v r="$rss" -v c="${C[i]}" 'BEGIN{print (c>0 ? r/c : 0)}')" \
		"$(awk -v r="$rss" -v b="${base_rss[i]}" -v c="${C[i]}" 'BEGIN{print (c>0 ? (r-b)/c : 0)}')" $w $u $x
	tr=$((tr + r)) tw=$((tw + w)) tu=$((tu + u)) tx=$((tx + x)) tc=$((tc + C[i])) nrss=$((nrss + rss))
done
echo "(KiB/conn: RSS over connections; +KiB/conn: growth since the node was idle, over connections)"
echo "nodes: $tc connections (lowest during the hold $minc), $(awk -v r=$tr -v w=$win 'BEGIN{printf "%.1f", r/w}') readings/s committed+acked (expected $expect/s), RSS $((nrss / 1024)) MiB = $(awk -v r=$nrss -v c=$tc 'BEGIN{printf "%.1f", (c>0?r/c:0)}') KiB per connection; withheld $tw unacked $tu refused $tx"
printf "%-6s %9s %9s %10s\n" worker CPU% RSS_MiB KiB/kettle
for i in $(seq 0 $((WORKERS - 1))); do
	rss=$(rss_kib "${swarm_pids[i]}")
	srss=$((srss + rss))
	((TS[i] < 0)) && echo "w$i exited before the end of the hold (see its log)"
	printf "%-6s %9.1f %9d %10.1f\n" "w$i" "$(awk -v t=$((TS[i] - TS0[i])) -v w=$win -v k="$tck" 'BEGIN{print 100*t/k/w}')" $((rss / 1024)) \
		"$(awk -v r="$rss" -v c="$wper" 'BEGIN{print r/c}')"
done
echo "workers: RSS $((srss / 1024)) MiB = $(awk -v r=$srss -v c="$DEVICES" 'BEGIN{printf "%.1f", r/c}') KiB per kettle"
echo "postgres: CPU $(awk -v t=$((TP - TP0)) -v w=$win -v k="$tck" 'BEGIN{printf "%.1f", 100*t/k/w}')%, RSS (sum over its processes, shared memory counted in each) $(($(pg_rss_kib) / 1024)) MiB"
ncpu=$(awk -v a="${TN[*]}" -v b="${TN0[*]}" -v k="$tck" 'BEGIN{n=split(a,x," ");split(b,y," ");for(i=1;i<=n;i++)s+=x[i]-y[i];print s/k}')
scpu=$(awk -v a="${TS[*]}" -v b="${TS0[*]}" -v k="$tck" 'BEGIN{n=split(a,x," ");split(b,y," ");for(i=1;i<=n;i++)s+=x[i]-y[i];print s/k}')
echo "cost per connected kettle: nodes $(awk -v c="$ncpu" -v n="$tc" -v w=$win 'BEGIN{printf "%.2f", (n>0 ? 1000*c/n/(w/60) : 0)}') CPU-ms/min, swarms $(awk -v c="$scpu" -v n="$tc" -v w=$win 'BEGIN{printf "%.2f", (n>0 ? 1000*c/n/(w/60) : 0)}') CPU-ms/min (100,000 kettles at that cost: nodes $(awk -v c="$ncpu" -v n="$tc" -v w=$win 'BEGIN{printf "%.2f", (n>0 ? c/n/w*100000 : 0)}') + swarms $(awk -v c="$scpu" -v n="$tc" -v w=$win 'BEGIN{printf "%.2f", (n>0 ? c/n/w*100000 : 0)}') cores)"
echo "all nodes CPU $(awk -v a="${TN[*]}" -v b="${TN0[*]}" -v w=$win -v k="$tck" 'BEGIN{n=split(a,x," ");split(b,y," ");for(i=1;i<=n;i++)s+=x[i]-y[i];printf "%.1f", 100*s/k/w}')%, all swarms CPU $(awk -v a="${TS[*]}" -v b="${TS0[*]}" -v w=$win -v k="$tck" 'BEGIN{n=split(a,x," ");split(b,y," ");for(i=1;i<=n;i++)s+=x[i]-y[i];printf "%.1f", 100*s/k/w}')% (100% = one core)"

# --- the swarms finish by themselves, then audit ------------------------------------
echo
echo "waiting for the lab to end (--duration ${dur}s) and audit…"
while alive; do
	[ -e "$work/aborted" ] && exit 1
	(($(date +%s) - t_start > DEADLINE)) && { echo "DEADLINE ${DEADLINE}s passed: stopping the lab"; kill "$ctl_pid" 2>/dev/null || true; break; }
	sleep 5
done
set +e
wait "$ctl_pid"
lrc=$?
set -e
echo "lab exit code: $lrc (0 ok, 1 could not run or a worker lost, 3 lost, 4 duplicated, 5 SLO)"
grep -E '^  (mqtt_|requests|readings|simulator|mqtt:|process|worker|    LOST|audit)|^lab: worker|^kettle swarm' "$work/lab.log" || tail -5 "$work/lab.log"
echo
set +e
"$work/mqttfleet" -from "$h0" -to "$h1" -expect "$expect" -json "$work/figures.json" "$work/lab/results.json"
frc=$?
set -e
errs=$(cat "$work"/node*.log | grep -ci '"level":"error"' || true)
echo "node log lines at ERROR: $errs$( ((errs > 0)) && echo "; first: $(grep -hi '"level":"error"' "$work"/node*.log | head -1 | cut -c1-300)")"
echo "run took $(($(date +%s) - t_start))s"
# One record of the run in bench/results.jsonl: bench/mqttfleet's figures
# of the hold, then the nodes' and workers' costs.
[ -s "$work/figures.json" ] || { echo "mqtt-fleet.sh: bench/mqttfleet wrote no figures: nothing to record" >&2; exit 1; }
rec_begin mqtt-fleet.sh "DEVICES=$DEVICES NODES=$NODES WORKERS=$WORKERS RAMP=$RAMP HOLD=$HOLD INTERVAL=$INTERVAL BATCH_WAIT=$BATCH_WAIT ADDR_NET=$ADDR_NET bench/mqtt-fleet.sh"
jq -r '.[] | "figure \(.name)=\(.value):\(.unit)"' "$work/figures.json" | rec_lines
per() { awk -v a="$1" -v b="$2" -v m="${3:-1}" 'BEGIN { printf "%.1f", (b > 0 ? m * a / b : 0) }'; } # per A B [M]: M·A/B, one decimal
rec_fig nodes_rss_per_connection "$(per "$nrss" "$tc")" KiB
rec_fig connections_at_hold_end "$tc" connections
rec_fig nodes_cpu "$(per "$ncpu" "$win" 100)" "% of a core"
rec_fig workers_cpu "$(per "$scpu" "$win" 100)" "% of a core"
rec_fig workers_rss_per_kettle "$(per "$srss" "$DEVICES")" KiB
rec_fig lab_exit_code "$lrc" "exit code"
rec_fig nodes "$NODES" nodes
rec_fig node_cap "$NODE_CAP" connections
rec_fig interval_s "$INTERVAL" s
rec_end
exit $frc
