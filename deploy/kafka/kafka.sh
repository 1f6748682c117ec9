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
#   kafka.sh status DIR      the nodes' pids, running or not
#   kafka.sh bootstrap       the bootstrap list, host:port,host:port,host:port
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
		if [ ${#client_hosts[@]} -gt 0 ]; then
			echo "listeners=PLAINTEXT://$h:$port,CONTROLLER://$h:$cport,CLIENT://$h:$client_port"
			echo "advertised.listeners=PLAINTEXT://$h:$port,CLIENT://${client_hosts[$(($n - 1))]}:$client_port"
		else
			echo "listeners=PLAINTEXT://$h:$port,CONTROLLER://$h:$cport"
			echo "advertised.listeners=PLAINTEXT://$h:$port"
		fi
		echo "log.dirs=$dir/node$n/data"
	} >"$dir/node$n/server.properties"
}

java_opts() {
	# Serial GC: one collector thread, no concurrent marking on 2 cores.
	echo "-Xms$heap -Xmx$heap -XX:+UseSerialGC -XX:MaxMetaspaceSize=128m -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true -Dlog4j2.configurationFile=$here/log4j2.yaml"
}

format() {
	local dir=$1 n=$2 id
	id=$(cat "$dir/cluster.id")
	# A short-lived JVM: the C1 compiler only (starts faster, no C2 threads).
	# shellcheck disable=SC2046
	java $(java_opts) -XX:TieredStopAtLevel=1 -cp "$libs/*" kafka.tools.StorageTool format --ignore-formatted \
		--cluster-id="$id" --config="$dir/node$n/server.properties" >"$dir/node$n/format.log" 2>&1 ||
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
	node_conf "$dir" "$n"
	[ -f "$dir/node$n/data/meta.properties" ] || format "$dir" "$n"
	local pre=()
	[ ${#netns[@]} -gt 0 ] && pre=(ip netns exec "${netns[$(($n - 1))]}")
	# shellcheck disable=SC2046
	setsid "${pre[@]}" java $(java_opts) -cp "$libs/*" kafka.Kafka "$dir/node$n/server.properties" \
		>>"$dir/node$n/kafka.log" 2>&1 </dev/null &
	echo $! >"$dir/node$n/pid"
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
start | stop | kill | pause | resume | start-node | status) [ -n "$dir" ] || die "usage: kafka.sh $cmd DIR" ;;
*) die "usage: kafka.sh start|stop|kill|pause|resume|start-node|status|bootstrap DIR [N]" ;;
esac
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

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
	# Format the three in parallel: each is a JVM start.
	pids=()
	for n in $(seq 1 ${#hosts[@]}); do
		node_conf "$dir" "$n"
		if [ ! -f "$dir/node$n/data/meta.properties" ]; then format "$dir" "$n" & pids+=($!); fi
	done
	for p in "${pids[@]}"; do wait "$p"; done
	for n in $(seq 1 ${#hosts[@]}); do start_node "$dir" "$n"; done
	for n in $(seq 1 ${#hosts[@]}); do wait_listening "$dir" "$n"; done
	echo "kafka: ${#hosts[@]} nodes listening on $(bootstrap) (data and logs in $dir)"
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
status)
	for n in $(seq 1 ${#hosts[@]}); do
		if running "$dir" "$n"; then echo "node $n: running, pid $(pid_of "$dir" "$n")"; else echo "node $n: stopped"; fi
	done
	;;
esac
