#!/usr/bin/env bash
# Apache Kafka for kettle serve --log and its tests: Debian's OpenJDK 17 and
# Maven, then the broker's jars by their Maven coordinates (pinned in
# deploy/kafka/pom.xml) into .deps/kafka/libs. Idempotent: a second run
# with the jars in place does nothing. --check: exit 0 when all is there,
# 1 (naming what is missing) when not, without installing anything.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
libs=$repo/.deps/kafka/libs
pom=$repo/deploy/kafka/pom.xml
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")

# The stamp holds the pom's checksum: the jars are those the pom names,
# whatever the files' times (a fresh checkout's pom is newer than any stamp).
stamp=$libs/.kettle-kafka-$version
sum=$(sha256sum "$pom" | cut -d' ' -f1)
current() { [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]; }
. "$(dirname "$0")/apt.sh"
if [ "${1:-}" = --check ]; then
	# shellcheck disable=SC2086
	missing=$(apt_missing openjdk-17-jre-headless maven)
	[ -z "$missing" ] || { echo "kafka deps: missing$missing"; exit 1; }
	current || { echo "kafka deps: Kafka $version jars missing in $libs (or not the pom's)"; exit 1; }
	exit 0
fi
# shellcheck disable=SC2086
apt_need "kafka deps" openjdk-17-jre-headless maven

if current; then
	echo "kafka deps: Kafka $version jars in $libs"
	exit 0
fi
echo "kafka deps: fetching org.apache.kafka:kafka_2.13:$version and its runtime dependencies into $libs"
rm -rf "$libs"
mkdir -p "$libs"
mvn -q -B -Dstyle.color=never -f "$pom" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$libs"
echo "$sum" >"$stamp"
echo "kafka deps: $(ls "$libs"/*.jar | wc -l) jars in $libs"
