#!/usr/bin/env bash
# make release: static kettle binaries for linux/amd64 and linux/arm64, one
# tarball each and SHA256SUMS, in dist/ (or $1). Reproducible: -trimpath, no
# build id, no VCS stamp from the toolchain, the date is the commit's time,
# tarballs with sorted names, fixed owners and mtimes, gzip without a name or
# time — so two builds of one commit are byte for byte the same
# (deploy/dist's TestReleaseReproducible).
#
# SQLite is C (mattn/go-sqlite3 through cgo): amd64 links with the host's gcc,
# arm64 with Debian's cross compiler (gcc-aarch64-linux-gnu, `make deps`);
# both statically against glibc, with the pure-Go user and DNS lookups
# (osusergo, netgo) so nothing is loaded at run time.
#
# Environment: VERSION [git describe, else 0.0.0-dev], ARCHES [amd64 arm64],
# GO [go].
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(realpath -m "${1:-$repo/dist}")
cd "$repo"
GO=${GO:-go}
ARCHES=${ARCHES:-amd64 arm64}
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit-dirty"; fi
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
date=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
VERSION=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo 0.0.0-dev)}
VERSION=${VERSION#v}

cc_for() {
	case $1 in
	amd64) echo "${CC_amd64:-gcc}" ;;
	arm64) echo "${CC_arm64:-aarch64-linux-gnu-gcc}" ;;
	*) echo "release.sh: no C cross compiler known for $1" >&2; return 1 ;;
	esac
}

mkdir -p "$out"
rm -f "$out"/kettle_*.tar.gz "$out/SHA256SUMS"
for arch in $ARCHES; do
	cc=$(cc_for "$arch")
	command -v "$cc" >/dev/null || { echo "release.sh: $cc not found: make deps (Debian gcc-aarch64-linux-gnu)" >&2; exit 1; }
	name=kettle_${VERSION}_linux_$arch
	stage=$out/$name
	rm -rf "$stage"
	mkdir -p "$stage"
	CGO_ENABLED=1 GOOS=linux GOARCH=$arch CC=$cc \
		"$GO" build -trimpath -buildvcs=false -tags 'osusergo netgo sqlite_omit_load_extension' \
		-ldflags "-s -w -buildid= -linkmode external -extldflags '-static -Wl,--build-id=none' -X main.version=$VERSION -X main.commit=$commit -X main.date=$date" \
		-o "$stage/kettle" ./cmd/kettle
	cp LICENSE* README.md "$stage/" 2>/dev/null || cp README.md "$stage/"
	mkdir -p "$stage/systemd"
	cp deploy/systemd/*.service "$stage/systemd/" 2>/dev/null || true
	touch -d "@$epoch" "$stage" "$stage"/* "$stage"/systemd/* 2>/dev/null || true
	tar -C "$out" --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner --mode='u+rwX,go+rX,go-w' \
		-cf - "$name" | gzip -n -9 >"$out/$name.tar.gz"
	cp "$stage/kettle" "$out/kettle_linux_$arch"
	rm -rf "$stage"
done
(cd "$out" && sha256sum kettle_*.tar.gz kettle_linux_* >SHA256SUMS)
cat "$out/SHA256SUMS"
