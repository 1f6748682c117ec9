#!/usr/bin/env bash
# Three KRaft Kafka nodes (broker + controller each) on one host, from the
# jars `make deps` fetched into .deps/kafka/libs. Tests, benchmarks and
# make chaos call this script unchanged.
#
#   kafka.sh start DIR       format (first time) and start nodes 1-3, wait until they listen
#   kafka.sh stop DIR        SIGTERM every node, SIGKILL after 20 s
#   kafka.sh kill DIR N      SIGKILL node N (a crash, for fault tests)
#   kafka.sh pause DIR N     SIGSTOP node N (a hung machine: neither answers nor refuses)
#   kafka.sh resume DIR N    SIGCONT node N
#   kafka.sh start-node DIR N  start node N again (its data is kept)
#   kafka.sh stop-node DIR N   SIGTERM node N, SIGKILL after 20 s
#   kafka.sh status DIR      the nodes' pids, running or not
#   kafka.sh bootstrap       the bootstrap list, host:port,host:port,host:port
#   kafka.sh renew-cert DIR N  a new key and certificate for node N, then node N restarted
#                            (the other two serve meanwhile: a rolling renewal)
#
# TLS and SASL (KAFKA_TLS=1, the default): start makes a throwaway CA
# (KAFKA_TLS_DIR/ca.key, 0600) unless one is there, a certificate per node
# (its addresses as SANs, CN=kafkaN), and three SCRAM-SHA-512 users, their
# passwords in DIR/users/NAME.password (0600): admin (a super user, for
# the tools), front (may produce to and create the topics KAFKA_TOPIC_PREFIX…,
# read the offsets of the groups KAFKA_GROUP_PREFIX…) and writer (may consume
# those topics in those groups and commit). Clients reach the brokers over
# SASL_SSL (TLS, then SCRAM); brokers and controllers reach each other over
# TLS, each presenting its certificate (their principals User:CN=kafkaN are
# the other super users). The ACLs are added once, at the first start.
#
# Environment (defaults in brackets):
#   KAFKA_HOSTS   the nodes' addresses  [127.0.46.1 127.0.46.2 127.0.46.3]
#   KAFKA_PORT    client port           [9092]
#   KAFKA_CONTROLLER_PORT               [9093]
#   KAFKA_HEAP    each node's heap      [256m]
#   KAFKA_LIBS    the jars              [<repo>/.deps/kafka/libs]
#   KAFKA_NETNS   a network namespace per node, in the order of KAFKA_HOSTS,
#                 each node's JVM started in its own (deploy/cluster.sh's
#                 netns mode) [none: this host's]
#   KAFKA_CLIENT_HOSTS  where clients reach each node's CLIENT listener, in the
#                 order of KAFKA_HOSTS (a proxy's address); with it every node
#                 listens on KAFKA_CLIENT_PORT too, advertised there, while the
#                 brokers replicate over PLAINTEXT [none: no CLIENT listener]
#   KAFKA_CLIENT_PORT                   [KAFKA_PORT + 2]
#   KAFKA_TLS     1: TLS and SASL/SCRAM with ACLs (above); 0: PLAINTEXT everywhere [1]
#   KAFKA_TLS_DIR the CA and the nodes' certificates (deploy/cluster.sh: its topology's) [DIR/tls]
#   KAFKA_REPLICATION_PORT  the brokers' own listener with TLS  [KAFKA_PORT + 3]
#   KAFKA_TOPIC_PREFIX, KAFKA_GROUP_PREFIX  what the ACLs cover [kettle. and kettle-]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
read -r -a hosts <<<"${KAFKA_HOSTS:-127.0.46.1 127.0.46.2 127.0.46.3}"
port=${KAFKA_PORT:-9092}
cport=${KAFKA_CONTROLLER_PORT:-9093}
heap=${KAFKA_HEAP:-256m}
read -r -a netns <<<"${KAFKA_NETNS:-}"
read -r -a client_hosts <<<"${KAFKA_CLIENT_HOSTS:-}"
client_port=${KAFKA_CLIENT_PORT:-$((port + 2))}
libs=${KAFKA_LIBS:-$repo/.deps/kafka/libs}
tls=${KAFKA_TLS:-1}
case "$tls" in 0 | 1) ;; *) echo "kafka.sh: KAFKA_TLS=$tls: 1 or 0" >&2; exit 2 ;; esac
rport=${KAFKA_REPLICATION_PORT:-$((port + 3))}
topic_prefix=${KAFKA_TOPIC_PREFIX:-kettle.}
group_prefix=${KAFKA_GROUP_PREFIX:-kettle-}
users=(admin front writer)
# shellcheck source=deploy/tls.sh
. "$here/../tls.sh"

die() { echo "kafka.sh: $*" >&2; exit 1; }

need_libs() {
	[ -f "$libs/kafka_2.13-"*.jar ] 2>/dev/null || ls "$libs"/kafka_2.13-*.jar >/dev/null 2>&1 ||
		die "no Kafka jars in $libs: run make deps (deploy/deps/kafka.sh)"
	command -v java >/dev/null || die "no java on PATH: run make deps (installs openjdk-17-jre-headless)"
}

bootstrap() {
	local out="" h
	for h in "${hosts[@]}"; do out+="${out:+,}$h:$port"; done
	echo "$out"
}

voters() {
	local out="" i=1 h
	for h in "${hosts[@]}"; do out+="${out:+,}$i@$h:$cport"; i=$((i + 1)); done
	echo "$out"
}

# node_conf DIR N writes DIR/nodeN/server.properties: broker.properties
# plus this node's id, addresses and data directory.
node_conf() {
	local dir=$1 n=$2 h=${hosts[$(($2 - 1))]}
	mkdir -p "$dir/node$n"
	{
		cat "$here/broker.properties"
		echo
		echo "# node $n (written by kafka.sh)"
		echo "node.id=$n"
		echo "controller.quorum.voters=$(voters)"
		if [ "$tls" = 1 ]; then
			tls_conf "$dir" "$n" "$h"
		elif [ ${#client_hosts[@]} -gt 0 ]; then
			echo "listeners=PLAINTEXT://$h:$port,CONTROLLER://$h:$cport,CLIENT://$h:$client_port"
			echo "advertised.listeners=PLAINTEXT://$h:$port,CLIENT://${client_hosts[$(($n - 1))]}:$client_port"
		else
			echo "listeners=PLAINTEXT://$h:$port,CONTROLLER://$h:$cport"
			echo "advertised.listeners=PLAINTEXT://$h:$port"
		fi
		echo "log.dirs=$dir/node$n/data"
	} >"$dir/node$n/server.properties"
}

tlsdir() { echo "${KAFKA_TLS_DIR:-$1/tls}"; }

# tls_conf DIR N HOST: node N's listeners with TLS. CLIENT (KAFKA_PORT) and
# PROXIED (KAFKA_CLIENT_PORT, advertised at the proxy's address) take
# clients over SASL_SSL; REPLICATION and CONTROLLER are the nodes' own,
# over TLS with a certificate on both sides.
tls_conf() {
	local dir=$1 n=$2 h=$3 td l a i supers="User:admin"
	td=$(tlsdir "$dir")
	for i in $(seq 1 ${#hosts[@]}); do supers="$supers;User:CN=kafka$i"; done
	l="CLIENT://$h:$port,CONTROLLER://$h:$cport,REPLICATION://$h:$rport"
	a="CLIENT://$h:$port,REPLICATION://$h:$rport"
	if [ ${#client_hosts[@]} -gt 0 ]; then
		l="$l,PROXIED://$h:$client_port"
		a="$a,PROXIED://${client_hosts[$(($n - 1))]}:$client_port"
	fi
	cat <<-EOF
		listeners=$l
		advertised.listeners=$a
		listener.security.protocol.map=CLIENT:SASL_SSL,PROXIED:SASL_SSL,REPLICATION:SSL,CONTROLLER:SSL
		inter.broker.listener.name=REPLICATION
		sasl.enabled.mechanisms=SCRAM-SHA-512
		listener.name.client.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
		listener.name.proxied.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
		ssl.keystore.type=PEM
		ssl.keystore.location=$dir/node$n/tls.pem
		ssl.truststore.type=PEM
		ssl.truststore.location=$td/ca.crt
		ssl.endpoint.identification.algorithm=https
		listener.name.replication.ssl.client.auth=required
		listener.name.controller.ssl.client.auth=required
		authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
		super.users=$supers
	EOF
}

# tls_node DIR N [renew]: node N's key and certificate (KAFKA_TLS_DIR/kafkaN.*,
# made when missing), and DIR/nodeN/tls.pem, the key and the certificate in
# one file as Kafka's PEM keystore reads them.
tls_node() {
	local dir=$1 n=$2 renew=${3:-} td i=$(($2 - 1))
	[ "$tls" = 1 ] || return 0
	td=$(tlsdir "$dir")
	tls_make_ca "$td" "kettlefleet Kafka CA $(basename "$dir")" || die "no CA in $td"
	if [ -n "$renew" ] || [ ! -s "$td/kafka$n.crt" ]; then
		# shellcheck disable=SC2046
		tls_issue "$td" "kafka$n" "$(id -un)" "$(tls_sans "${hosts[$i]}" $([ ${#client_hosts[@]} -gt 0 ] && echo "${client_hosts[$i]}") 127.0.0.1 "kafka$n")" ||
			die "no certificate for node $n"
	fi
	mkdir -p "$dir/node$n"
	(umask 077; cat "$td/kafka$n.key" "$td/kafka$n.crt" >"$dir/node$n/tls.pem.new")
	mv -f "$dir/node$n/tls.pem.new" "$dir/node$n/tls.pem"
}

# tls_users DIR: each user's password (DIR/users/NAME.password, 0600) and
# client properties for the tools (DIR/users/NAME.properties, 0600).
tls_users() {
	local dir=$1 u td
	td=$(tlsdir "$dir")
	mkdir -p "$dir/users"
	chmod 700 "$dir/users"
	for u in "${users[@]}"; do
		[ -s "$dir/users/$u.password" ] || (umask 077; head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$dir/users/$u.password")
		(umask 077; cat >"$dir/users/$u.properties" <<-EOF
			security.protocol=SASL_SSL
			sasl.mechanism=SCRAM-SHA-512
			sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$u" password="$(cat "$dir/users/$u.password")";
			ssl.truststore.type=PEM
			ssl.truststore.location=$td/ca.crt
		EOF
		)
	done
}

# scram_args DIR: format's --add-scram for every user.
scram_args() {
	local u
	[ "$tls" = 1 ] || return 0
	for u in "${users[@]}"; do printf '%s\n' --add-scram "SCRAM-SHA-512=[name=$u,password=$(cat "$1/users/$u.password")]"; done
}

# acl DIR ARGS…: AclCommand as admin, again while the cluster is not ready for it.
acl() {
	local dir=$1 try; shift
	for try in 1 2 3 4 5; do
		# shellcheck disable=SC2046
		java $(java_opts) -XX:TieredStopAtLevel=1 -cp "$libs/*" org.apache.kafka.tools.AclCommand --bootstrap-server "$(bootstrap)" \
			--command-config "$dir/users/admin.properties" --add --force --resource-pattern-type prefixed "$@" >>"$dir/acls.log" 2>&1 && return 0
		sleep 1
	done
	tail -20 "$dir/acls.log" >&2
	die "AclCommand $* failed (log: $dir/acls.log)"
}

# acls DIR: the fronts' and the writers' ACLs, once.
acls() {
	local dir=$1 p=()
	[ "$tls" = 1 ] || return 0
	[ -f "$dir/acls.done" ] && return 0
	# side by side: each is a JVM start
	acl "$dir" --producer --allow-principal User:front --topic "$topic_prefix" & p+=($!)
	acl "$dir" --consumer --allow-principal User:writer --topic "$topic_prefix" --group "$group_prefix" & p+=($!)
	# both create the topic when it is missing and read its configuration
	# (EnsureTopic); the fronts read the writers' committed offsets (their lag)
	acl "$dir" --allow-principal User:front --allow-principal User:writer --operation Describe --operation DescribeConfigs \
		--topic "$topic_prefix" --group "$group_prefix" & p+=($!)
	acl "$dir" --allow-principal User:writer --operation Create --topic "$topic_prefix" & p+=($!)
	for i in "${p[@]}"; do wait "$i" || die "the ACLs were not added (log: $dir/acls.log)"; done
	touch "$dir/acls.done"
}

java_opts() {
	# Serial GC: one collector thread, no concurrent marking on 2 cores.
	echo "-Xms$heap -Xmx$heap -XX:+UseSerialGC -XX:MaxMetaspaceSize=128m -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true -Dlog4j2.configurationFile=$here/log4j2.yaml"
}

format() {
	local dir=$1 n=$2 id scram=()
	id=$(cat "$dir/cluster.id")
	mapfile -t scram < <(scram_args "$dir")
	# A short-lived JVM: the C1 compiler only (starts faster, no C2 threads).
	# shellcheck disable=SC2046
	java $(java_opts) -XX:TieredStopAtLevel=1 -cp "$libs/*" kafka.tools.StorageTool format --ignore-formatted \
		--cluster-id="$id" --config="$dir/node$n/server.properties" "${scram[@]}" >"$dir/node$n/format.log" 2>&1 ||
		{ cat "$dir/node$n/format.log" >&2; die "format node $n failed"; }
}

pid_of() { cat "$1/node$2/pid" 2>/dev/null || true; }

running() {
	local pid
	pid=$(pid_of "$1" "$2")
	[ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

start_node() {
	local dir=$1 n=$2
	running "$dir" "$n" && return 0
	tls_node "$dir" "$n"
	node_conf "$dir" "$n"
	[ -f "$dir/node$n/data/meta.properties" ] || format "$dir" "$n"
	local pre=()
	[ ${#netns[@]} -gt 0 ] && pre=(ip netns exec "${netns[$(($n - 1))]}")
	# shellcheck disable=SC2046
	setsid "${pre[@]}" java $(java_opts) -cp "$libs/*" kafka.Kafka "$dir/node$n/server.properties" \
		>>"$dir/node$n/kafka.log" 2>&1 </dev/null &
	echo $! >"$dir/node$n/pid"
}

stop_node() {
	local dir=$1 n=$2 pid
	pid=$(pid_of "$dir" "$n")
	[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && kill -CONT "$pid" 2>/dev/null || true
	for _ in $(seq 1 200); do running "$dir" "$n" || break; sleep 0.1; done
	if running "$dir" "$n"; then kill -9 "$(pid_of "$dir" "$n")" 2>/dev/null || true; fi
	rm -f "$dir/node$n/pid"
}

wait_listening() {
	local dir=$1 n=$2 h=${hosts[$(($2 - 1))]} i
	for i in $(seq 1 600); do
		if (exec 3<>"/dev/tcp/$h/$port") 2>/dev/null; then return 0; fi
		running "$dir" "$n" || { tail -20 "$dir/node$n/kafka.log" >&2; die "node $n exited while starting (log: $dir/node$n/kafka.log)"; }
		sleep 0.1
	done
	die "node $n not listening on $h:$port after 60 s (log: $dir/node$n/kafka.log)"
}

cmd=${1:-}
dir=${2:-}
case "$cmd" in
bootstrap) bootstrap; exit 0 ;;
start | stop | kill | pause | resume | start-node | stop-node | status | renew-cert) [ -n "$dir" ] || die "usage: kafka.sh $cmd DIR" ;;
*) die "usage: kafka.sh start|stop|kill|pause|resume|start-node|stop-node|status|renew-cert|bootstrap DIR [N]" ;;
esac
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# The nodes keep the mode they were started in.
[ -z "${KAFKA_TLS:-}" ] && [ -s "$dir/tls-mode" ] && tls=$(cat "$dir/tls-mode")

case "$cmd" in
start)
	need_libs
	# A cluster id is a UUID in URL-safe base64, 22 characters; one that
	# starts with '-' would read as an option, so it is drawn again.
	[ -s "$dir/cluster.id" ] || python3 -c '
import base64, uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not s.startswith("-"):
        print(s)
        break' >"$dir/cluster.id"
	echo "$tls" >"$dir/tls-mode"
	[ "$tls" = 1 ] && tls_users "$dir"
	# Format the three in parallel: each is a JVM start.
	pids=()
	for n in $(seq 1 ${#hosts[@]}); do
		tls_node "$dir" "$n"
		node_conf "$dir" "$n"
		if [ ! -f "$dir/node$n/data/meta.properties" ]; then format "$dir" "$n" & pids+=($!); fi
	done
	for p in "${pids[@]}"; do wait "$p"; done
	for n in $(seq 1 ${#hosts[@]}); do start_node "$dir" "$n"; done
	for n in $(seq 1 ${#hosts[@]}); do wait_listening "$dir" "$n"; done
	acls "$dir"
	echo "kafka: ${#hosts[@]} nodes listening on $(bootstrap) (data and logs in $dir$([ "$tls" = 1 ] && echo "; TLS, SCRAM users in $dir/users"))"
	;;
start-node)
	need_libs
	n=${3:?usage: kafka.sh start-node DIR N}
	start_node "$dir" "$n"
	wait_listening "$dir" "$n"
	;;
kill)
	n=${3:?usage: kafka.sh kill DIR N}
	pid=$(pid_of "$dir" "$n")
	[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
	;;
pause | resume)
	n=${3:?usage: kafka.sh $cmd DIR N}
	pid=$(pid_of "$dir" "$n")
	[ -n "$pid" ] || die "node $n has no pid file in $dir"
	if [ "$cmd" = pause ]; then kill -STOP "$pid"; else kill -CONT "$pid"; fi
	;;
stop)
	for n in $(seq 1 ${#hosts[@]}); do
		pid=$(pid_of "$dir" "$n")
		# a paused node acts on SIGTERM only once it runs again
		[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && kill -CONT "$pid" 2>/dev/null || true
	done
	for n in $(seq 1 ${#hosts[@]}); do
		for _ in $(seq 1 200); do running "$dir" "$n" || break; sleep 0.1; done
		if running "$dir" "$n"; then kill -9 "$(pid_of "$dir" "$n")" 2>/dev/null || true; fi
		rm -f "$dir/node$n/pid"
	done
	;;
renew-cert)
	n=${3:?usage: kafka.sh renew-cert DIR N}
	[ "$tls" = 1 ] || die "renew-cert: KAFKA_TLS=0"
	tls_node "$dir" "$n" renew
	stop_node "$dir" "$n"
	start_node "$dir" "$n"
	wait_listening "$dir" "$n"
	;;
stop-node)
	stop_node "$dir" "${3:?usage: kafka.sh stop-node DIR N}"
	;;
status)
	for n in $(seq 1 ${#hosts[@]}); do
		if running "$dir" "$n"; then echo "node $n: running, pid $(pid_of "$dir" "$n")"; else echo "node $n: stopped"; fi
	done
	;;
esac
