# Sourced by the deploy/deps scripts: apt_need WHO PKG… installs the Debian
# packages of the list that are not installed yet (one apt-get update, only
# when something is missing).
apt_need() {
	local who=$1 p missing=""
	shift
	for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
	[ -n "$missing" ] || return 0
	echo "$who: installing:$missing"
	apt-get update -qq
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
}

# apt_missing PKG… prints the packages of the list that are not installed
# (a leading space before each), for the scripts' --check.
apt_missing() {
	local p
	for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || printf ' %s' "$p"; done
}
