#!/usr/bin/env bash
# kettle serve over TLS (--tls-cert/--tls-key, a self-signed ECDSA P-256
# certificate made with openssl) against plain TCP, in one run, everything on
# 127.0.0.1, the embedded store:
#
#  1. reconnection storm (bench/tlsstorm, WORKERS at once, STORM each): new
#     connections/s and the server's CPU per connection — plain, then a full
#     TLS handshake and a resumed one for each client key exchange in CURVES
#     (kettle firmware offers X25519 or P-256; Go clients offer the hybrid
#     X25519MLKEM768 first). After a restart every kettle reconnects once
#     within its interval: 20,000 kettles at 30 s are ~670 connections/s.
#  2. a fleet on kept connections (kettle swarm, DEVICES kettles, one
#     connection each, a reading and a poll every INTERVAL — PROTOCOL=mqtt:
#     a QoS 1 publish, commands pushed — DURATION, all
#     connecting at once with phases spread over one interval: every TLS
#     kettle a full handshake, as after a restart), plain then TLS, ROUNDS
#     times: in the steady state (from one interval + 5 s on) the server's
#     CPU per request (the swarm's per-second samples of the server process)
#     and the worst 5-s window p99 of each endpoint; the worst window p99
#     while the kettles connect (the wave); the server's peak RSS; the
#     audit. TLS/plain ratios and their median.
#
#   bench/tls.sh
#   PROTOCOL=mqtt NO_STORM=1 bench/tls.sh   # the fleet over MQTT (QoS 1, PUBACK after commit) instead
#   DEVICES=4000 INTERVAL=10s DURATION=40s ROUNDS=1 CURVES="X25519" STORM=4s bench/tls.sh   # quicker
#
# KETTLE_BIN: a prebuilt kettle. Traffic stays on 127.0.0.1 and every phase
# stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${INTERVAL:=1s}" "${DURATION:=7s}" "${ROUNDS:=1}" "${CURVES:=X25519}" "${WORKERS:=2}" "${STORM:=1s}"
DEVICES=${DEVICES:-10000} INTERVAL=${INTERVAL:-30s} DURATION=${DURATION:-90s} ROUNDS=${ROUNDS:-3}
CURVES=${CURVES:-X25519 CurveP256 X25519MLKEM768} WORKERS=${WORKERS:-64} STORM=${STORM:-8s}
PROTOCOL=${PROTOCOL:-http} # the fleet's: http (uploads and polls) or mqtt (QoS 1 publishes, commands pushed)
case $PROTOCOL in http | mqtt) ;; *) echo "PROTOCOL must be http or mqtt, got $PROTOCOL" >&2; exit 2 ;; esac
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port, median
work=$(mktemp -d /tmp/kettle-tls-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"' EXIT
rerun="PROTOCOL=$PROTOCOL DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION ROUNDS=$ROUNDS CURVES=\"$CURVES\" WORKERS=$WORKERS STORM=$STORM ${NO_STORM:+NO_STORM=1 }bench/tls.sh"
echo "rerun: $rerun"
rec_begin tls.sh "$rerun"
machine_line
build_kettle "$work"
bench_build "$work/tlsstorm" ./bench/tlsstorm
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 -subj /CN=localhost \
	-addext "subjectAltName=IP:127.0.0.1,DNS:localhost" -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null

# start_serve NAME [--tls]: kettle serve on a fresh store (and an MQTT
# listener, for PROTOCOL=mqtt); sets port, mport, kpid, base.
start_serve() {
	local dir="$work/$1" scheme=http tls=() mqtt=()
	mkdir -p "$dir"
	if [ "${2:-}" = --tls ]; then scheme=https tls=(--tls-cert "$work/cert.pem" --tls-key "$work/key.pem"); fi
	port=$(free_port) mport=$(free_port)
	# every kettle its MQTT connection (by default MQTT gets half the fd budget)
	[ "$PROTOCOL" = mqtt ] && mqtt=(--mqtt-addr 127.0.0.1:$mport --mqtt-max-conns $((DEVICES + 100)))
	"$work/kettle" serve --addr 127.0.0.1:$port --db "sqlite:$dir/kettle.db" --data-dir "$dir" --log-level warn "${tls[@]}" "${mqtt[@]}" 2>"$dir/serve.log" &
	kpid=$!
	base=$scheme://127.0.0.1:$port
	for _ in $(seq 300); do curl -sf --cacert "$work/cert.pem" "$base/readyz" >/dev/null 2>&1 && return; sleep 0.1; done
	echo "kettle serve did not start:"; cat "$dir/serve.log"; exit 1
}
stop_serve() { kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=; }

if [ -z "${NO_STORM:-}" ]; then
echo "== reconnection storm: new connection, GET /healthz, close; $WORKERS at once, $STORM each"
start_serve storm-plain
"$work/tlsstorm" -target "$base" -workers "$WORKERS" -duration "$STORM" -pid "$kpid" -label "STORM plain" | tee -a "$work/storm.txt"
stop_serve
start_serve storm-tls --tls
for c in $CURVES; do
	"$work/tlsstorm" -target "$base" -ca "$work/cert.pem" -curves "$c" -workers "$WORKERS" -duration "$STORM" -pid "$kpid" -label "STORM tls-full curve=$c" | tee -a "$work/storm.txt"
	"$work/tlsstorm" -target "$base" -ca "$work/cert.pem" -curves "$c" -resume -workers "$WORKERS" -duration "$STORM" -pid "$kpid" -label "STORM tls-resumed curve=$c" | tee -a "$work/storm.txt"
done
stop_serve
fi

# fleet NAME ROUND [--tls]: one swarm run; prints a FLEET line from its results.json.
fleet() {
	local args=()
	start_serve "fleet-$1-$2" ${3:-}
	# a full handshake per kettle, as after a restart of kettle serve (its
	# session-ticket keys are new: tickets from before are refused)
	[ "${3:-}" = --tls ] && args=(--ca "$work/cert.pem" --tls-resume=false)
	[ "$PROTOCOL" = mqtt ] && args+=(--protocol mqtt --mqtt-target 127.0.0.1:$mport)
	"$work/kettle" swarm --target "$base" "${args[@]}" --data-dir "$work/fleet-$1-$2" --devices "$DEVICES" --interval "$INTERVAL" \
		--duration "$DURATION" --server-pid "$kpid" --postgres-pid -1 --out "$work/fleet-$1-$2/out" --report=false --slo-p99 10s \
		>"$work/fleet-$1-$2/swarm.log" 2>&1 || { echo "swarm ($1, round $2) failed:"; tail -20 "$work/fleet-$1-$2/swarm.log"; }
	grep -E '^  (measurement|command|mqtt_publish|mqtt_connect|requests|tls:|audit:)' "$work/fleet-$1-$2/swarm.log" | sed "s/^ /  [$1 $2]/"
	# Steady state: from one interval + 5 s after the start (every kettle has
	# connected; the connection wave is the part before).
	local dir=$work/fleet-$1-$2 steady up
	steady=$(awk -v v="$INTERVAL" 'BEGIN { n = v + 0; printf "%d", n * (v ~ /m$/ ? 60 : 1) + 5 }')
	up=measurement
	grep -q 'mqtt_publish [0-9.]*/s' "$dir/swarm.log" && up=mqtt_publish
	w() { rec windows "$dir/swarm.log" "$1" "$2" "$3" | cut -d' ' -f1; } # w ENDPOINT FROM TO: the worst window's p99
	jq -r --arg name "$1" --arg rnd "$2" --argjson steady "$steady" '
		def ts: capture("^(?<s>[^.Z+]+)(?<f>\\.[0-9]+)?") | (.s + "Z" | fromdateiso8601) + ((.f // "0") | tonumber);
		(.start | ts) as $t0 | ([.seconds[].t] | max) as $last
		| ([.seconds[] | select(.t > $steady) | [.endpoints[].requests] | add] | add // 0) as $reqs
		| [.system.samples[] | select(.procs.server) | {t: ((.time | ts) - $t0), p: .procs.server}] as $srv
		| (([$srv[] | select(.t > $steady and .t <= $last + 1) | .p.cpu_pct] | add // 0) / 100 * .system.interval_s) as $cpu
		| "FLEET \($name) round=\($rnd) requests=\(.totals.requests) errors=\(.totals.errors) server_rss_mib=\([$srv[].p.rss_bytes] | max / 1048576 | round)"
		+ " steady_requests=\($reqs) steady_server_us_per_request=\($cpu / ([$reqs, 1] | max) * 1e7 | round / 10)"' "$dir/out/results.json" |
		tr -d '\n'
	echo " steady_p99_upload_ms=$(w "$up" $((steady + 1)) -1) steady_p99_command_ms=$(w command $((steady + 1)) -1)" \
		"wave_p99_upload_ms=$(w "$up" 0 "$steady") wave_p99_command_ms=$(w command 0 "$steady")"
	stop_serve
}
echo "== fleet ($PROTOCOL): $DEVICES kettles, one connection each, interval $INTERVAL, $DURATION; plain then TLS, $ROUNDS rounds"
for r in $(seq "$ROUNDS"); do
	fleet plain "$r" | tee -a "$work/fleet.txt"
	fleet tls "$r" --tls | tee -a "$work/fleet.txt"
done
for f in steady_server_us_per_request server_rss_mib steady_p99_upload_ms wave_p99_upload_ms; do
	ratios=$(awk -v f="$f" '$1 == "FLEET" { delete kv; for (i = 3; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] } x[kv["round"], $2] = kv[f]; n = kv["round"] > n ? kv["round"] : n }
		END { for (i = 1; i <= n; i++) if (x[i, "plain"] > 0) printf "%.3f\n", x[i, "tls"] / x[i, "plain"] }' "$work/fleet.txt")
	echo "RATIO tls/plain $f: median $(echo "$ratios" | median) of $ROUNDS rounds ($(echo $ratios))"
	rec_fig "fleet tls/plain $f, median of rounds" "$(echo "$ratios" | median)" ratio
done
if [ -s "$work/storm.txt" ]; then
	# the server's CPU a new connection, per storm
	awk '/RESULT/ { l = $0; sub(/ ?RESULT.*/, "", l); sub(/^STORM /, "", l)
		for (i = 1; i <= NF; i++) if ($i ~ /^server_cpu_us_per_conn=/) { split($i, p, "="); print l "\t" p[2] } }' "$work/storm.txt" |
		while IFS=$'\t' read -r label v; do rec_fig "storm $label, server CPU a connection" "$v" µs/conn; done
fi
rec_end
