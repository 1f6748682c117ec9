#!/usr/bin/env bash
# What TLS costs on the links deploy/ now encrypts (issue 54), TLS against
# plain in one run, everything on 127.0.0.1, each pair under the same load:
#
#  1. HTTP uploads: kettle serve (embedded store) with --tls-cert and
#     without, the same kettle swarm (DEVICES kettles, a connection each, a
#     v1 upload and a poll every INTERVAL, DURATION): the server's CPU per
#     request (its /proc CPU over the run / the requests answered; the
#     kettles' handshakes are in it, one per kettle).
#  2. MQTT: MQTT_CONNS kettles held connected by kettle swarm --protocol
#     mqtt (a QoS 1 reading every MQTT_INTERVAL), plain and TLS: the
#     server's RSS per connection ((peak RSS − RSS before the first
#     connect) / connections). Then bench/tlsstorm against the MQTT
#     listener (WORKERS at once, STORM each: dial, TLS, CONNECT with a
#     device token, CONNACK, DISCONNECT): the server's CPU per connection,
#     plain, with a full TLS handshake and with a resumed one (session
#     tickets), as after a restart and after a network blip.
#  3. The PostgreSQL write path: kettle serve on a throwaway PostgreSQL with
#     ssl=on (a throwaway CA, deploy/tls.sh), its DSN sslmode=disable and
#     sslmode=verify-full (as deploy/cluster.sh's nodes), the same swarm of
#     batched uploads (PG_DEVICES kettles, PG_BATCH readings each, every
#     INTERVAL): the CPU of kettle serve and of PostgreSQL per reading
#     acknowledged.
#
#   bench/tls-cost.sh
#   DEVICES=2000 MQTT_CONNS=4000 DURATION=60s bench/tls-cost.sh   # larger
#
# Records one run in bench/results.jsonl; make results renders it in
# docs/results.md. KETTLE_BIN: a prebuilt kettle. Every process it starts
# is stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=10}" "${INTERVAL:=1s}" "${DURATION:=5s}" "${MQTT_CONNS:=10}" "${WORKERS:=2}" "${STORM:=1s}" "${PG_DEVICES:=10}"
DEVICES=${DEVICES:-500} INTERVAL=${INTERVAL:-2s} DURATION=${DURATION:-30s}
MQTT_CONNS=${MQTT_CONNS:-1000} MQTT_INTERVAL=${MQTT_INTERVAL:-10s}
WORKERS=${WORKERS:-16} STORM=${STORM:-5s}
PG_DEVICES=${PG_DEVICES:-200} PG_BATCH=${PG_BATCH:-10}
. bench/lib/pg-cluster.sh # pg_start, pg_cpu, proc_cpu, machine_line, build_kettle, free_port
. deploy/tls.sh           # tls_make_ca, tls_issue, tls_sans
work=$(mktemp -d /tmp/kettle-tlscost-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; pg_stop; rm -rf "$work"' EXIT
# the postgres user reads the database's key and certificate under it
chmod 711 "$work"
rerun="DEVICES=$DEVICES INTERVAL=$INTERVAL DURATION=$DURATION MQTT_CONNS=$MQTT_CONNS MQTT_INTERVAL=$MQTT_INTERVAL WORKERS=$WORKERS STORM=$STORM PG_DEVICES=$PG_DEVICES PG_BATCH=$PG_BATCH bench/tls-cost.sh"
echo "rerun: $rerun"
[ "$(ulimit -n)" -gt $((MQTT_CONNS * 2 + 200)) ] || { echo "open-file limit $(ulimit -n) too low for MQTT_CONNS=$MQTT_CONNS" >&2; exit 1; }
rec_begin tls-cost.sh "$rerun"
machine_line
build_kettle "$work"
bench_build "$work/tlsstorm" ./bench/tlsstorm
tls_make_ca "$work/tls" "kettlefleet bench CA"
tls_issue "$work/tls" serve "$(id -un)" "$(tls_sans 127.0.0.1 localhost)"
tls_issue "$work/tls" pg postgres "$(tls_sans 127.0.0.1 localhost)"
ca=$work/tls/ca.crt

# serve NAME [--tls] [ARGS…]: kettle serve on 127.0.0.1 (HTTP and MQTT);
# sets kpid, base (its URL), mport (its MQTT port), rss0 (KiB, once ready).
serve() {
	local name=$1 scheme=http tls=(); shift
	if [ "${1:-}" = --tls ]; then scheme=https tls=(--tls-cert "$work/tls/serve.crt" --tls-key "$work/tls/serve.key"); shift; fi
	mkdir -p "$work/$name"
	local port; port=$(free_port) mport=$(free_port)
	"$work/kettle" serve --addr "127.0.0.1:$port" --mqtt-addr "127.0.0.1:$mport" --mqtt-max-conns $((MQTT_CONNS + 100)) \
		--data-dir "$work/$name" --access-log-sample 0 --log-level warn "${tls[@]}" "$@" 2>"$work/$name/serve.log" &
	kpid=$!
	base=$scheme://127.0.0.1:$port
	for _ in $(seq 300); do curl -sf --cacert "$ca" "$base/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
	curl -sf --cacert "$ca" "$base/readyz" >/dev/null || { echo "kettle serve ($name) did not start:"; cat "$work/$name/serve.log"; exit 1; }
	rss0=$(awk '/^VmRSS/ {print $2}' "/proc/$kpid/status")
}
unserve() { kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=; }

# swarm NAME ARGS…: kettle swarm against $base (TLS: checked against the CA,
# a full handshake per kettle), its results in $work/NAME/out.
swarm() {
	local name=$1; shift
	local tls=()
	case "$base" in https:*) tls=(--ca "$ca" --tls-resume=false) ;; esac
	"$work/kettle" swarm --target "$base" "${tls[@]}" --secret-file "$work/$name/secret" --operator-token-file "$work/$name/operator-token" --data-dir "$work/$name/swarm" \
		--server-pid "$kpid" --postgres-pid -1 --out "$work/$name/out" --report=false --slo-p99 10s "$@" >"$work/$name/swarm.log" 2>&1 ||
		{ echo "swarm ($name) failed:"; tail -20 "$work/$name/swarm.log"; exit 1; }
	grep -E '^  (measurement|command|mqtt_publish|requests|tls:|audit:)' "$work/$name/swarm.log" | sed "s/^ /  [$name]/" || true
}
total() { jq -r ".totals.$2" "$work/$1/out/results.json"; } # total NAME KEY
div() { awk -v a="$1" -v b="$2" -v k="${3:-1}" 'BEGIN { printf "%.3f", (b > 0 ? a / b * k : 0) }'; }

echo "== 1. HTTP uploads: $DEVICES kettles, a connection each, upload and poll every $INTERVAL, $DURATION; plain, then TLS"
for m in plain tls; do
	serve "http-$m" $([ $m = tls ] && echo --tls)
	c0=$(proc_cpu "$kpid")
	swarm "http-$m" --api v1 --devices "$DEVICES" --interval "$INTERVAL" --duration "$DURATION"
	c1=$(proc_cpu "$kpid")
	reqs=$(total "http-$m" requests)
	us=$(div "$(awk -v a="$c0" -v b="$c1" 'BEGIN { print b - a }')" "$reqs" 1000000)
	echo "RESULT http $m requests=$reqs server_cpu_s=$(awk -v a="$c0" -v b="$c1" 'BEGIN { printf "%.2f", b - a }') server_cpu_us_per_request=$us"
	rec_fig "http uploads $m, server CPU a request" "$us" µs
	eval "http_$m=$us"
	unserve
done
rec_fig "http uploads tls/plain, server CPU a request" "$(div "$http_tls" "$http_plain")" ratio

echo "== 2a. MQTT: $MQTT_CONNS kettles connected, a QoS 1 reading each every $MQTT_INTERVAL, $DURATION; plain, then TLS"
for m in plain tls; do
	serve "mqtt-$m" $([ $m = tls ] && echo --tls)
	swarm "mqtt-$m" --protocol mqtt --mqtt-target "127.0.0.1:$mport" --devices "$MQTT_CONNS" --interval "$MQTT_INTERVAL" --duration "$DURATION"
	peak=$(jq '[.system.samples[] | .procs.server.rss_bytes // empty] | max' "$work/mqtt-$m/out/results.json")
	kib=$(div "$(awk -v p="$peak" -v r="$rss0" 'BEGIN { print p / 1024 - r }')" "$MQTT_CONNS")
	echo "RESULT mqtt $m conns=$MQTT_CONNS rss0_kib=$rss0 peak_rss_kib=$((peak / 1024)) rss_kib_per_conn=$kib"
	rec_fig "mqtt $m, server RSS a connection" "$kib" KiB
	eval "rss_$m=$kib"
	unserve
done
rec_fig "mqtt tls−plain, server RSS a connection" "$(awk -v a="$rss_tls" -v b="$rss_plain" 'BEGIN { printf "%.3f", a - b }')" KiB

echo "== 2b. MQTT connection storm: $WORKERS at once, $STORM each: plain, TLS full handshake, TLS resumed"
serve storm-plain
"$work/tlsstorm" -target "mqtt://127.0.0.1:$mport" -mqtt-secret "$(cat "$work/storm-plain/secret")" -workers "$WORKERS" -duration "$STORM" \
	-pid "$kpid" -label "STORM mqtt plain" | tee "$work/storm.txt"
unserve
serve storm-tls --tls
for r in false true; do
	"$work/tlsstorm" -target "mqtts://127.0.0.1:$mport" -ca "$ca" -mqtt-secret "$(cat "$work/storm-tls/secret")" -resume="$r" -workers "$WORKERS" \
		-duration "$STORM" -pid "$kpid" -label "STORM mqtt tls-$([ $r = true ] && echo resumed || echo full)" | tee -a "$work/storm.txt"
done
unserve
awk '/RESULT/ { l = $0; sub(/ ?RESULT.*/, "", l); sub(/^STORM /, "", l)
	for (i = 1; i <= NF; i++) if ($i ~ /^server_cpu_us_per_conn=/) { split($i, p, "="); print l "\t" p[2] } }' "$work/storm.txt" |
	while IFS=$'\t' read -r label v; do rec_fig "$label, server CPU a connection" "$v" µs; done

echo "== 3. PostgreSQL write path: $PG_DEVICES kettles, $PG_BATCH readings an upload every $INTERVAL, $DURATION; sslmode=disable, then verify-full"
PG_SHARED_BUFFERS=128MB PG_MAX_WAL=1GB PG_EXTRA="-c ssl=on -c ssl_cert_file=$work/tls/pg.crt -c ssl_key_file=$work/tls/pg.key" pg_start
pg_settings
for m in disable verify-full; do
	db=tls_${m//-/_}
	pg_sql postgres "CREATE DATABASE $db" >/dev/null
	dsn="postgres://postgres@127.0.0.1:$PG_PORT/$db?sslmode=$m"
	[ "$m" = verify-full ] && dsn="$dsn&sslrootcert=$ca"
	serve "pg-$m" --db "$dsn"
	# every connection of kettle serve's pool as it says (pg_stat_ssl)
	c0=$(proc_cpu "$kpid") p0=$(pg_cpu)
	swarm "pg-$m" --api v1 --devices "$PG_DEVICES" --batch "$PG_BATCH" --interval "$INTERVAL" --duration "$DURATION"
	c1=$(proc_cpu "$kpid") p1=$(pg_cpu)
	ssl=$(pg_sql postgres "SELECT string_agg(DISTINCT ssl::text, ',') FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) WHERE datname = '$db'")
	unserve
	acked=$(total "pg-$m" acked)
	k=$(div "$(awk -v a="$c0" -v b="$c1" 'BEGIN { print b - a }')" "$acked" 1000000)
	p=$(div "$(awk -v a="$p0" -v b="$p1" 'BEGIN { print b - a }')" "$acked" 1000000)
	echo "RESULT pg sslmode=$m connections_ssl=$ssl readings=$acked kettle_cpu_us_per_reading=$k postgres_cpu_us_per_reading=$p"
	[ "$ssl" = "$([ $m = disable ] && echo false || echo true)" ] || { echo "kettle serve's connections are not as sslmode=$m says (ssl: $ssl)" >&2; exit 1; }
	rec_fig "postgres write path sslmode=$m, kettle serve CPU a reading" "$k" µs
	rec_fig "postgres write path sslmode=$m, PostgreSQL CPU a reading" "$p" µs
	eval "pg_k_${m//-/_}=$k pg_p_${m//-/_}=$p"
done
rec_fig "postgres write path verify-full/disable, kettle serve + PostgreSQL CPU a reading" \
	"$(div "$(awk -v a="$pg_k_verify_full" -v b="$pg_p_verify_full" 'BEGIN { print a + b }')" "$(awk -v a="$pg_k_disable" -v b="$pg_p_disable" 'BEGIN { print a + b }')")" ratio
rec_end
