#!/usr/bin/env bash
# What deploy/cluster.sh's netns mode and its faults need (idempotent; root;
# `make deps` runs it): iproute2 (namespaces, veths, the bridge, tc tbf),
# nftables (partitions), e2fsprogs and util-linux (the members' filesystems,
# loop devices), faketime (clock) from Debian, and Toxiproxy's server (latency,
# jitter, resets on the proxied links), built from its pinned Go module into
# .deps/bin/toxiproxy-server.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
toxiproxy_version=v2.5.0
bin=$repo/.deps/bin

pkgs="iproute2 nftables e2fsprogs util-linux mount faketime curl python3"
stamp=$bin/.toxiproxy-$toxiproxy_version
. "$(dirname "$0")/apt.sh"
if [ "${1:-}" = --check ]; then
	# shellcheck disable=SC2086
	missing=$(apt_missing $pkgs)
	[ -z "$missing" ] || { echo "machines.sh: missing$missing"; exit 1; }
	[ -x "$bin/toxiproxy-server" ] && [ -f "$stamp" ] || { echo "machines.sh: toxiproxy-server $toxiproxy_version not in $bin"; exit 1; }
	exit 0
fi
# shellcheck disable=SC2086
apt_need "machines.sh" $pkgs

if [ -x "$bin/toxiproxy-server" ] && [ -f "$stamp" ]; then
	echo "machines.sh: toxiproxy-server $toxiproxy_version in $bin"
	exit 0
fi
echo "machines.sh: building github.com/Shopify/toxiproxy/v2/cmd/server@$toxiproxy_version into $bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# go install names the binary after its directory (server); outside any
# module, so the checkout's go.mod does not take it in.
(cd "$tmp" && GOBIN=$tmp GOFLAGS=-mod=mod go install \
	-ldflags "-X github.com/Shopify/toxiproxy/v2.Version=${toxiproxy_version#v}" \
	"github.com/Shopify/toxiproxy/v2/cmd/server@$toxiproxy_version")
mkdir -p "$bin"
rm -f "$bin"/.toxiproxy-*
mv "$tmp/server" "$bin/toxiproxy-server"
touch "$stamp"
"$bin/toxiproxy-server" -version
