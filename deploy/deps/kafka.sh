#!/usr/bin/env bash
# Apache Kafka for kettle serve --log and its tests: Debian's OpenJDK 17 and
# Maven, then the broker's jars by their Maven coordinates (pinned in
# deploy/kafka/pom.xml) into .deps/kafka/libs. Idempotent: a second run
# with the jars in place does nothing.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
libs=$repo/.deps/kafka/libs
pom=$repo/deploy/kafka/pom.xml
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")

. "$(dirname "$0")/apt.sh"
apt_need "kafka deps" openjdk-17-jre-headless maven

stamp=$libs/.kettle-kafka-$version
if [ -f "$stamp" ] && [ "$stamp" -nt "$pom" ]; then
	echo "kafka deps: Kafka $version jars in $libs"
	exit 0
fi
echo "kafka deps: fetching org.apache.kafka:kafka_2.13:$version and its runtime dependencies into $libs"
rm -rf "$libs"
mkdir -p "$libs"
mvn -q -B -Dstyle.color=never -f "$pom" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$libs"
touch "$stamp"
echo "kafka deps: $(ls "$libs"/*.jar | wc -l) jars in $libs"
