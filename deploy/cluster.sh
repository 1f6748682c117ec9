#!/usr/bin/env bash
# The high-availability topology on this machine's loopback, from the files
# beside this script (etcd/etcd.env, patroni/patroni.yml, haproxy/haproxy.cfg),
# used unchanged by the tests, the chaos part and the benchmark:
#
#   etcd × 3        @NET@.1-3      :2379 (clients) :2380 (peers)
#   Patroni × 3     @NET@.11-13    :8008 (REST) and PostgreSQL :5432
#   kettle serve×N  @NET@.21-2N    :8080 (HTTP) :1883 (MQTT)
#   HAProxy         @NET@.30       :8080 (HTTP) :1883 (MQTT) :8404 (/metrics, /stats)
#
# usage: deploy/cluster.sh up | down | status | dsn
#        deploy/cluster.sh start|stop|kill MEMBER   (etcd1-3, pg1-3, kettle1-N, haproxy)
#        deploy/cluster.sh pause|resume pgN         (SIGSTOP/SIGCONT of its Patroni, postmaster and backends)
#        deploy/cluster.sh leader | sync            (the primary's, the synchronous standby's member name)
#        deploy/cluster.sh healthy                  (exit 0: a leader and two streaming standbys)
#        deploy/cluster.sh patronictl ARGS…         (patronictl on this cluster)
#        deploy/cluster.sh psql ARGS…               (psql on the primary, as postgres, unaligned)
#
# stop is the graceful way (SIGTERM: Patroni hands over, kettle drains);
# kill is SIGKILL (for pgN: the postmaster and its Patroni together, as when
# the machine dies).
#
# Environment (defaults in brackets):
#   KETTLE_HA_NET        first three octets of the address block [127.0.44]
#   KETTLE_HA_DIR        state: data, logs, pids, rendered configs [/tmp/kettle-ha]
#   KETTLE_HA_NODES      kettle serve nodes behind HAProxy, 0 for none [2]
#   KETTLE_HA_SYNC       Patroni synchronous_mode: true or false [true]
#   KETTLE_HA_VENV       Patroni's virtualenv [REPO/.deps/venv-patroni] (make deps)
#   KETTLE_HA_PGBIN      PostgreSQL binaries [newest /usr/lib/postgresql/*/bin]
#   KETTLE_BIN           the kettle binary [REPO/bin/kettle] (make build)
#   KETTLE_HA_SERVE_ARGS more `kettle serve` flags for every node
#   KETTLE_HA_PASSWORD   password of every database role [generated, kept in DIR]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
NET=${KETTLE_HA_NET:-127.0.44}
DIR=${KETTLE_HA_DIR:-/tmp/kettle-ha}
NODES=${KETTLE_HA_NODES:-2}
SYNC=${KETTLE_HA_SYNC:-true}
# resolved: the postgres user runs it by its real path, outside the checkout
VENV=$(readlink -m "${KETTLE_HA_VENV:-$repo/.deps/venv-patroni}")
KETTLE_BIN=${KETTLE_BIN:-$repo/bin/kettle}
if [ -z "${KETTLE_HA_PGBIN:-}" ]; then
	KETTLE_HA_PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -n | tail -1 || true)
fi
PGBIN=$KETTLE_HA_PGBIN

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

need() {
	command -v etcd >/dev/null || die "etcd not found: make deps (Debian etcd-server)"
	command -v haproxy >/dev/null || die "haproxy not found: make deps (Debian haproxy)"
	[ -x "$VENV/bin/patroni" ] || die "$VENV/bin/patroni not found: make deps (Patroni's virtualenv)"
	[ -x "$PGBIN/postgres" ] || die "PostgreSQL binaries not found in '$PGBIN': make deps (Debian postgresql), or set KETTLE_HA_PGBIN"
	id postgres >/dev/null 2>&1 || die "no postgres OS user: make deps (Debian postgresql creates it)"
	if [ "$NODES" -gt 0 ]; then [ -x "$KETTLE_BIN" ] || die "$KETTLE_BIN not found: make build, or set KETTLE_BIN"; fi
}

# render FILE I: the template with its @TOKENS@ replaced.
render() {
	sed -e "s|@NET@|$NET|g" -e "s|@I@|$2|g" -e "s|@DIR@|$DIR|g" -e "s|@PGBIN@|$PGBIN|g" -e "s|@SYNC@|$SYNC|g" "$1"
}

password() {
	if [ -n "${KETTLE_HA_PASSWORD:-}" ]; then echo "$KETTLE_HA_PASSWORD"; return; fi
	[ -s "$DIR/password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DIR/password")
	cat "$DIR/password"
}

pidof_member() { [ -s "$DIR/$1.pid" ] && cat "$DIR/$1.pid" || true; }
alive() { local p; p=$(pidof_member "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

# spawn NAME USER CMD…: run CMD in the background in its own session as USER,
# output in DIR/NAME.log, pid in DIR/NAME.pid.
spawn() {
	local name=$1 user=$2; shift 2
	# From DIR: the postgres user may not enter the checkout (a 0700 parent,
	# as mktemp -d makes), and initdb under Patroni needs a working directory
	# it can reach.
	pushd "$DIR" >/dev/null
	if [ "$user" = root ]; then
		setsid "$@" >>"$DIR/$name.log" 2>&1 </dev/null &
	else
		setsid setpriv --reuid="$user" --regid="$user" --init-groups "$@" >>"$DIR/$name.log" 2>&1 </dev/null &
	fi
	echo $! >"$DIR/$name.pid"
	popd >/dev/null
}

# wait_for WHAT SECONDS CMD…: until CMD succeeds.
wait_for() {
	local what=$1 limit=$2; shift 2
	local end=$((SECONDS + limit))
	until "$@" >/dev/null 2>&1; do
		[ $SECONDS -lt $end ] || { log "$what: not within ${limit}s"; return 1; }
		sleep 0.2
	done
}

http_ok() { curl -fsS -m 2 -o /dev/null "$1"; }

start_etcd() {
	local i=$1
	alive "etcd$i" && return 0
	render "$here/etcd/etcd.env" "$i" | grep -v '^#' | grep . >"$DIR/etcd$i.env"
	# A member that was there before rejoins with its data, not as new.
	[ -d "$DIR/etcd$i" ] && sed -i 's/^ETCD_INITIAL_CLUSTER_STATE=new/ETCD_INITIAL_CLUSTER_STATE=existing/' "$DIR/etcd$i.env"
	spawn "etcd$i" root env $(cat "$DIR/etcd$i.env") etcd
}

start_pg() {
	local i=$1 pw
	alive "pg$i" && return 0
	pw=$(password)
	mkdir -p "$DIR/pg$i"
	chown postgres: "$DIR/pg$i"
	chmod 700 "$DIR/pg$i"
	render "$here/patroni/patroni.yml" "$i" >"$DIR/pg$i.yml"
	chmod 644 "$DIR/pg$i.yml"
	spawn "pg$i" postgres env PATRONI_SUPERUSER_PASSWORD="$pw" PATRONI_REPLICATION_PASSWORD="$pw" PATRONI_REWIND_PASSWORD="$pw" \
		"$VENV/bin/patroni" "$DIR/pg$i.yml"
}

start_kettle() {
	local i=$1
	alive "kettle$i" && return 0
	mkdir -p "$DIR/kettle$i"
	# One operator token and device secret for every node: kettles and
	# operators do not care which node answers.
	[ -s "$DIR/operator-token" ] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/operator-token")
	[ -s "$DIR/secret" ] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/secret")
	cp "$DIR/operator-token" "$DIR/secret" "$DIR/kettle$i/"
	# The DSN holds the password: in the environment (KETTLE_DB), not argv.
	# shellcheck disable=SC2086
	spawn "kettle$i" root env KETTLE_DB="$(dsn)" "$KETTLE_BIN" serve --addr "$NET.2$i:8080" --mqtt-addr "$NET.2$i:1883" \
		--data-dir "$DIR/kettle$i" --drain-delay 2s --log-format text ${KETTLE_HA_SERVE_ARGS:-}
}

start_haproxy() {
	alive haproxy && return 0
	local n lines=""
	for n in $(seq 1 "$NODES"); do lines="$lines $n"; done
	# Each template line holding @N@ is written once per node.
	awk -v nodes="$lines" '
		/@N@/ { split(nodes, ns, " "); for (k in ns) { l = $0; gsub(/@N@/, ns[k], l); print l }; next }
		{ print }' "$here/haproxy/haproxy.cfg" | render /dev/stdin 0 >"$DIR/haproxy.cfg"
	haproxy -c -q -f "$DIR/haproxy.cfg" || die "haproxy -c rejected $DIR/haproxy.cfg"
	spawn haproxy root haproxy -W -db -f "$DIR/haproxy.cfg"
}

# dsn: the multi-host DSN kettle serve uses (the primary among three).
dsn() {
	echo "postgres://kettle:$(password)@$NET.11:5432,$NET.12:5432,$NET.13:5432/kettle?target_session_attrs=read-write&connect_timeout=2&sslmode=disable"
}

patronictl() { "$VENV/bin/patronictl" -c "$DIR/pg1.yml" "$@"; }

# role ROLE: the members in ROLE (leader, sync_standby, replica), from any Patroni's REST API.
role() {
	local i
	for i in 1 2 3; do
		curl -fsS -m 1 "http://$NET.1$i:8008/cluster" 2>/dev/null |
			ROLE=$1 python3 -c 'import json,os,sys; n=[m["name"] for m in json.load(sys.stdin)["members"] if m["role"]==os.environ["ROLE"]]; print(" ".join(n)); sys.exit(0 if n else 1)' 2>/dev/null && return 0
	done
	return 1
}
leader() { role leader; }

# healthy: a leader and two streaming standbys, one of them synchronous (with KETTLE_HA_SYNC=true).
healthy() {
	local i
	for i in 1 2 3; do
		curl -fsS -m 1 "http://$NET.1$i:8008/cluster" 2>/dev/null | SYNC=$SYNC python3 -c '
import json, os, sys
ms = json.load(sys.stdin)["members"]
lead = [m for m in ms if m["role"] == "leader" and m["state"] == "running"]
sb = [m for m in ms if m["role"] in ("replica", "sync_standby", "quorum_standby") and m["state"] == "streaming"]
sync = [m for m in ms if m["role"] == "sync_standby"]
ok = len(lead) == 1 and len(sb) == 2 and (os.environ["SYNC"] != "true" or len(sync) == 1)
sys.exit(0 if ok else 1)' && return 0
	done
	return 1
}

psql_leader() {
	local l
	l=$(leader) || return 1
	setpriv --reuid=postgres --regid=postgres --init-groups "$PGBIN/psql" -h "$DIR/$l" -p 5432 -U postgres -d postgres -qAt -v ON_ERROR_STOP=1 "$@"
}

create_db() {
	local pw
	pw=$(password)
	psql_leader -c "DO \$\$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'kettle') THEN CREATE ROLE kettle LOGIN PASSWORD '$pw'; END IF; END \$\$;" \
		-c "GRANT pg_monitor TO kettle;" >/dev/null
	if [ "$(psql_leader -c "SELECT 1 FROM pg_database WHERE datname = 'kettle'")" != 1 ]; then
		psql_leader -c "CREATE DATABASE kettle OWNER kettle" >/dev/null
	fi
	# Every member has replayed it: a client of the multi-host DSN may try a
	# standby first, and "database does not exist" ends its search.
	local i
	for i in 1 2 3; do wait_for "database kettle on pg$i" 60 has_db "$i" || return 1; done
}

has_db() {
	[ "$(setpriv --reuid=postgres --regid=postgres --init-groups "$PGBIN/psql" -h "$DIR/pg$1" -p 5432 -U postgres -d postgres -qAt \
		-c "SELECT 1 FROM pg_database WHERE datname = 'kettle'" 2>/dev/null)" = 1 ]
}

up() {
	need
	mkdir -p "$DIR"
	chmod 755 "$DIR"
	password >/dev/null
	local i
	for i in 1 2 3; do start_etcd "$i"; done
	for i in 1 2 3; do wait_for "etcd$i" 30 http_ok "http://$NET.$i:2379/health" || { down; die "etcd did not start; see $DIR/etcd*.log"; }; done
	for i in 1 2 3; do start_pg "$i"; done
	wait_for "a Patroni leader and two streaming standbys" 120 healthy || die "the Patroni cluster did not come up; see $DIR/pg*.log (deploy/cluster.sh down to clean up)"
	create_db
	for i in $(seq 1 "$NODES"); do start_kettle "$i"; done
	for i in $(seq 1 "$NODES"); do wait_for "kettle$i" 60 http_ok "http://$NET.2$i:8080/readyz" || die "kettle$i not ready; see $DIR/kettle$i.log"; done
	if [ "$NODES" -gt 0 ]; then
		start_haproxy
		wait_for haproxy 20 http_ok "http://$NET.30:8080/readyz" || die "haproxy not routing; see $DIR/haproxy.log"
	fi
	status
}

# stop_member NAME SIGNAL SECONDS: signal it, wait for it to exit, then SIGKILL.
stop_member() {
	local name=$1 sig=$2 limit=$3 p
	p=$(pidof_member "$name")
	[ -n "$p" ] || return 0
	kill -"$sig" "$p" 2>/dev/null || true
	local end=$((SECONDS + limit))
	while kill -0 "$p" 2>/dev/null; do
		if [ $SECONDS -ge $end ]; then kill -KILL "$p" 2>/dev/null || true; sleep 0.2; fi
		sleep 0.1
	done
	rm -f "$DIR/$name.pid"
}

# postmaster I: the pid of member I's postmaster, if it runs.
postmaster() {
	local f="$DIR/pg$1/data/postmaster.pid"
	[ -s "$f" ] && head -1 "$f" || true
}

kill_pg() {
	local i=$1 pm pa
	pm=$(postmaster "$i")
	pa=$(pidof_member "pg$i")
	[ -n "$pm" ] && kill -KILL "$pm" 2>/dev/null || true
	[ -n "$pa" ] && kill -KILL "$pa" 2>/dev/null || true
	# the backends the postmaster leaves die on their own within a moment (postmaster death)
	rm -f "$DIR/pg$i.pid"
}

# pg_procs I: member I's Patroni, its postmaster and the postmaster's children.
pg_procs() {
	local pa pm
	pa=$(pidof_member "pg$1")
	pm=$(postmaster "$1")
	echo $pa $pm
	[ -n "$pm" ] && pgrep -P "$pm" || true
}

# pause_pg I: the member's machine hangs (Jepsen's pause): every process
# stopped at once, its sockets open, so peers and clients see a host that
# neither answers nor refuses. resume_pg continues them.
pause_pg() { kill -STOP $(pg_procs "$1") 2>/dev/null || true; }
resume_pg() { kill -CONT $(pg_procs "$1") 2>/dev/null || true; }

down() {
	local i p
	stop_member haproxy TERM 5
	for i in 1 2 3 4 5 6 7 8 9; do stop_member "kettle$i" TERM 40; done
	for i in 1 2 3; do resume_pg "$i"; done
	for i in 1 2 3; do stop_member "pg$i" TERM 30; done
	for i in 1 2 3; do
		p=$(postmaster "$i")
		[ -n "$p" ] && kill -0 "$p" 2>/dev/null && kill -QUIT "$p" 2>/dev/null || true
	done
	for i in 1 2 3; do stop_member "etcd$i" TERM 10; done
	if [ "${KETTLE_HA_KEEP:-}" = "" ]; then
		case "$DIR" in /tmp/*) rm -rf "$DIR" ;; *) log "left $DIR (not under /tmp)" ;; esac
	fi
}

status() {
	local i
	echo "members (patronictl list):"
	patronictl list 2>/dev/null || echo "  no Patroni answers"
	for i in $(seq 1 "$NODES"); do
		printf 'kettle%s %s:8080 /readyz %s\n' "$i" "$NET.2$i" "$(curl -s -m 2 -o /dev/null -w '%{http_code}' "http://$NET.2$i:8080/readyz" || true)"
	done
	if [ "$NODES" -gt 0 ]; then
		printf 'haproxy %s:8080 /readyz %s\n' "$NET.30" "$(curl -s -m 2 -o /dev/null -w '%{http_code}' "http://$NET.30:8080/readyz" || true)"
	fi
	echo "dsn: $(dsn | sed 's/:[^:@]*@/:***@/')"
}

member() {
	local op=$1 m=${2:-}
	case "$op:$m" in
	start:etcd[1-3]) start_etcd "${m#etcd}" ;;
	start:pg[1-3]) start_pg "${m#pg}" ;;
	start:kettle[1-9]) start_kettle "${m#kettle}"; wait_for "$m" 60 http_ok "http://$NET.2${m#kettle}:8080/readyz" ;;
	start:haproxy) start_haproxy ;;
	stop:pg[1-3]) stop_member "$m" TERM 30 ;;
	stop:kettle[1-9]) stop_member "$m" TERM 40 ;;
	stop:*) stop_member "$m" TERM 10 ;;
	kill:pg[1-3]) kill_pg "${m#pg}" ;;
	pause:pg[1-3]) pause_pg "${m#pg}" ;;
	resume:pg[1-3]) resume_pg "${m#pg}" ;;
	kill:*) stop_member "$m" KILL 5 ;;
	*) die "unknown member '$m' (etcd1-3, pg1-3, kettle1-9, haproxy)" ;;
	esac
}

case "${1:-}" in
up) up ;;
down) down ;;
status) status ;;
dsn) dsn ;;
leader) leader ;;
sync) role sync_standby ;;
healthy) healthy ;;
patronictl) shift; patronictl "$@" ;;
psql) shift; psql_leader "$@" ;;
start | stop | kill | pause | resume) member "$1" "${2:-}" ;;
*) sed -n '2,/^set -e/p' "$0" | sed -e '/^set -e/d' -e 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
