#!/usr/bin/env bash
# The high-availability topology, from the files beside this script
# (etcd/etcd.env, patroni/patroni.yml, haproxy/haproxy.cfg, and with --log
# kafka/broker.properties through kafka/kafka.sh), used unchanged by the
# tests, the chaos part and the benchmark:
#
#   etcd × 3        @NET@.1-3      :2379 (clients) :2380 (peers)
#   Patroni × 3     @NET@.11-13    :8008 (REST) and PostgreSQL :5432
#   kettle serve×N  @NET@.21-2N    :8080 (HTTP) :1883 (MQTT)
#   HAProxy         @NET@.30       :8080 (HTTP) :1883 (MQTT) :8443 (HTTPS) :8883 (MQTT over TLS) :8404 (/metrics, /stats)
#   Kafka × 3       @NET@.41-43    :9092 (brokers) :9093 (controllers) :9094 (fronts, with Toxiproxy)   --log only
#   writer          @NET@.45       :8080 (kettle serve --role writer)                                 --log only
#   swarm workers   @NET@.101-1KK  :7070 (kettle swarm worker)                                        `workers K`
#   this host       @NET@.254      (netns mode: the bridge's address; tests and the lab's controller)
#
# Two modes (KETTLE_HA_MODE):
#   loopback  every member a process on this machine's loopback (127.0.44.x), the default:
#             quick to start, but no network between the members.
#   netns     every member a machine of its own: a network namespace PREFIX-NAME whose one
#             interface (eth0, a veth on the bridge PREFIX-br) holds its address in
#             198.18.0.0/24 (198.18.0.0/15 is for benchmarks, no real network uses it), its
#             loopback up, no route out of the bridge; its data on a filesystem of its own,
#             of a fixed size (KETTLE_HA_FS: tmpfs, or ext4 on a loop-mounted image). This
#             host holds @NET@.254 on the bridge, so tests and the lab reach every member.
#             With KETTLE_HA_TOXI=1 (the default here) the links balancer→node,
#             node→database, database→database and front→Kafka go through a Toxiproxy in
#             the client's machine (see toxic below).
#
# usage: deploy/cluster.sh up [--log] | down | status | dsn
#        deploy/cluster.sh ca | tls-args            (the topology CA's file; curl's TLS options for its members)
#        deploy/cluster.sh renew-cert MEMBER        (a new key and certificate for MEMBER, taken up without a restart)
#        deploy/cluster.sh start|stop|kill MEMBER   (etcd1-3, pg1-3, kettle1-N, haproxy, kafka1-3, writer, workerK)
#        deploy/cluster.sh pause|resume MEMBER      (SIGSTOP/SIGCONT of all its processes; pgN: Patroni, postmaster and backends)
#        deploy/cluster.sh leader | sync            (the primary's, the synchronous standby's member name)
#        deploy/cluster.sh healthy                  (exit 0: a leader and two streaming standbys)
#        deploy/cluster.sh patronictl ARGS…         (patronictl on this cluster)
#        deploy/cluster.sh psql ARGS…               (psql on the primary, as postgres, unaligned)
#        deploy/cluster.sh workers K                (K swarm workers, each a machine, TLS from the CA; prints the --workers list)
#        deploy/cluster.sh worker-token             (their --token, for the controller's --worker-token)
#        deploy/cluster.sh machines                 (MEMBER ADDRESS, one line each, of what runs now)
#
# stop is the graceful way (SIGTERM: Patroni hands over, kettle drains);
# kill is SIGKILL (for pgN: the postmaster and its Patroni together, as when
# the machine dies; in netns mode every process of the machine but its
# Toxiproxy, which stands for the network).
#
# The faults (the nemesis's interface, chaos/). Each verb is idempotent, does
# nothing more when repeated, and has its inverse; each exits 0 once the fault
# is in force (or healed), non-zero with a message on stderr when it is not.
# MEMBER is a name above; `host` is this machine (the tests, the lab's
# controller). A GROUP is MEMBER,MEMBER,… .
#   partition GROUP GROUP…      drop every packet between members of different groups,
#                               both ways (nftables on the bridge; netns mode); a member
#                               in no group still reaches every side
#   unpartition GROUP GROUP…    lift exactly that partition
#   partition-oneway FROM TO    drop packets from group FROM to group TO only
#   unpartition-oneway FROM TO
#   isolate MEMBER              cut MEMBER from every other member (not from host)
#   unisolate MEMBER
#   heal                        every network fault: partitions, isolations, slow links, toxics
#   slow MEMBER RATE            tc tbf on MEMBER's link, both directions (RATE as tc: 1mbit, 500kbit)
#   unslow MEMBER
#   pause MEMBER | resume MEMBER  SIGSTOP / SIGCONT of all the member's processes
#                               (pgN: Patroni, the postmaster and its children)
#   kill MEMBER | start MEMBER  SIGKILL / start again (data kept)
#   fill-disk MEMBER            fill MEMBER's data filesystem to ENOSPC (a file, PREFIX-fill)
#   free-disk MEMBER            remove that file
#   clock MEMBER ±OFFSET        restart MEMBER under faketime (OFFSET as faketime -f: +1h,
#                               -1h); `clock MEMBER 0` restarts it on the true clock. Exits 3,
#                               the member back on the true clock, when its answers' Date
#                               shows the offset was not taken (kettle is a Go program: see
#                               deploy/README.md)
#   toxic LINK latency MS JITTER   Toxiproxy latency toxic, MS ± JITTER each way
#   toxic LINK reset [AFTER_MS]    every connection reset by peer (after AFTER_MS of data)
#   toxic LINK bandwidth KBPS      Toxiproxy bandwidth, each way
#   untoxic [LINK]              remove the toxics (all links without LINK)
#       LINK is lb (balancer→node), db (node→database), repl (database→database) or
#       kafka (front→Kafka), optionally narrowed to one upstream, -MEMBER (db-pg1), and/or to
#       one client machine, @MEMBER (db@kettle2, repl-pg1@pg3).
#   faults                      what is in force now (partitions, slow links, toxics,
#                               paused members, full disks, clocks), one line each
#
# TLS (KETTLE_HA_TLS=1, the default). up makes a CA for this topology alone
# (DIR/tls/ca.key, 0600, never leaves DIR) and one key and certificate per
# member, its addresses as IP SANs (also those of the proxies in front of it):
#   etcd       clients (Patroni) and peers over TLS, both sides presenting a certificate
#   Patroni    REST API over TLS (verify_client optional: a certificate for switchover,
#              restart and the like, none to read /cluster or /metrics)
#   PostgreSQL hostssl only (scram-sha-256 over TLS); nodes, writers and replication
#              dial with sslmode=verify-full against the CA
#   Kafka      (--log) SASL_SSL for clients, SCRAM-SHA-512, one user for the fronts and
#              one for the writers with ACLs; SSL between brokers (deploy/kafka/kafka.sh)
#   HAProxy    kettles over TLS on :8443 (HTTPS) and :8883 (MQTT), terminated there;
#              plain :8080 and :1883 besides; plain to the nodes
# docs/security.md says which side checks what, and how a certificate is renewed.
#
# Environment (defaults in brackets):
#   KETTLE_HA_MODE       loopback or netns [loopback]
#   KETTLE_HA_NET        first three octets of the address block [127.0.44; netns: 198.18.0]
#   KETTLE_HA_PREFIX     netns mode: names of the namespaces, links, mounts and nftables
#                        table, PREFIX-NAME; down removes everything named so [kf]
#   KETTLE_HA_FS         data filesystems: tmpfs, ext4 (loop-mounted image) or none
#                        [netns: tmpfs; loopback: none]
#   KETTLE_HA_DISK_ETCD, _PG, _KETTLE, _KAFKA   their sizes [512M, 1G, 256M, 1G]
#   KETTLE_HA_TOXI       1: the four links through Toxiproxy (netns only) [netns: 1]
#   KETTLE_HA_TOXI_SEED  Toxiproxy's seed for its random jitter and toxicity [1]
#   KETTLE_HA_LOG        1: as up --log (Kafka × 3, a writer, nodes with --log) [0]
#   KETTLE_HA_TLS        1: TLS on every link between members, from a throwaway CA made
#                        at up in DIR/tls (see TLS below); 0: plain TCP, for comparison [1]
#   KETTLE_HA_DIR        state: data, logs, pids, rendered configs [/tmp/kettle-ha]
#   KETTLE_HA_NODES      kettle serve nodes behind HAProxy, 0 for none [2]
#   KETTLE_HA_SYNC       Patroni synchronous_mode: true or false [true]
#   KETTLE_HA_VENV       Patroni's virtualenv [REPO/.deps/venv-patroni] (make deps)
#   KETTLE_HA_PGBIN      PostgreSQL binaries [newest /usr/lib/postgresql/*/bin]
#   KETTLE_BIN           the kettle binary [REPO/bin/kettle] (make build)
#   KETTLE_HA_SERVE_ARGS more `kettle serve` flags for every node
#   KETTLE_HA_WRITER_ARGS more `kettle serve --role writer` flags for the writer
#   KETTLE_HA_PASSWORD   password of every database role [generated, kept in DIR]
#   KETTLE_TOXIPROXY     Toxiproxy's server [REPO/.deps/bin/toxiproxy-server] (make deps)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
# A topology keeps the mode it was brought up in (DIR/mode): down, status and
# the faults find it without the variables.
_dir=${KETTLE_HA_DIR:-/tmp/kettle-ha}
MODE=${KETTLE_HA_MODE:-$(cat "$_dir/mode" 2>/dev/null || echo loopback)}
case "$MODE" in
loopback) NET=${KETTLE_HA_NET:-127.0.44} ;;
netns) NET=${KETTLE_HA_NET:-198.18.0} ;;
*) echo "cluster.sh: KETTLE_HA_MODE=$MODE: loopback or netns" >&2; exit 2 ;;
esac
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
# Every name this script gives the system (namespaces, links, mounts, the
# nftables table) starts with PFX-, so down finds them whatever killed the
# members or the script: an interface name holds 15 characters, PFX-worker99
# must fit.
PFX=${KETTLE_HA_PREFIX:-kf}
[[ "$PFX" =~ ^[a-z][a-z0-9]{0,5}$ ]] || { echo "cluster.sh: KETTLE_HA_PREFIX=$PFX: 1-6 of a-z0-9, a letter first" >&2; exit 2; }
BR=$PFX-br
if [ "$MODE" = netns ]; then FS=${KETTLE_HA_FS:-tmpfs}; TOXI=${KETTLE_HA_TOXI:-1}; else FS=${KETTLE_HA_FS:-none}; TOXI=0; fi
case "$FS" in tmpfs | ext4 | none) ;; *) echo "cluster.sh: KETTLE_HA_FS=$FS: tmpfs, ext4 or none" >&2; exit 2 ;; esac
LOGMODE=${KETTLE_HA_LOG:-$(cat "$_dir/log-mode" 2>/dev/null || echo 0)}
TLS=${KETTLE_HA_TLS:-$(cat "$_dir/tls-mode" 2>/dev/null || echo 1)}
case "$TLS" in 0 | 1) ;; *) echo "cluster.sh: KETTLE_HA_TLS=$TLS: 1 or 0" >&2; exit 2 ;; esac
TLSDIR=$DIR/tls
if [ "$TLS" = 1 ]; then SCHEME=https HOSTSSL=hostssl SSLMODE=verify-full TLSON=""; else SCHEME=http HOSTSSL=host SSLMODE=disable TLSON="#"; fi
TOXIPROXY=${KETTLE_TOXIPROXY:-$repo/.deps/bin/toxiproxy-server}
# The addresses the clients of each proxied link dial (netns with Toxiproxy):
# the same last octet as the member behind it, in a /24 of the link's own,
# held on the client machine's loopback, where its Toxiproxy listens and
# dials the member from the machine's own address, so partitions still cut
# the proxied link. Without Toxiproxy they are the members' own addresses.
net3() { local a b c; IFS=. read -r a b c <<<"$NET"; echo "$a.$b.$((c + $1))"; }
if [ "$TOXI" = 1 ]; then
	LBNET=$(net3 1) DBNET=$(net3 2) REPLNET=$(net3 3) KNET=$(net3 4)
else
	LBNET=$NET DBNET=$NET REPLNET=$NET KNET=$NET
fi

# KETTLE_HA_TRACE=1: every command on stderr, with the seconds since start.
[ -n "${KETTLE_HA_TRACE:-}" ] && { PS4='+ ${SECONDS}s '; set -x; }

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

need() {
	command -v etcd >/dev/null || die "etcd not found: make deps (Debian etcd-server)"
	command -v haproxy >/dev/null || die "haproxy not found: make deps (Debian haproxy)"
	command -v openssl >/dev/null || die "openssl not found: make deps (Debian openssl)"
	[ -x "$VENV/bin/patroni" ] || die "$VENV/bin/patroni not found: make deps (Patroni's virtualenv)"
	[ -x "$PGBIN/postgres" ] || die "PostgreSQL binaries not found in '$PGBIN': make deps (Debian postgresql), or set KETTLE_HA_PGBIN"
	id postgres >/dev/null 2>&1 || die "no postgres OS user: make deps (Debian postgresql creates it)"
	if [ "$NODES" -gt 0 ]; then [ -x "$KETTLE_BIN" ] || die "$KETTLE_BIN not found: make build, or set KETTLE_BIN"; fi
	need_machines
}

need_machines() {
	if [ "$MODE" = netns ]; then
		[ "$(id -u)" = 0 ] || die "netns mode needs root (network namespaces, a bridge, mounts)"
		command -v ip >/dev/null || die "ip not found: make deps (Debian iproute2)"
		command -v nft >/dev/null || die "nft not found: make deps (Debian nftables)"
		if [ "$TOXI" = 1 ]; then [ -x "$TOXIPROXY" ] || die "$TOXIPROXY not found: make deps (deploy/deps/machines.sh), or KETTLE_HA_TOXI=0"; fi
	fi
	if [ "$FS" != none ]; then [ "$(id -u)" = 0 ] || die "KETTLE_HA_FS=$FS needs root (mounts)"; fi
	if [ "$FS" = ext4 ]; then command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 not found: make deps (Debian e2fsprogs)"; fi
}

# render FILE I: the template with its @TOKENS@ replaced. With
# KETTLE_HA_TLS=0 a line starting @TLS@ becomes a comment, https http,
# hostssl host and verify-full disable.
render() {
	sed -e "s|@NET@|$NET|g" -e "s|@LBNET@|$LBNET|g" -e "s|@REPLNET@|$REPLNET|g" -e "s|@I@|$2|g" -e "s|@DIR@|$DIR|g" -e "s|@PGBIN@|$PGBIN|g" -e "s|@SYNC@|$SYNC|g" \
		-e "s|@TLSDIR@|$TLSDIR|g" -e "s|@TLS@|$TLSON|g" -e "s|@SCHEME@|$SCHEME|g" -e "s|@HOSTSSL@|$HOSTSSL|g" -e "s|@SSLMODE@|$SSLMODE|g" "$1"
}

# ---- the topology's CA and the members' certificates ------------------------

# shellcheck source=deploy/tls.sh
. "$here/tls.sh"

# tls_ca: DIR/tls/ca.key and ca.crt, made once per topology (a throwaway CA:
# its key never leaves DIR and goes with down).
tls_ca() {
	[ "$TLS" = 1 ] || return 0
	tls_make_ca "$TLSDIR" "kettlefleet topology CA $(basename "$DIR")" || die "no CA in $TLSDIR"
}

# sans_of MEMBER: the addresses a client may dial MEMBER at (its own, and the
# proxies' in front of it with Toxiproxy), as SANs.
sans_of() {
	local a o l=()
	a=$(addr_of "$1")
	o=${a##*.}
	l=("$a")
	case "$1" in
	pg[1-3]) l+=("$DBNET.$o" "$REPLNET.$o") ;;
	kettle[1-9]) l+=("$LBNET.$o") ;;
	kafka[1-3]) l+=("$KNET.$o") ;;
	esac
	tls_sans "${l[@]}" 127.0.0.1 "$1"
}

# tls_cert NAME OWNER [SANS [renew]]: DIR/tls/NAME.key and NAME.crt, made
# when missing, or anew with renew.
tls_cert() {
	local name=$1 owner=$2 sans=${3:-} renew=${4:-}
	[ "$TLS" = 1 ] || return 0
	tls_ca
	[ -z "$renew" ] && [ -s "$TLSDIR/$name.crt" ] && return 0
	[ -n "$sans" ] || sans=$(sans_of "$name")
	tls_issue "$TLSDIR" "$name" "$owner" "$sans" || die "no certificate for $name"
}

# tls_args: curl's options for the members' TLS ports (this host's client
# certificate: etcd asks every client for one).
tls_args() {
	[ "$TLS" = 1 ] || return 0
	tls_cert admin root "$(tls_sans 127.0.0.1 admin)"
	echo "--cacert $TLSDIR/ca.crt --cert $TLSDIR/admin.crt --key $TLSDIR/admin.key"
}

# mcurl ARGS…: curl to a member's TLS port.
mcurl() {
	# shellcheck disable=SC2046
	curl $(tls_args) "$@"
}

# renew_cert MEMBER: a new key and certificate from the same CA, taken up
# without a restart where the member can: etcd reads its files at each new
# connection, PostgreSQL and Patroni's REST API on SIGHUP (sent here; on real
# machines patronictl reload); a Kafka node restarts (kafka.sh renew-cert:
# the other two serve meanwhile).
renew_cert() {
	local m=${1:?usage: renew-cert MEMBER}
	[ "$TLS" = 1 ] || die "renew-cert: the topology runs without TLS (KETTLE_HA_TLS=0)"
	case "$m" in
	etcd[1-3]) tls_cert "$m" root "" renew ;;
	pg[1-3])
		tls_cert "$m" postgres "" renew
		local p
		p=$(pidof_member "$m")
		[ -n "$p" ] && kill -HUP "$p"
		p=$(postmaster "${m#pg}")
		[ -n "$p" ] && kill -HUP "$p"
		;;
	kafka[1-3]) kafka_sh renew-cert "$DIR/kafka" "${m#kafka}" ;;
	*) die "renew-cert: etcd1-3, pg1-3 or kafka1-3" ;;
	esac
	log "renew-cert $m: serial $(openssl x509 -in "$TLSDIR/$m.crt" -noout -serial | cut -d= -f2)"
}

password() {
	if [ -n "${KETTLE_HA_PASSWORD:-}" ]; then echo "$KETTLE_HA_PASSWORD"; return; fi
	[ -s "$DIR/password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DIR/password")
	cat "$DIR/password"
}

pidof_member() { [ -s "$DIR/$1.pid" ] && cat "$DIR/$1.pid" || true; }
alive() { local p; p=$(pidof_member "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

# spawn NAME USER CMD…: run CMD in the background in its own session as USER,
# output in DIR/NAME.log, pid in DIR/NAME.pid; in netns mode in NAME's
# machine (toxi-M: in M's), under faketime while DIR/NAME.clock holds an
# offset (clock).
spawn() {
	local name=$1 user=$2; shift 2
	local pre=()
	[ "$MODE" = netns ] && pre=(ip netns exec "$PFX-$(machine_of "$name")")
	[ -s "$DIR/$name.clock" ] && pre+=(faketime -f "$(cat "$DIR/$name.clock")")
	# From DIR: the postgres user may not enter the checkout (a 0700 parent,
	# as mktemp -d makes), and initdb under Patroni needs a working directory
	# it can reach.
	pushd "$DIR" >/dev/null
	if [ "$user" = root ]; then
		setsid "${pre[@]}" "$@" >>"$DIR/$name.log" 2>&1 </dev/null &
	else
		# HOME is DIR: libpq looks for a client certificate in
		# ~/.postgresql and fails on one it may not stat (root's 0700 home)
		# — pg_basebackup of a standby would.
		setsid "${pre[@]}" setpriv --reuid="$user" --regid="$user" --init-groups env HOME="$DIR" "$@" >>"$DIR/$name.log" 2>&1 </dev/null &
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
mhttp_ok() { mcurl -fsS -m 2 -o /dev/null "$1"; }

start_etcd() {
	local i=$1
	alive "etcd$i" && return 0
	machine "etcd$i"
	tls_cert "etcd$i" root
	render "$here/etcd/etcd.env" "$i" | grep -v '^#' | grep . >"$DIR/etcd$i.env"
	# A member that was there before rejoins with its data, not as new.
	[ -d "$DIR/etcd$i/member" ] && sed -i 's/^ETCD_INITIAL_CLUSTER_STATE=new/ETCD_INITIAL_CLUSTER_STATE=existing/' "$DIR/etcd$i.env"
	spawn "etcd$i" root env $(cat "$DIR/etcd$i.env") etcd
}

start_pg() {
	local i=$1 pw
	alive "pg$i" && return 0
	pw=$(password)
	machine "pg$i"
	start_toxi "pg$i"
	tls_cert "pg$i" postgres
	mkdir -p "$DIR/pg$i"
	chown postgres: "$DIR/pg$i"
	chmod 700 "$DIR/pg$i"
	render "$here/patroni/patroni.yml" "$i" >"$DIR/pg$i.yml"
	chmod 644 "$DIR/pg$i.yml"
	# The passwords in the environment (spawn's own, exported for the call),
	# never in an argv, not even env's for the moment before it execs.
	PATRONI_SUPERUSER_PASSWORD="$pw" PATRONI_REPLICATION_PASSWORD="$pw" PATRONI_REWIND_PASSWORD="$pw" \
		spawn "pg$i" postgres "$VENV/bin/patroni" "$DIR/pg$i.yml"
}

start_kettle() {
	local i=$1
	alive "kettle$i" && return 0
	machine "kettle$i"
	start_toxi "kettle$i"
	mkdir -p "$DIR/kettle$i"
	# One operator token and device secret for every node: kettles and
	# operators do not care which node answers.
	[ -s "$DIR/operator-token" ] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/operator-token")
	[ -s "$DIR/secret" ] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/secret")
	cp "$DIR/operator-token" "$DIR/secret" "$DIR/kettle$i/"
	# The DSN holds the password: in the environment (KETTLE_DB), not argv.
	# shellcheck disable=SC2086
	KETTLE_DB="$(node_dsn)" spawn "kettle$i" root "$KETTLE_BIN" serve --addr "$NET.2$i:8080" --mqtt-addr "$NET.2$i:1883" \
		--data-dir "$DIR/kettle$i" --drain-delay 2s --trusted-proxies "$(addr_of haproxy)" --log-format text $(front_log_args) ${KETTLE_HA_SERVE_ARGS:-}
}

start_haproxy() {
	alive haproxy && return 0
	machine haproxy
	start_toxi haproxy
	# its TLS frontends' key and certificate, in one file as HAProxy reads them
	if [ "$TLS" = 1 ]; then
		tls_cert haproxy root
		(umask 077; cat "$TLSDIR/haproxy.crt" "$TLSDIR/haproxy.key" >"$TLSDIR/haproxy.pem")
	fi
	local n lines=""
	for n in $(seq 1 "$NODES"); do lines="$lines $n"; done
	# Each template line holding @N@ is written once per node.
	awk -v nodes="$lines" '
		/@N@/ { split(nodes, ns, " "); for (k in ns) { l = $0; gsub(/@N@/, ns[k], l); print l }; next }
		{ print }' "$here/haproxy/haproxy.cfg" | render /dev/stdin 0 |
		sed -f <(printf 's|@STATS_PASSWORD@|%s|g\n' "$(password)") >"$DIR/haproxy.cfg" # the password on no command line
	chmod 600 "$DIR/haproxy.cfg" # it holds the stats page's password
	haproxy -c -q -f "$DIR/haproxy.cfg" || die "haproxy -c rejected $DIR/haproxy.cfg"
	spawn haproxy root haproxy -W -db -f "$DIR/haproxy.cfg"
}

# dsn: the multi-host DSN kettle serve uses (the primary among three), as
# this host reaches the members.
dsn() {
	echo "postgres://kettle:$(password)@$NET.11:5432,$NET.12:5432,$NET.13:5432/kettle?target_session_attrs=read-write&connect_timeout=2&$(dsn_tls)"
}

# dsn_tls: the DSN's TLS parameters: the server's certificate checked
# against the topology's CA and its address (verify-full).
dsn_tls() {
	if [ "$TLS" = 1 ]; then echo "sslmode=verify-full&sslrootcert=$TLSDIR/ca.crt"; else echo "sslmode=disable"; fi
}

# node_dsn: the same DSN as the nodes and the writer dial it (through the
# node→database link's proxies with Toxiproxy).
node_dsn() { dsn | sed "s/@$NET\.11:5432,$NET\.12:5432,$NET\.13:5432\//@$DBNET.11:5432,$DBNET.12:5432,$DBNET.13:5432\//"; }

patronictl() { "$VENV/bin/patronictl" -c "$DIR/pg1.yml" "$@"; }

# role ROLE: the members in ROLE (leader, sync_standby, replica), from any Patroni's REST API.
role() {
	local i
	for i in 1 2 3; do
		mcurl -fsS -m 1 "$SCHEME://$NET.1$i:8008/cluster" 2>/dev/null |
			ROLE=$1 python3 -c 'import json,os,sys; n=[m["name"] for m in json.load(sys.stdin)["members"] if m["role"]==os.environ["ROLE"]]; print(" ".join(n)); sys.exit(0 if n else 1)' 2>/dev/null && return 0
	done
	return 1
}
leader() { role leader; }

# healthy: a leader and two streaming standbys, one of them synchronous (with KETTLE_HA_SYNC=true).
healthy() {
	local i
	for i in 1 2 3; do
		mcurl -fsS -m 1 "$SCHEME://$NET.1$i:8008/cluster" 2>/dev/null | SYNC=$SYNC python3 -c '
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

# as_postgres CMD…: CMD as the postgres user, from DIR and with HOME=DIR:
# postgres may enter neither the checkout (a 0700 parent) nor root's home,
# and psql says so on stderr, which callers read with the answer.
as_postgres() {
	(cd "$DIR" && setpriv --reuid=postgres --regid=postgres --init-groups env HOME="$DIR" "$@")
}

psql_leader() {
	local l
	l=$(leader) || return 1
	as_postgres "$PGBIN/psql" -h "$DIR/$l" -p 5432 -U postgres -d postgres -qAt -v ON_ERROR_STOP=1 "$@"
}

create_db() {
	local pw
	pw=$(password)
	# On stdin: a password in psql's arguments is in every user's ps.
	psql_leader -f - >/dev/null <<-EOF
		DO \$\$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'kettle') THEN CREATE ROLE kettle LOGIN PASSWORD '$pw'; END IF; END \$\$;
		GRANT pg_monitor TO kettle;
	EOF
	if [ "$(psql_leader -c "SELECT 1 FROM pg_database WHERE datname = 'kettle'")" != 1 ]; then
		psql_leader -c "CREATE DATABASE kettle OWNER kettle" >/dev/null
	fi
	# Every member has replayed it: a client of the multi-host DSN may try a
	# standby first, and "database does not exist" ends its search.
	local i
	for i in 1 2 3; do wait_for "database kettle on pg$i" 60 has_db "$i" || return 1; done
}

has_db() {
	[ "$(as_postgres "$PGBIN/psql" -h "$DIR/pg$1" -p 5432 -U postgres -d postgres -qAt \
		-c "SELECT 1 FROM pg_database WHERE datname = 'kettle'" 2>/dev/null)" = 1 ]
}

up() {
	need
	mkdir -p "$DIR"
	chmod 755 "$DIR"
	password >/dev/null
	local i
	[ "$MODE" = netns ] && bridge_up
	for i in 1 2 3; do start_etcd "$i"; done
	for i in 1 2 3; do wait_for "etcd$i" 30 mhttp_ok "$SCHEME://$NET.$i:2379/health" || { down; die "etcd did not start; see $DIR/etcd*.log"; }; done
	# Kafka needs neither etcd nor PostgreSQL: its JVMs start meanwhile.
	local kafka=""
	if [ "$LOGMODE" = 1 ]; then start_kafka >"$DIR/kafka-start.log" 2>&1 & kafka=$!; fi
	for i in 1 2 3; do start_pg "$i"; done
	wait_for "a Patroni leader and two streaming standbys" 120 healthy || die "the Patroni cluster did not come up; see $DIR/pg*.log (deploy/cluster.sh down to clean up)"
	create_db
	if [ -n "$kafka" ]; then
		wait "$kafka" || die "kafka did not start: $(tail -5 "$DIR/kafka-start.log")"
		start_writer
	fi
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

down() {
	local i p
	# A stopped process does not die of SIGTERM, and a member cut from the
	# others waits for them until its timeouts: faults first.
	thaw_all
	# the partitions only: slow links and toxics go with the machines
	nft delete table bridge "$PFX" 2>/dev/null || true
	stop_member haproxy TERM 5
	# the members of one kind stop side by side
	local w=()
	for p in "$DIR"/worker*.pid; do [ -e "$p" ] && { stop_member "$(basename "$p" .pid)" TERM 5 & w+=($!); }; done
	for i in 1 2 3 4 5 6 7 8 9; do stop_member "kettle$i" TERM 40 & w+=($!); done
	stop_member writer TERM 40 & w+=($!)
	for p in "${w[@]}"; do wait "$p" || true; done
	[ -d "$DIR/kafka" ] && kafka_sh stop "$DIR/kafka" >/dev/null 2>&1
	w=()
	for i in 1 2 3; do stop_member "pg$i" TERM 30 & w+=($!); done
	for p in "${w[@]}"; do wait "$p" || true; done
	for i in 1 2 3; do
		p=$(postmaster "$i")
		[ -n "$p" ] && kill -0 "$p" 2>/dev/null && kill -QUIT "$p" 2>/dev/null || true
	done
	w=()
	for i in 1 2 3; do stop_member "etcd$i" TERM 10 & w+=($!); done
	for p in "$DIR"/toxi-*.pid; do [ -e "$p" ] && { stop_member "$(basename "$p" .pid)" TERM 5 & w+=($!); }; done
	for p in "${w[@]}"; do wait "$p" || true; done
	sweep
	if [ "${KETTLE_HA_KEEP:-}" = "" ]; then
		# never through a mount that is still there
		if findmnt -rn -o TARGET | grep -q "^$DIR/"; then
			log "left $DIR: a filesystem is still mounted under it"
		else
			case "$DIR" in /tmp/*) rm -rf "$DIR" ;; *) log "left $DIR (not under /tmp)" ;; esac
		fi
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
	machines_status
}

# ---- machines (netns mode) and their disks --------------------------------

# addr_of MEMBER: its address (host: this machine's, on the bridge).
addr_of() {
	case "$1" in
	etcd[1-3]) echo "$NET.${1#etcd}" ;;
	pg[1-3]) echo "$NET.1${1#pg}" ;;
	kettle[1-9]) echo "$NET.2${1#kettle}" ;;
	haproxy) echo "$NET.30" ;;
	kafka[1-3]) echo "$NET.4${1#kafka}" ;;
	writer) echo "$NET.45" ;;
	worker[1-9] | worker[1-9][0-9]) echo "$NET.$((100 + ${1#worker}))" ;;
	host) echo "$NET.254" ;;
	*) die "unknown member '$1' (etcd1-3, pg1-3, kettle1-9, haproxy, kafka1-3, writer, worker1-99, host)" ;;
	esac
}

machine_of() { case "$1" in toxi-*) echo "${1#toxi-}" ;; *) echo "$1" ;; esac; }

# mount_of MEMBER: where its data filesystem is mounted (nothing: it has none).
mount_of() {
	case "$1" in
	etcd[1-3] | pg[1-3] | kettle[1-9] | writer) echo "$DIR/$1" ;;
	kafka[1-3]) echo "$DIR/kafka/node${1#kafka}/data" ;;
	esac
}

disk_size() {
	case "$1" in
	etcd*) echo "${KETTLE_HA_DISK_ETCD:-512M}" ;;
	pg*) echo "${KETTLE_HA_DISK_PG:-1G}" ;;
	kafka*) echo "${KETTLE_HA_DISK_KAFKA:-1G}" ;;
	*) echo "${KETTLE_HA_DISK_KETTLE:-256M}" ;;
	esac
}

# bridge_up: the bridge every machine's link is a port of, this host on it.
bridge_up() {
	if ! ip link show dev "$BR" >/dev/null 2>&1; then
		ip link add "$BR" type bridge
		# ports forward at once (no STP), multicast snooping is of no use here
		ip link set "$BR" type bridge stp_state 0 mcast_snooping 0
	fi
	ip addr replace "$(addr_of host)/24" dev "$BR"
	ip link set "$BR" up
}

# machine MEMBER: its namespace, link and address (netns mode) and its data
# filesystem (KETTLE_HA_FS), made when missing.
machine() {
	local m=$1 a ns
	if [ "$MODE" = netns ]; then
		a=$(addr_of "$m")
		ns=$PFX-$m
		bridge_up
		[ -e "/run/netns/$ns" ] || ip netns add "$ns"
		ip link show dev "$ns" >/dev/null 2>&1 || ip link add "$ns" type veth peer name eth0 netns "$ns"
		ip link set "$ns" master "$BR" up
		ip -n "$ns" link set lo up
		ip -n "$ns" addr replace "$a/24" dev eth0
		ip -n "$ns" link set eth0 up
	fi
	disk "$m"
}

# disk MEMBER: mount its data filesystem, of its fixed size.
disk() {
	local m=$1 mnt size img
	mnt=$(mount_of "$m")
	[ -n "$mnt" ] && [ "$FS" != none ] || return 0
	mkdir -p "$mnt"
	mountpoint -q "$mnt" && return 0
	size=$(disk_size "$m")
	case "$FS" in
	tmpfs) mount -t tmpfs -o "size=$size,mode=0755" "$PFX-$m" "$mnt" ;;
	ext4)
		mkdir -p "$DIR/disks"
		img=$DIR/disks/$PFX-$m.img
		if [ ! -s "$img" ]; then
			truncate -s "$size" "$img"
			# no blocks reserved for root: full is full for every member
			mkfs.ext4 -q -F -m 0 -L "$PFX-$m" "$img"
		fi
		mount -o loop "$img" "$mnt"
		# Kafka takes every directory in its log.dirs for a partition's
		rmdir "$mnt/lost+found" 2>/dev/null || true
		;;
	esac
}

pfx_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PFX-" || true; }

# ns_pids NS: every process in network namespace NS.
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }

# procs_of MEMBER: the pids of all its processes (in netns mode every process
# of its machine but the Toxiproxy, which stands for the network; pgN in
# loopback mode: Patroni's session, the postmaster and the postmaster's
# children — each of which PostgreSQL puts in a session of its own
# (InitPostmasterChild calls setsid), so the postmaster's session alone
# leaves the backends, the walsenders and the WAL writer running: a
# "paused" primary that goes on committing on its open connections).
procs_of() {
	local m=$1 p sid
	if [ "$MODE" = netns ]; then
		local tp
		tp=$(readlink -f "$TOXIPROXY" 2>/dev/null || true)
		for p in $(ns_pids "$PFX-$m"); do
			[ -n "$tp" ] && [ "$(readlink -f "/proc/$p/exe" 2>/dev/null)" = "$tp" ] && continue
			echo "$p"
		done
		return 0
	fi
	local sids=()
	case "$m" in
	kafka[1-3]) p=$(cat "$DIR/kafka/node${m#kafka}/pid" 2>/dev/null || true) ;;
	*) p=$(pidof_member "$m") ;;
	esac
	[ -n "$p" ] && sids+=("$p")
	case "$m" in pg[1-3]) p=$(postmaster "${m#pg}"); [ -n "$p" ] && sids+=("$(ps -o sid= -p "$p" | tr -d ' ')") ;; esac
	{
		for sid in "${sids[@]}"; do [ -n "$sid" ] && ps -o pid= -s "$sid" | tr -d ' '; done
		# the postmaster's children, whatever their session
		case "$m" in pg[1-3]) p=$(postmaster "${m#pg}"); [ -n "$p" ] && ps -o pid= --ppid "$p" | tr -d ' ' ;; esac
	} | awk 'NF && !seen[$0]++'
}

# signal_member MEMBER SIGNAL: SIGNAL to all its processes, again until no
# new one appears (a postmaster forks while it is being stopped).
signal_member() {
	local m=$1 sig=$2 done=" " p new round
	for round in 1 2 3 4 5; do
		new=""
		for p in $(procs_of "$m"); do
			case "$done" in *" $p "*) continue ;; esac
			new="$new $p"
		done
		[ -n "$new" ] || break
		# shellcheck disable=SC2086
		kill -"$sig" $new 2>/dev/null || true
		done="$done${new# } "
	done
	[ "$done" != " " ]
}

# thaw_all: SIGCONT to every member's processes.
thaw_all() {
	local ns p m
	for ns in $(pfx_netns); do
		p=$(ns_pids "$ns")
		# shellcheck disable=SC2086
		[ -z "$p" ] || kill -CONT $p 2>/dev/null || true
	done
	if [ "$MODE" = loopback ]; then
		for p in "$DIR"/*.pid; do
			[ -e "$p" ] || continue
			m=$(basename "$p" .pid)
			# shellcheck disable=SC2046
			kill -CONT $(procs_of "$m") 2>/dev/null || true
		done
	fi
}

# sweep: remove every namespace, link, nftables table, mount and loop device
# named PFX-…, whatever is left of them: found in the system, not in DIR, so
# also after the members or this script were killed.
sweep() {
	local ns p end l t f dev
	for ns in $(pfx_netns); do
		end=$((SECONDS + 10))
		while p=$(ns_pids "$ns") && [ -n "$p" ]; do
			# shellcheck disable=SC2086
			kill -KILL $p 2>/dev/null || true
			[ $SECONDS -lt $end ] || { log "$ns: processes $p do not die"; break; }
			sleep 0.1
		done
		ip netns delete "$ns" 2>/dev/null || log "ip netns delete $ns failed"
	done
	# the host ends of the veths went with their namespaces; the bridge
	for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^$PFX-" || true); do
		ip link delete "$l" 2>/dev/null || true
	done
	nft delete table bridge "$PFX" 2>/dev/null || true
	# deepest first: a member's disk may sit under another's directory
	for t in $(findmnt -rn -o TARGET,SOURCE,LABEL | awk -v p="$PFX-" 'index($2, p) == 1 || index($3, p) == 1 {print $1}' | sort -r || true); do
		umount "$t" 2>/dev/null || umount -l "$t" || log "umount $t failed"
	done
	{ losetup -l -n -O NAME,BACK-FILE 2>/dev/null || true; } | while read -r dev f; do
		case "$(basename "$f")" in "$PFX"-*.img*) losetup -d "$dev" 2>/dev/null || log "losetup -d $dev failed" ;; esac
	done
	return 0
}

# members_up: the members there are now, in the order of the table above.
members_up() {
	local m all=() p
	all=(etcd1 etcd2 etcd3 pg1 pg2 pg3 kettle1 kettle2 kettle3 kettle4 kettle5 kettle6 kettle7 kettle8 kettle9 haproxy kafka1 kafka2 kafka3 writer)
	for p in "$DIR"/worker*.pid; do [ -e "$p" ] && all+=("$(basename "$p" .pid)"); done
	for m in "${all[@]}"; do
		if [ "$MODE" = netns ]; then
			[ -e "/run/netns/$PFX-$m" ] && echo "$m"
		else
			case "$m" in kafka[1-3]) [ -s "$DIR/kafka/node${m#kafka}/pid" ] && echo "$m" ;; *) [ -s "$DIR/$m.pid" ] && echo "$m" ;; esac
		fi
	done
	return 0
}

machines() { local m; for m in $(members_up); do echo "$m $(addr_of "$m")"; done; }

# machines_status: each machine, its address, its processes, its disk use.
machines_status() {
	local m mnt procs p
	echo "machines ($MODE mode$([ "$MODE" = netns ] && echo ", bridge $BR, this host $(addr_of host)"); disks: $FS):"
	for m in $(members_up); do
		procs=""
		for p in $(procs_of "$m"); do
			procs="$procs${procs:+,}$(ps -o comm= -p "$p" 2>/dev/null || true)[$p$(ps -o stat= -p "$p" 2>/dev/null | grep -q '^T' && echo ' stopped' || true)]"
		done
		if alive "toxi-$m"; then procs="$procs${procs:+,}toxiproxy[$(pidof_member "toxi-$m")]"; fi
		mnt=$(mount_of "$m")
		if [ -n "$mnt" ] && mountpoint -q "$mnt" 2>/dev/null; then
			mnt=$(df -h --output=used,size "$mnt" | tail -1 | awk '{print $1 " of " $2}')
		else
			mnt="-"
		fi
		printf '  %-9s %-15s disk %-16s %s\n' "$m" "$(addr_of "$m")" "$mnt" "${procs:-no process}"
	done
}

# ---- the readings log (--log), the writer, the lab's workers ---------------

kafka_sh() {
	local hosts="" ns="" client="" i
	for i in 1 2 3; do
		hosts="$hosts${hosts:+ }$(addr_of "kafka$i")"
		[ "$MODE" = netns ] && ns="$ns${ns:+ }$PFX-kafka$i"
		[ "$TOXI" = 1 ] && client="$client${client:+ }$KNET.4$i"
	done
	KAFKA_HOSTS=$hosts KAFKA_NETNS=$ns KAFKA_CLIENT_HOSTS=$client KAFKA_TLS=$TLS KAFKA_TLS_DIR=$TLSDIR "$here/kafka/kafka.sh" "$@"
}

# log_auth_args USER: kettle serve's flags to reach Kafka as USER (front or
# writer): the topology's CA and USER's SCRAM password, from a file.
log_auth_args() {
	[ "$TLS" = 1 ] || return 0
	echo "--log-ca $TLSDIR/ca.crt --log-user $1 --log-password-file $DIR/kafka/users/$1.password"
}

# front_log_args: --log for the nodes (through the front→Kafka proxies with
# Toxiproxy: the brokers' CLIENT listener, advertised there).
front_log_args() {
	[ "$LOGMODE" = 1 ] || return 0
	local b="" i
	for i in 1 2 3; do
		if [ "$TOXI" = 1 ]; then b="$b${b:+,}$KNET.4$i:9094"; else b="$b${b:+,}$(addr_of "kafka$i"):9092"; fi
	done
	echo "--log kafka://$b/kettle.readings --log-monitor-every 1s $(log_auth_args front)"
}

start_kafka() {
	local i
	for i in 1 2 3; do machine "kafka$i"; done
	kafka_sh start "$DIR/kafka" >&2 || die "kafka did not start; see $DIR/kafka/node*/kafka.log"
}

start_kafka_node() {
	machine "kafka$1"
	kafka_sh start-node "$DIR/kafka" "$1" >&2
}

# start_writer: kettle serve --role writer, from the log into the database.
start_writer() {
	alive writer && return 0
	machine writer
	start_toxi writer
	mkdir -p "$DIR/writer"
	local b="" i
	for i in 1 2 3; do b="$b${b:+,}$(addr_of "kafka$i"):9092"; done
	KETTLE_DB="$(node_dsn)" spawn writer root "$KETTLE_BIN" serve --role writer --addr "$(addr_of writer):8080" \
		--data-dir "$DIR/writer" --log "kafka://$b/kettle.readings" --log-monitor-every 1s $(log_auth_args writer) --log-format text ${KETTLE_HA_WRITER_ARGS:-}
	wait_for writer 60 http_ok "http://$(addr_of writer):8080/healthz" || die "the writer is not up; see $DIR/writer.log"
}

worker_token() {
	[ -s "$DIR/worker-token" ] || (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/worker-token")
	cat "$DIR/worker-token"
}

start_worker() {
	local k=$1 m=worker$1 a allow=() tls=()
	alive "$m" && return 0
	machine "$m"
	a=$(addr_of "$m")
	# A worker loads only loopback, or the hosts it is allowed: the balancer
	# and the nodes. Off loopback its control listener is TLS only (the
	# plans carry the device secret), with a certificate from the
	# topology's CA: the controller's --worker-ca is `cluster.sh ca`.
	if [ "$MODE" = netns ]; then
		local t="$NET.30" n
		for n in $(seq 1 "$NODES"); do t="$t,$NET.2$n"; done
		allow=(--allow-target "$t")
		[ "$TLS" = 1 ] || die "$m: a worker on a machine of its own listens with TLS only; run the topology with TLS (KETTLE_HA_TLS=1)"
		tls_cert "$m" root
		tls=(--tls-cert "$TLSDIR/$m.crt" --tls-key "$TLSDIR/$m.key")
	fi
	spawn "$m" root env KETTLE_TOKEN="$(worker_token)" "$KETTLE_BIN" swarm worker --listen "$a:7070" "${allow[@]}" "${tls[@]}"
	wait_for "$m" 20 bash -c "exec 3<>/dev/tcp/$a/7070" || die "$m not listening on $a:7070; see $DIR/$m.log"
}

# workers K: exactly K workers run; prints the controller's --workers list.
workers() {
	local k=${1:?usage: cluster.sh workers K} i p list=""
	[[ "$k" =~ ^[0-9]+$ ]] && [ "$k" -le 99 ] || die "workers: K is 0..99"
	mkdir -p "$DIR"
	chmod 755 "$DIR"
	[ "$MODE" = netns ] && bridge_up
	for i in $(seq 1 "$k"); do start_worker "$i"; done
	for p in "$DIR"/worker*.pid; do
		[ -e "$p" ] || continue
		i=$(basename "$p" .pid)
		if [ "${i#worker}" -gt "$k" ]; then stop_member "$i" TERM 5; [ "$MODE" = netns ] && drop_machine "$i"; fi
	done
	for i in $(seq 1 "$k"); do list="$list${list:+,}$(addr_of "worker$i"):7070"; done
	echo "$list"
}

# drop_machine MEMBER: its namespace and disk gone (a worker no longer wanted).
drop_machine() {
	local ns=$PFX-$1 p
	p=$(ns_pids "$ns")
	# shellcheck disable=SC2086
	[ -z "$p" ] || kill -KILL $p 2>/dev/null || true
	ip netns delete "$ns" 2>/dev/null || true
}

# ---- Toxiproxy on the four links -------------------------------------------

# toxi_proxies MEMBER: the proxies in MEMBER's machine, "NAME LISTEN UPSTREAM".
toxi_proxies() {
	local m=$1 i
	case "$m" in
	haproxy)
		for i in $(seq 1 "$NODES"); do
			echo "lb-kettle$i $LBNET.2$i:8080 $NET.2$i:8080"
			echo "lb-kettle$i-mqtt $LBNET.2$i:1883 $NET.2$i:1883"
		done
		;;
	kettle[1-9] | writer)
		for i in 1 2 3; do echo "db-pg$i $DBNET.1$i:5432 $NET.1$i:5432"; done
		if [ "$LOGMODE" = 1 ] && [ "$m" != writer ]; then
			for i in 1 2 3; do echo "kafka-kafka$i $KNET.4$i:9094 $NET.4$i:9094"; done
		fi
		;;
	pg[1-3]) for i in 1 2 3; do echo "repl-pg$i $REPLNET.1$i:5432 $NET.1$i:5432"; done ;;
	esac
}

toxi_api() { echo "http://$(addr_of "$1"):8474"; }

# start_toxi MEMBER: the Toxiproxy of MEMBER's machine, its proxies'
# addresses on the machine's loopback (netns mode with KETTLE_HA_TOXI=1).
start_toxi() {
	local m=$1 name listen up json=""
	[ "$TOXI" = 1 ] || return 0
	alive "toxi-$m" && return 0
	while read -r name listen up; do
		[ -n "$name" ] || continue
		ip -n "$PFX-$m" addr replace "${listen%:*}/32" dev lo
		json="$json${json:+,}{\"name\":\"$name\",\"listen\":\"$listen\",\"upstream\":\"$up\",\"enabled\":true}"
	done < <(toxi_proxies "$m")
	echo "[$json]" >"$DIR/toxi-$m.json"
	spawn "toxi-$m" root env LOG_LEVEL=warn "$TOXIPROXY" -host "$(addr_of "$m")" -port 8474 \
		-seed "${KETTLE_HA_TOXI_SEED:-1}" -config "$DIR/toxi-$m.json"
	wait_for "toxi-$m" 20 http_ok "$(toxi_api "$m")/version" || die "toxiproxy of $m not up; see $DIR/toxi-$m.log"
}

# toxi_each SELECTOR: "MEMBER PROXY" for every proxy the selector names
# (LINK[-UPSTREAM][@CLIENT], or nothing for all).
toxi_each() {
	local sel=${1:-} client="" link up="" f m name listen u
	case "$sel" in *@*) client=${sel#*@}; sel=${sel%@*} ;; esac
	link=${sel%%-*}
	case "$sel" in *-*) up=${sel#*-} ;; esac
	case "$link" in lb | db | repl | kafka | "") ;; *) die "toxic: link '$link': lb, db, repl or kafka (LINK[-MEMBER][@CLIENT])" ;; esac
	for f in "$DIR"/toxi-*.json; do
		[ -e "$f" ] || continue
		m=$(basename "$f" .json)
		m=${m#toxi-}
		[ -z "$client" ] || [ "$client" = "$m" ] || continue
		while read -r name listen u; do
			[ -n "$name" ] || continue
			if [ -n "$up" ]; then
				[ "$name" = "$link-$up" ] || [ "$name" = "$link-$up-mqtt" ] || continue
			elif [ -n "$link" ]; then
				case "$name" in "$link"-*) ;; *) continue ;; esac
			fi
			echo "$m $name"
		done < <(toxi_proxies "$m")
	done
}

toxi_req() { curl -fsS -m 5 -X "$1" -H 'Content-Type: application/json' ${3:+--data "$3"} "$2" >/dev/null; }

# toxic SELECTOR KIND ARGS…
toxic() {
	local sel=${1:?usage: cluster.sh toxic LINK latency MS JITTER | reset [AFTER_MS] | bandwidth KBPS} kind=${2:-} m p n=0 api
	[ "$TOXI" = 1 ] || die "toxic: no Toxiproxy (netns mode with KETTLE_HA_TOXI=1)"
	local toxics=()
	case "$kind" in
	latency)
		[[ "${3:-}" =~ ^[0-9]+$ && "${4:-0}" =~ ^[0-9]+$ ]] || die "toxic LINK latency MS JITTER: whole milliseconds"
		toxics=("kf_latency_up upstream latency {\"latency\":$3,\"jitter\":${4:-0}}" "kf_latency_down downstream latency {\"latency\":$3,\"jitter\":${4:-0}}")
		;;
	reset)
		[[ "${3:-0}" =~ ^[0-9]+$ ]] || die "toxic LINK reset [AFTER_MS]: whole milliseconds"
		toxics=("kf_reset upstream reset_peer {\"timeout\":${3:-0}}")
		;;
	bandwidth)
		[[ "${3:-}" =~ ^[0-9]+$ ]] || die "toxic LINK bandwidth KBPS: whole KB/s"
		toxics=("kf_bw_up upstream bandwidth {\"rate\":$3}" "kf_bw_down downstream bandwidth {\"rate\":$3}")
		;;
	*) die "toxic LINK latency MS JITTER | reset [AFTER_MS] | bandwidth KBPS" ;;
	esac
	local t tn ts tt ta
	while read -r m p; do
		api=$(toxi_api "$m")/proxies/$p/toxics
		for t in "${toxics[@]}"; do
			read -r tn ts tt ta <<<"$t"
			# replaced, not added twice: the verb is idempotent
			curl -fsS -m 5 -X DELETE "$api/$tn" >/dev/null 2>&1 || true
			toxi_req POST "$api" "{\"name\":\"$tn\",\"type\":\"$tt\",\"stream\":\"$ts\",\"toxicity\":1,\"attributes\":$ta}" ||
				die "toxic: $tn on $p in $m refused"
		done
		n=$((n + 1))
	done < <(toxi_each "$sel")
	[ "$n" -gt 0 ] || die "toxic: no proxy matches '$sel'"
	log "toxic $kind on $n proxies ($sel)"
}

# untoxic [SELECTOR]: every toxic of the proxies it names removed.
untoxic() {
	local m p api tn
	[ "$TOXI" = 1 ] || return 0
	while read -r m p; do
		api=$(toxi_api "$m")/proxies/$p/toxics
		for tn in $(curl -fsS -m 5 "$api" 2>/dev/null | python3 -c 'import json,sys; [print(t["name"]) for t in json.load(sys.stdin)]' 2>/dev/null); do
			toxi_req DELETE "$api/$tn" || die "untoxic: $tn on $p in $m"
		done
	done < <(toxi_each "${1:-}")
}

# ---- network faults: nftables on the bridge, tbf on the links --------------

need_netns() { [ "$MODE" = netns ] || die "$1: netns mode only (KETTLE_HA_MODE=netns)"; }

# group_addrs GROUP: "a, b, c" for an nftables set.
group_addrs() {
	local out="" m
	IFS=, read -r -a ms <<<"$1"
	for m in "${ms[@]}"; do [ -n "$m" ] && out="$out${out:+, }$(addr_of "$m")"; done
	[ -n "$out" ] || die "empty group"
	echo "$out"
}

nft_base() {
	nft -f - <<-EOF
		table bridge $PFX {
			chain cut_fwd { type filter hook forward priority 0; policy accept; }
			chain cut_in { type filter hook input priority 0; policy accept; }
			chain cut_out { type filter hook output priority 0; policy accept; }
		}
	EOF
}

# fault_id VERB ARGS…: a name for one network fault, the same for the same words.
fault_id() { echo "$*" | md5sum | cut -c1-12; }

has_fault() { nft list table bridge "$PFX" 2>/dev/null | grep -q "comment \"kf:$1 "; }

# add_drops ID DESC MATCH…: one drop rule per MATCH in each of the three
# chains, tagged kf:ID, unless that fault is in force already.
add_drops() {
	local id=$1 desc=$2 c mt script=""; shift 2
	has_fault "$id" && return 0
	nft_base
	for c in cut_fwd cut_in cut_out; do
		for mt in "$@"; do script="${script}add rule bridge $PFX $c $mt drop comment \"kf:$id $desc\""$'\n'; done
	done
	nft -f - <<<"$script"
}

del_drops() {
	local id=$1 c h
	for c in cut_fwd cut_in cut_out; do
		for h in $(nft -a list chain bridge "$PFX" "$c" 2>/dev/null | awk -v t="\"kf:$id " 'index($0, t) {print $NF}'); do
			nft delete rule bridge "$PFX" "$c" handle "$h"
		done
	done
}

partition_rules() {
	local i j g=("$@") out=()
	[ ${#g[@]} -ge 2 ] || die "partition: two groups at least (partition A,B C,D)"
	for i in "${!g[@]}"; do
		for j in "${!g[@]}"; do
			[ "$i" != "$j" ] && out+=("ip saddr { $(group_addrs "${g[$i]}") } ip daddr { $(group_addrs "${g[$j]}") }")
		done
	done
	printf '%s\n' "${out[@]}"
}

partition() {
	need_netns partition
	local rules=()
	mapfile -t rules < <(partition_rules "$@")
	add_drops "$(fault_id partition "$@")" "partition $*" "${rules[@]}"
}
unpartition() { need_netns unpartition; del_drops "$(fault_id partition "$@")"; }

partition_oneway() {
	need_netns partition-oneway
	[ $# -eq 2 ] || die "usage: partition-oneway FROM TO"
	add_drops "$(fault_id oneway "$@")" "partition-oneway $*" "ip saddr { $(group_addrs "$1") } ip daddr { $(group_addrs "$2") }"
}
unpartition_oneway() { need_netns unpartition-oneway; del_drops "$(fault_id oneway "$@")"; }

isolate() {
	need_netns isolate
	local a h
	a=$(addr_of "${1:?usage: isolate MEMBER}")
	h=$(addr_of host)
	add_drops "$(fault_id isolate "$1")" "isolate $1" "ip saddr $a ip daddr != $h" "ip daddr $a ip saddr != $h"
}
unisolate() { need_netns unisolate; del_drops "$(fault_id isolate "${1:?usage: unisolate MEMBER}")"; }

net_heal() {
	local m
	nft delete table bridge "$PFX" 2>/dev/null || true
	for m in $(members_up); do unslow "$m"; done
	untoxic
}

# rate_burst RATE: tbf's burst for RATE, 20 ms of it and two frames at least.
rate_burst() {
	python3 - "$1" <<-'EOF'
		import re, sys
		m = re.fullmatch(r"([0-9.]+)(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)", sys.argv[1].lower())
		if not m:
		    sys.exit("slow: RATE as tc writes it: 500kbit, 10mbit, 1gbit, 100kbps")
		n = float(m.group(1)) * {"bit": 1/8, "kbit": 125, "mbit": 125e3, "gbit": 125e6, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}[m.group(2)]
		print(max(3028, int(n / 50)))
	EOF
}

slow() {
	need_netns slow
	local m=${1:?usage: slow MEMBER RATE} rate=${2:?usage: slow MEMBER RATE} b
	addr_of "$m" >/dev/null
	b=$(rate_burst "$rate") || exit 2
	[ -e "/run/netns/$PFX-$m" ] || die "slow: no machine $m"
	# into the machine (the host end of its link) and out of it (its eth0)
	tc qdisc replace dev "$PFX-$m" root tbf rate "$rate" burst "$b" latency 200ms
	ip netns exec "$PFX-$m" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$b" latency 200ms
}

unslow() {
	local m=${1:?usage: unslow MEMBER}
	[ "$MODE" = netns ] || return 0
	tc qdisc del dev "$PFX-$m" root 2>/dev/null || true
	ip netns exec "$PFX-$m" tc qdisc del dev eth0 root 2>/dev/null || true
}

# ---- pauses, disks, clocks ---------------------------------------------------

pause() { signal_member "${1:?usage: pause MEMBER}" STOP; }
resume() { signal_member "${1:?usage: resume MEMBER}" CONT; }

fill_disk() {
	local m=${1:?usage: fill-disk MEMBER} mnt f left
	mnt=$(mount_of "$m")
	[ -n "$mnt" ] || die "fill-disk: $m has no data filesystem"
	mountpoint -q "$mnt" || die "fill-disk: $mnt is not a filesystem of its own (KETTLE_HA_FS=tmpfs or ext4)"
	f=$mnt/$PFX-fill
	# as much as is free at once, then the last blocks one by one
	fallocate -l "$(df -B1 --output=avail "$mnt" | tail -1 | tr -d ' ')" "$f" 2>/dev/null || true
	dd if=/dev/zero of="$f" bs=1M oflag=append conv=notrunc status=none 2>/dev/null || true
	dd if=/dev/zero of="$f" bs=4k oflag=append conv=notrunc status=none 2>/dev/null || true
	dd if=/dev/zero of="$f" bs=512 oflag=append conv=notrunc status=none 2>/dev/null || true
	sync -f "$f"
	left=$(df -B1 --output=avail "$mnt" | tail -1 | tr -d ' ')
	log "fill-disk $m: $mnt full ($left bytes left)"
}

free_disk() {
	local m=${1:?usage: free-disk MEMBER} mnt
	mnt=$(mount_of "$m")
	[ -n "$mnt" ] || die "free-disk: $m has no data filesystem"
	rm -f "$mnt/$PFX-fill"
}

# date_skew MEMBER: its clock minus this host's, in seconds, from the Date
# of its HTTP answer.
date_skew() {
	local d
	d=$(curl -sS -m 3 -o /dev/null -D - "http://$(addr_of "$1"):8080/healthz" | tr -d '\r' | sed -n 's/^[Dd]ate: //p')
	[ -n "$d" ] || return 1
	echo $(($(date -d "$d" +%s) - $(date +%s)))
}

# clock MEMBER OFFSET: restart the member under faketime -f OFFSET, and
# check from its answers that its clock took the offset.
clock() {
	local m=${1:?usage: clock MEMBER ±OFFSET} off=${2:?usage: clock MEMBER ±OFFSET} want got
	case "$m" in kettle[1-9] | writer) ;; *) die "clock: kettle nodes and the writer only" ;; esac
	command -v faketime >/dev/null || die "faketime not found: make deps (Debian faketime)"
	if [ "$off" = 0 ] || [ "$off" = +0 ]; then
		rm -f "$DIR/$m.clock"
		member stop "$m"
		member start "$m"
		return 0
	fi
	want=$(($(faketime -f "$off" date +%s) - $(date +%s))) || die "clock: '$off' is not an offset faketime -f takes (+1h, -30m)"
	echo "$off" >"$DIR/$m.clock"
	member stop "$m"
	member start "$m"
	got=$(date_skew "$m") || got=0
	if [ $((got - want)) -gt 60 ] || [ $((want - got)) -gt 60 ]; then
		rm -f "$DIR/$m.clock"
		member stop "$m"
		member start "$m"
		echo "cluster.sh: clock $m $off: not in force, $m is back on the true clock. Its answers' Date is ${got}s off this host's, not ${want}s: kettle is a Go program, whose runtime reads the clock through the kernel's vDSO (clock_gettime without libc), which faketime's LD_PRELOAD library cannot intercept" >&2
		exit 3
	fi
}

# faults: what is in force now, one line each.
faults() {
	local m mnt p st c
	if [ "$MODE" = netns ]; then
		{ nft list chain bridge "$PFX" cut_fwd 2>/dev/null || true; } | sed -n 's/.*comment "kf:[0-9a-f]* \(.*\)"$/\1/p' | sort -u
		for m in $(members_up); do
			tc qdisc show dev "$PFX-$m" 2>/dev/null | grep -q tbf && echo "slow $m $(tc qdisc show dev "$PFX-$m" | sed -n 's/.* rate \([^ ]*\).*/\1/p')"
		done
	fi
	if [ "$TOXI" = 1 ]; then
		for f in "$DIR"/toxi-*.json; do
			[ -e "$f" ] || continue
			m=$(basename "$f" .json)
			m=${m#toxi-}
			curl -fsS -m 3 "$(toxi_api "$m")/proxies" 2>/dev/null | M=$m python3 -c '
import json, os, sys
for n, p in sorted(json.load(sys.stdin).items()):
    for t in p.get("toxics", []):
        print("toxic %s@%s %s %s %s" % (n, os.environ["M"], t["type"], t["stream"], json.dumps(t["attributes"], sort_keys=True)))' || true
		done
	fi
	for m in $(members_up); do
		st=""
		for p in $(procs_of "$m"); do st="$st$(ps -o stat= -p "$p" 2>/dev/null | cut -c1)"; done
		[ -n "$st" ] && [ -z "${st//T/}" ] && echo "pause $m"
		mnt=$(mount_of "$m")
		[ -n "$mnt" ] && [ -e "$mnt/$PFX-fill" ] && echo "fill-disk $m"
		[ -s "$DIR/$m.clock" ] && echo "clock $m $(cat "$DIR/$m.clock")"
	done
	return 0
}

member() {
	local op=$1 m=${2:-}
	case "$op:$m" in
	start:etcd[1-3]) start_etcd "${m#etcd}" ;;
	start:pg[1-3]) start_pg "${m#pg}" ;;
	start:kettle[1-9]) start_kettle "${m#kettle}"; wait_for "$m" 60 http_ok "http://$NET.2${m#kettle}:8080/readyz" ;;
	start:haproxy) start_haproxy ;;
	start:kafka[1-3]) start_kafka_node "${m#kafka}" ;;
	start:writer) start_writer ;;
	start:worker[1-9] | start:worker[1-9][0-9]) start_worker "${m#worker}" ;;
	stop:pg[1-3]) stop_member "$m" TERM 30 ;;
	stop:kettle[1-9] | stop:writer) stop_member "$m" TERM 40 ;;
	stop:kafka[1-3]) stop_kafka_node "${m#kafka}" ;;
	stop:*) stop_member "$m" TERM 10 ;;
	# a machine that dies: every process of it at once
	kill:*) [ "$MODE" = netns ] && { addr_of "$m" >/dev/null; signal_member "$m" KILL || true; } ;;&
	kill:pg[1-3]) kill_pg "${m#pg}" ;;
	kill:kafka[1-3]) kafka_sh kill "$DIR/kafka" "${m#kafka}" ;;
	kill:*) stop_member "$m" KILL 5 ;;
	*) die "unknown member '$m' (etcd1-3, pg1-3, kettle1-9, haproxy, kafka1-3, writer, worker1-99)" ;;
	esac
}

stop_kafka_node() {
	local f=$DIR/kafka/node$1/pid p end=$((SECONDS + 20))
	p=$(cat "$f" 2>/dev/null || true)
	[ -n "$p" ] || return 0
	kill -TERM "$p" 2>/dev/null || true
	while kill -0 "$p" 2>/dev/null; do
		[ $SECONDS -lt $end ] || kill -KILL "$p" 2>/dev/null || true
		sleep 0.1
	done
	rm -f "$f"
}

case "${1:-}" in
up)
	[ "${2:-}" = --log ] && LOGMODE=1
	mkdir -p "$DIR"
	echo "$MODE" >"$DIR/mode"
	echo "$LOGMODE" >"$DIR/log-mode"
	echo "$TLS" >"$DIR/tls-mode"
	up
	;;
down) down ;;
status) status ;;
dsn) dsn ;;
ca) [ "$TLS" = 1 ] || die "ca: the topology runs without TLS (KETTLE_HA_TLS=0)"; echo "$TLSDIR/ca.crt" ;;
tls-args) tls_args ;;
renew-cert) renew_cert "${2:-}" ;;
leader) leader ;;
sync) role sync_standby ;;
healthy) healthy ;;
patronictl) shift; patronictl "$@" ;;
psql) shift; psql_leader "$@" ;;
start | stop | kill) member "$1" "${2:-}" ;;
workers) workers "${2:-}" ;;
worker-token) worker_token ;;
machines) machines ;;
partition) shift; partition "$@" ;;
unpartition) shift; unpartition "$@" ;;
partition-oneway) shift; partition_oneway "$@" ;;
unpartition-oneway) shift; unpartition_oneway "$@" ;;
isolate) isolate "${2:-}" ;;
unisolate) unisolate "${2:-}" ;;
heal) net_heal ;;
slow) slow "${2:-}" "${3:-}" ;;
unslow) unslow "${2:-}" ;;
pause) pause "${2:-}" || die "pause: ${2:-}: no process running" ;;
resume) resume "${2:-}" || die "resume: ${2:-}: no process running" ;;
fill-disk) fill_disk "${2:-}" ;;
free-disk) free_disk "${2:-}" ;;
clock) clock "${2:-}" "${3:-}" ;;
toxic) shift; toxic "$@" ;;
untoxic) untoxic "${2:-}" ;;
faults) faults ;;
*) sed -n '2,/^set -e/p' "$0" | sed -e '/^set -e/d' -e 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
