#!/usr/bin/env bash
# Issue 7 benchmark: QoS 1 measurements/s acknowledged by kettle serve's
# embedded MQTT listener (PUBACK after the commit) into a throwaway
# PostgreSQL, against the ceiling of a bare Mosquitto (no storage, no auth,
# persistence off) driven by the same publisher (bench/mqttpub) in the same
# session. Publisher, server and database share this machine.
#
# Two payloads, reported separately: one reading per message, and BATCH
# readings per message (a JSON array; the v1 payload allows up to 1000).
#
#   bench/mqtt.sh
#   CONNS=4000 INFLIGHT=2 DURATION=30s BATCH=50 SERVE_ARGS="--writers 3" bench/mqtt.sh
#   KETTLE_BIN=/tmp/kettle bench/mqtt.sh    # a prebuilt kettle
#
# Output: one line per run (label: msgs/s, readings/s, PUBACK p50/p99, CPU of
# the broker, of PostgreSQL, of the publisher, machine busy), then the ratios
# kettle/mosquitto.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/record.sh # free_port, bench_build, rec_*
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${CONNS:=10}" "${DURATION:=2s}" "${WARMUP:=1s}" "${BATCH:=5}"
CONNS=${CONNS:-2000}       # publisher connections (one device each)
INFLIGHT=${INFLIGHT:-4}    # QoS 1 messages awaiting PUBACK per connection
BATCH=${BATCH:-50}         # readings per message in the batched runs
DURATION=${DURATION:-20s}
WARMUP=${WARMUP:-5s}
MOSQUITTO=${MOSQUITTO:-/usr/sbin/mosquitto}
PORT_H=$(free_port)
PORT_K=$(free_port)
PORT_M=$(free_port)
[ -x "$MOSQUITTO" ] || { echo "mosquitto missing: apt-get install -y mosquitto"; exit 1; }
. bench/lib/pg-cluster.sh
work=$(mktemp -d /tmp/kettle-mqttbench-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pg_stop; rm -rf "$work"; }
trap cleanup EXIT
rerun="${KETTLE_BIN:+KETTLE_BIN=$KETTLE_BIN }CONNS=$CONNS INFLIGHT=$INFLIGHT BATCH=$BATCH DURATION=$DURATION WARMUP=$WARMUP SERVE_ARGS=\"${SERVE_ARGS:-}\" bench/mqtt.sh"
echo "rerun: $rerun"
rec_begin mqtt.sh "$rerun"
machine_line "(others' load counts against both sides alike)"
build_kettle "$work"
bench_build "$work/mqttpub" ./bench/mqttpub
pg_start
pg_settings
PG_PID=$(head -1 "$PG_DIR/data/postmaster.pid")

# --- kettle serve on PostgreSQL, MQTT on -------------------------------------
"$work/kettle" serve --db "$PG_DSN" --data-dir "$work/data" --addr "127.0.0.1:$PORT_H" \
	--mqtt-addr "127.0.0.1:$PORT_K" --mqtt-max-conns $((CONNS + 100)) --max-conns 1000 \
	--access-log-sample 0 --log-level warn ${SERVE_ARGS:-} >"$work/serve.log" 2>&1 &
KPID=$!
pids+=("$KPID")
for _ in $(seq 100); do curl -fsS "http://127.0.0.1:$PORT_H/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
curl -fsS "http://127.0.0.1:$PORT_H/readyz" >/dev/null || { cat "$work/serve.log"; exit 1; }
SECRET=$(cat "$work/data/secret")
echo "kettle serve pid $KPID: --db postgres (unix socket) --mqtt-addr 127.0.0.1:$PORT_K ${SERVE_ARGS:-}"

pub() { # LABEL PORT PID BATCH [extra args]
	local label=$1 port=$2 pid=$3 batch=$4
	shift 4
	"$work/mqttpub" -label "$label" -addr "127.0.0.1:$port" -conns "$CONNS" -inflight "$INFLIGHT" \
		-batch "$batch" -duration "$DURATION" -warmup "$WARMUP" -pid "$pid" "$@" | tee -a "$work/lines"
}
pub "kettle+postgres, 1 reading/msg" "$PORT_K" "$KPID" 1 -secret "$SECRET" -tree "postgres=$PG_PID"
pub "kettle+postgres, $BATCH readings/msg" "$PORT_K" "$KPID" "$BATCH" -secret "$SECRET" -tree "postgres=$PG_PID"
STORED=$(pg_sql postgres "SELECT count(*) FROM measurements" 2>/dev/null || echo "?")
echo "rows in measurements after both kettle runs: $STORED"
grep -i '"level":"error"' "$work/serve.log" | head -3 || true
kill "$KPID"
wait "$KPID" 2>/dev/null || true

# --- bare Mosquitto: the ceiling -----------------------------------------------
cat >"$work/mosquitto.conf" <<EOF
listener $PORT_M 127.0.0.1
allow_anonymous true
persistence false
max_connections -1
log_dest none
EOF
"$MOSQUITTO" -c "$work/mosquitto.conf" &
MPID=$!
pids+=("$MPID")
sleep 1
echo "mosquitto $("$MOSQUITTO" -h 2>/dev/null | head -1 | awk '{print $3}') pid $MPID on 127.0.0.1:$PORT_M (QoS 1, no subscribers, persistence off)"
pub "mosquitto, 1 reading/msg" "$PORT_M" "$MPID" 1
pub "mosquitto, $BATCH readings/msg" "$PORT_M" "$MPID" "$BATCH"

# --- ratios --------------------------------------------------------------------
awk -v batch="$BATCH" '
	{ r[NR] = $0; sub(/ msgs\/s.*/, "", r[NR]); sub(/.*: /, "", r[NR]) }
	END {
		if (NR < 4 || r[3] == 0 || r[4] == 0) exit
		printf "ratio kettle/mosquitto: 1 reading/msg %.2f (%d vs %d msgs/s); %s readings/msg %.2f (%d vs %d msgs/s)\n",
			r[1] / r[3], r[1], r[3], batch, r[2] / r[4], r[2], r[4]
	}' "$work/lines"
awk '{ l = $0; sub(/: .*/, "", l); v = $0; sub(/ msgs\/s.*/, "", v); sub(/.*: /, "", v); print l "\t" v }' "$work/lines" |
	while IFS=$'\t' read -r label v; do rec_fig "$label" "$v" msgs/s; done
r=($(awk '{ v = $0; sub(/ msgs\/s.*/, "", v); sub(/.*: /, "", v); print v }' "$work/lines"))
if [ ${#r[@]} -ge 4 ]; then
	rec_ceiling "mosquitto, 1 reading/msg" "${r[2]}" msgs/s
	rec_ratio "$(awk -v a="${r[0]}" -v b="${r[2]}" 'BEGIN { if (b > 0) printf "%.3f", a / b }')"
fi
rec_end
