# shellcheck shell=bash
# A throwaway CA and the certificates it signs, for deploy/cluster.sh and
# deploy/kafka/kafka.sh (sourced by both). Keys are EC P-256, made by
# openssl, 0600; certificates 30 days, for a server and a client both
# (members are both to each other), their addresses as SANs.

# tls_make_ca DIR LABEL: DIR/ca.key (0600) and DIR/ca.crt, unless there.
tls_make_ca() {
	local d=$1 label=$2
	[ -s "$d/ca.crt" ] && return 0
	mkdir -p "$d"
	chmod 755 "$d"
	(umask 077; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
		-subj "/CN=$label" -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
		-keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null) || { echo "openssl could not make a CA in $d" >&2; return 1; }
	chmod 644 "$d/ca.crt"
}

# tls_issue DIR NAME OWNER SANS: DIR/NAME.key (0600, OWNER's) and
# DIR/NAME.crt (CN=NAME, subjectAltName SANS, e.g. IP:10.0.0.1,DNS:pg1),
# signed by DIR's CA; each file replaced whole, so a reader mid-renewal sees
# the old pair or the new.
tls_issue() {
	local d=$1 name=$2 owner=$3 sans=$4
	(umask 077; openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
		-keyout "$d/$name.key.new" -out "$d/$name.csr" 2>/dev/null) || { echo "openssl: key of $name" >&2; return 1; }
	openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
		-days 30 -out "$d/$name.crt.new" -extfile <(printf '%s\n' "subjectAltName=$sans" basicConstraints=critical,CA:FALSE \
		keyUsage=critical,digitalSignature extendedKeyUsage=serverAuth,clientAuth) 2>/dev/null ||
		{ echo "openssl: certificate of $name" >&2; return 1; }
	chown "$owner:" "$d/$name.key.new"
	chmod 644 "$d/$name.crt.new"
	mv -f "$d/$name.key.new" "$d/$name.key"
	mv -f "$d/$name.crt.new" "$d/$name.crt"
	rm -f "$d/$name.csr"
}

# tls_sans ADDR…: "IP:a,IP:b,…" (names that are not addresses as DNS:), each once.
tls_sans() {
	local a
	for a in "$@"; do
		if [[ "$a" =~ ^[0-9.]+$ || "$a" == *:* ]]; then echo "IP:$a"; else echo "DNS:$a"; fi
	done | sort -u | paste -sd,
}
