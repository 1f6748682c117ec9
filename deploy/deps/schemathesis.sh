#!/bin/sh
# Installs schemathesis (the external OpenAPI fuzzer make test runs against a
# real kettle serve, httpapi/schemathesis_test.go) into .deps/venv-schemathesis.
# Idempotent: does nothing when the pinned version is already there.
# --check: exit 0 when it is there, 1 (naming what is missing) when not, at once.
set -eu
VERSION=4.32.5
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="$root/.deps/venv-schemathesis"
if [ "${1:-}" = --check ]; then
	# The wheel's metadata directory: no Python started, so the check is instant.
	ls -d "$venv"/lib/python3*/site-packages/schemathesis-"$VERSION".dist-info >/dev/null 2>&1 && [ -x "$venv/bin/st" ] && exit 0
	echo "deps: schemathesis $VERSION missing in $venv"
	exit 1
fi
if [ -x "$venv/bin/st" ] && "$venv/bin/pip" show schemathesis 2>/dev/null | grep -qx "Version: $VERSION"; then
	echo "deps: schemathesis $VERSION installed"
	exit 0
fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==$VERSION"
echo "deps: schemathesis $VERSION installed in $venv"
