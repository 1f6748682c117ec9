#!/usr/bin/env bash
# The high-availability components (idempotent; root; `make deps` runs it):
# etcd and HAProxy from Debian, Patroni (pinned, deploy/deps/requirements-patroni.txt)
# in a virtualenv made with Debian's python3 at /opt/kettlefleet/venv-patroni,
# linked from .deps/venv-patroni. Patroni runs as the postgres OS user, who
# may not traverse a checkout's parents (mktemp -d makes them 0700), so the
# virtualenv lives outside any checkout. --check: exit 0 when all is there,
# 1 (naming what is missing) when not, without installing anything.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${KETTLE_HA_VENV_HOME:-/opt/kettlefleet/venv-patroni}
link=$repo/.deps/venv-patroni
req=$repo/deploy/deps/requirements-patroni.txt

pkgs="etcd-server etcd-client haproxy python3-venv postgresql curl"
. "$(dirname "$0")/apt.sh"
if [ "${1:-}" = --check ]; then
	# shellcheck disable=SC2086
	missing=$(apt_missing $pkgs)
	[ -z "$missing" ] || { echo "ha.sh: missing$missing"; exit 1; }
	cmp -s "$req" "$venv/.requirements" 2>/dev/null || { echo "ha.sh: Patroni virtualenv at $venv missing or not at $req's versions"; exit 1; }
	[ "$(readlink "$link")" = "$venv" ] || { echo "ha.sh: $link does not point at $venv"; exit 1; }
	exit 0
fi
# shellcheck disable=SC2086
apt_need "ha.sh" $pkgs
# The Debian packages start etcd and haproxy as services on their default
# ports; the topology of deploy/cluster.sh runs its own, elsewhere.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
	systemctl disable --now etcd haproxy >/dev/null 2>&1 || true
fi

# Rebuilt when the pins change (the stamp is a copy of the file installed).
if ! cmp -s "$req" "$venv/.requirements" 2>/dev/null; then
	echo "ha.sh: Patroni virtualenv at $venv"
	rm -rf "$venv"
	mkdir -p "$(dirname "$venv")"
	/usr/bin/python3 -m venv "$venv"
	"$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
	cp "$req" "$venv/.requirements"
fi
# Patroni runs as the postgres OS user: it must reach the venv.
chmod -R a+rX "$venv"
chmod a+rX "$(dirname "$venv")"
mkdir -p "$repo/.deps"
[ -L "$link" ] || rm -rf "$link"
ln -sfn "$venv" "$link"
"$venv/bin/patroni" --version
