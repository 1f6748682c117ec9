#!/usr/bin/env bash
# Throwaway PostgreSQL cluster for the bench/pg-*.sh benchmarks, from the
# installed binaries. Source it, then:
#
#   pg_start            # sets PG_DIR, PG_PORT, PG_DSN (URL, unix socket), PG_TCP_DSN
#   pg_stop             # fast shutdown and rm -rf; call it from your EXIT trap
#
# The server runs as the `postgres` OS user when we are root (initdb refuses
# root), listens on 127.0.0.1:<random port> and on a socket in PG_DIR, and
# trusts local connections. PG_EXTRA="-c name=value ..." adds settings.
#
# PG_WRITE_MBPS=N (root only): a slow disk for the database, the cluster's
# writes to the disk holding PG_DIR throttled to N MB/s (a blkio cgroup,
# cgroup v1, or io.max, cgroup v2, holding the postmaster; every process it
# starts later inherits it). WAL fsyncs and the checkpointer's writes then
# compete for N MB/s, as on a small cloud volume, while the rest of the
# machine writes at full speed.
#
# PG_WARM_WAL=MIB: before the run (and before any throttle), MIB MiB of WAL
# written and recycled by two checkpoints (pg_warm_wal), so that the fresh
# cluster writes its WAL into existing segment files as one in service does.
# A fresh cluster instead creates and zero-fills a new 16 MiB file every
# 16 MiB of WAL, with commits waiting on it: on a slow disk (PG_WRITE_MBPS=8)
# a stall of seconds at every new file (docs/performance.md).
#
# Benchmark settings (printed by pg_settings): durability stays ON
# (fsync, synchronous_commit, full_page_writes: an ack means durable); memory
# and checkpoints are sized so a 50M-row seeding is not dominated by
# checkpoint storms.

# Every script that sources this one records its run (bench/lib/record.sh).
. "$(dirname "${BASH_SOURCE[0]}")/record.sh"

PG_SETTINGS=(
	-c shared_buffers=${PG_SHARED_BUFFERS:-2GB}
	-c max_wal_size=${PG_MAX_WAL:-16GB}
	-c min_wal_size=1GB
	-c checkpoint_timeout=30min
	-c checkpoint_completion_target=0.9
	-c wal_buffers=64MB
	-c wal_compression=off
	-c synchronous_commit=on
	-c fsync=on
	-c full_page_writes=on
	-c max_connections=300
	-c maintenance_work_mem=512MB
	-c work_mem=32MB
	-c effective_cache_size=8GB
	-c random_page_cost=1.1
	-c log_min_messages=warning
	-c log_checkpoints=on
)

pg_bin() {
	local d
	if command -v initdb >/dev/null 2>&1; then dirname "$(readlink -f "$(command -v initdb)")"; return; fi
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -n | tail -1)
	[ -n "$d" ] || { echo "PostgreSQL binaries missing: apt-get install -y postgresql" >&2; return 1; }
	echo "$d"
}

pg_as() { # run as the postgres user when root
	if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_start() {
	local bin; bin=$(pg_bin) || return 1
	PG_DIR=$(mktemp -d /tmp/pgbench-XXXXXX)
	[ "$(id -u)" = 0 ] && chown postgres: "$PG_DIR"
	PG_BIN=$bin
	PG_PORT=${PG_PORT:-$(free_port)}
	pg_as "$bin/initdb" -D "$PG_DIR/data" -U postgres --auth=trust -E UTF8 --locale=C >"$PG_DIR/initdb.log" 2>&1 ||
		{ cat "$PG_DIR/initdb.log" >&2; return 1; }
	pg_as "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/postgres.log" -w -t 60 \
		-o "-c listen_addresses=127.0.0.1 -p $PG_PORT -c unix_socket_directories=$PG_DIR ${PG_SETTINGS[*]} ${PG_EXTRA:-}" start >/dev/null ||
		{ cat "$PG_DIR/postgres.log" >&2; return 1; }
	[ "${PG_WARM_WAL:-0}" = 0 ] || pg_warm_wal "$PG_WARM_WAL" || { pg_stop; return 1; }
	[ -z "${PG_WRITE_MBPS:-}" ] || pg_throttle "$PG_WRITE_MBPS" || { pg_stop; return 1; }
	PG_DSN="postgres://postgres@/postgres?host=$PG_DIR&port=$PG_PORT&sslmode=disable"
	PG_TCP_DSN="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
	export PG_DIR PG_PORT PG_DSN PG_TCP_DSN PG_BIN
}

# pg_db NAME: create database NAME and print its socket DSN.
pg_db() {
	"$PG_BIN/psql" -qAt -h "$PG_DIR" -p "$PG_PORT" -U postgres -d postgres -c "CREATE DATABASE $1" >/dev/null &&
		echo "postgres://postgres@/$1?host=$PG_DIR&port=$PG_PORT&sslmode=disable"
}

# pg_sql DB SQL: run SQL in DB, unaligned output.
pg_sql() { "$PG_BIN/psql" -qAt -X -h "$PG_DIR" -p "$PG_PORT" -U postgres -d "$1" -c "$2"; }

pg_settings() {
	echo "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') throwaway cluster in $PG_DIR, port $PG_PORT (127.0.0.1 + unix socket); settings changed from initdb defaults:"
	echo "  ${PG_SETTINGS[*]} ${PG_EXTRA:-}" | sed 's/-c //g'
	[ -z "${PG_WRITE_MBPS:-}" ] || echo "  disk writes throttled to $PG_WRITE_MBPS MB/s (PG_WRITE_MBPS)"
}

# pg_warm_wal MIB: MIB MiB of WAL written (non-transactional logical
# messages, no table) and two checkpoints, which recycle those segment files
# for future use (min_wal_size): the cluster then writes its WAL into
# existing files, as one long in service does, instead of creating and
# zero-filling (wal_init_zero) a new 16 MiB file every 16 MiB of WAL with
# commits waiting on it.
pg_warm_wal() {
	pg_sql postgres "SELECT count(pg_logical_emit_message(false, 'kettle-warm', repeat('x', 1048576))) FROM generate_series(1, $1)" >/dev/null &&
		pg_sql postgres CHECKPOINT && pg_sql postgres CHECKPOINT || return 1
	echo "PostgreSQL's WAL warmed: $1 MiB written and recycled, $(pg_sql postgres "SELECT count(*) FROM pg_ls_waldir()") segment files ready"
}

# pg_throttle MBPS: the running cluster's disk writes limited to MBPS MB/s
# (see PG_WRITE_MBPS); sets PG_CGROUP, removed by pg_stop.
pg_throttle() {
	local dev pk bps=$(($1 * 1000000)) pm
	[ "$(id -u)" = 0 ] || { echo "PG_WRITE_MBPS needs root (a cgroup)" >&2; return 1; }
	dev=$(findmnt -no MAJ:MIN -T "$PG_DIR" | tr -d ' ')
	pk=$(lsblk -no PKNAME "/dev/block/$dev" 2>/dev/null | head -1)
	[ -z "$pk" ] || dev=$(lsblk -dno MAJ:MIN "/dev/$pk" | tr -d ' ') # a partition: its disk
	pm=$(head -1 "$PG_DIR/data/postmaster.pid")
	if [ -d /sys/fs/cgroup/blkio ]; then
		PG_CGROUP=/sys/fs/cgroup/blkio/kettle-pg-$PG_PORT
		mkdir "$PG_CGROUP" && echo "$dev $bps" >"$PG_CGROUP/blkio.throttle.write_bps_device" ||
			{ echo "PG_WRITE_MBPS: cannot throttle through $PG_CGROUP (cgroup v1 blkio)" >&2; return 1; }
	elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
		PG_CGROUP=/sys/fs/cgroup/kettle-pg-$PG_PORT
		echo +io >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
		mkdir "$PG_CGROUP" && echo "$dev wbps=$bps" >"$PG_CGROUP/io.max" ||
			{ echo "PG_WRITE_MBPS: cannot throttle through $PG_CGROUP (cgroup v2 io.max; is the io controller enabled for it?)" >&2; return 1; }
	else
		echo "PG_WRITE_MBPS: no blkio (cgroup v1) or io (cgroup v2) controller here" >&2; return 1
	fi
	for p in $pm $(ps --ppid "$pm" -o pid=); do echo "$p" >"$PG_CGROUP/cgroup.procs" || return 1; done
	echo "PostgreSQL's disk writes throttled to $1 MB/s (device $dev, cgroup $PG_CGROUP)"
	export PG_CGROUP
}

pg_stop() {
	[ -n "${PG_DIR:-}" ] || return 0
	[ -d "$PG_DIR/data" ] && pg_as "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast -w -t 60 stop >/dev/null 2>&1
	[ -z "${PG_CGROUP:-}" ] || { rmdir "$PG_CGROUP" 2>/dev/null; PG_CGROUP=; }
	rm -rf "$PG_DIR"
	PG_DIR=
}

# pg_cpu: CPU seconds used by the cluster (postmaster, its processes and
# those it reaped); proc_cpu PID: CPU seconds of one process. On a shared
# machine the CPU cost per row is steadier than rows/s.
pg_cpu() { local pm t=0 p f; pm=$(head -1 "$PG_DIR/data/postmaster.pid")
	for p in $pm $(ps --ppid "$pm" -o pid=); do
		f=($(sed 's/.*) //' /proc/$p/stat 2>/dev/null)) || continue; [ ${#f[@]} -gt 15 ] || continue
		t=$((t + f[11] + f[12])); [ "$p" = "$pm" ] && t=$((t + f[13] + f[14]))
	done; awk -v t=$t -v h=$(getconf CLK_TCK) 'BEGIN { printf "%.2f", t/h }'; }
proc_cpu() { local f; f=($(sed 's/.*) //' /proc/$1/stat)); awk -v t=$((f[11] + f[12])) -v h=$(getconf CLK_TCK) 'BEGIN { printf "%.2f", t/h }'; }
# median: the median of the numbers on standard input, one a line.
median() { sort -n | awk '{ v[NR] = $1 } END { printf "%.3f", v[int((NR + 1) / 2)] }'; }
# machine_line [NOTE]: the machine, its load average and the time, printed
# at the top of every run (the load others put on this shared machine).
machine_line() { echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%M:%SZ)${1:+ $1}"; }
# free_port: a free TCP port on 127.0.0.1.
# build_kettle DIR: DIR/kettle, built from the tree or copied from
# KETTLE_BIN (a prebuilt kettle, e.g. when the working tree has unrelated
# work in progress).
build_kettle() { if [ -n "${KETTLE_BIN:-}" ]; then cp "$KETTLE_BIN" "$1/kettle"; else bench_build "$1/kettle" ./cmd/kettle; fi; }

# ab_start NAME A_BIN B_BIN: for an A/B script, a work dir (work) holding
# the two binaries as A and B, kpid for the kettle serve it runs (killed at
# exit, with the cluster stopped and the work dir removed), and the line
# naming the binaries.
ab_start() {
	work=$(mktemp -d "/tmp/kettle-$1-XXXXXX")
	cp "$2" "$work/A"; cp "$3" "$work/B"
	kpid=
	trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; pg_stop; rm -rf "$work"' EXIT
	echo "A=$2 ($(sha256sum "$2" | cut -c1-12))  B=$3 ($(sha256sum "$3" | cut -c1-12))"
}
# ab_ratios FILE KIND FIELD [KEY=VALUE]: B/A of FIELD in each round, one a
# line, from FILE's lines "AB KIND round=R bin=A|B KEY=VALUE…" (only those
# holding KEY=VALUE when given).
ab_ratios() {
	awk -v kind="$2" -v f="$3" -v sel="${4:-}" '$1 == "AB" && $2 == kind {
		delete kv; ok = sel == ""
		for (i = 3; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2]; if ($i == sel) ok = 1 }
		if (ok) { x[kv["round"], kv["bin"]] = kv[f]; n = kv["round"] > n ? kv["round"] : n } }
		END { for (i = 1; i <= n; i++) printf "%.3f\n", x[i, "B"] / x[i, "A"] }' "$1"; }

# ab_median FILE KIND FIELD BIN: the median over rounds of FIELD of BIN (A
# or B), from the same lines as ab_ratios.
ab_median() {
	awk -v kind="$2" -v f="$3" -v bin="$4" '$1 == "AB" && $2 == kind {
		for (i = 3; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
		if (kv["bin"] == bin) print kv[f] }' "$1" | median; }
# ab_record FILE KIND FIELD UNIT: rec_fig of FIELD's median for A and for
# B, and of the median of their ratios B/A.
ab_record() {
	rec_fig "A $2 $3" "$(ab_median "$1" "$2" "$3" A)" "$4"
	rec_fig "B $2 $3" "$(ab_median "$1" "$2" "$3" B)" "$4"
	rec_fig "B/A $2 $3, median of rounds" "$(ab_ratios "$1" "$2" "$3" | median)" ratio
}

# work_start NAME: a work dir (work) for a script that runs kettle serve
# ($kpid, killed at exit with the cluster stopped and the work dir removed).
work_start() {
	work=$(mktemp -d "/tmp/kettle-$1-XXXXXX")
	kpid=
	trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; pg_stop; rm -rf "$work"' EXIT
}
# kettle_serve NAME DSN: $work/kettle (or $SERVE_BIN) serve on DSN at 127.0.0.1:$PORT_K,
# its data dir $work/data-NAME, its log $work/serve-NAME.log; waits until
# ready. kettle_stop stops it; kettle_count NAME prints its statistics'
# measurement_count.
kettle_serve() {
	"${SERVE_BIN:-$work/kettle}" serve --addr 127.0.0.1:$PORT_K --db "$2" --data-dir "$work/data-$1" --log-level warn 2>"$work/serve-$1.log" &
	kpid=$!
	for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT_K/readyz" >/dev/null 2>&1 && return 0; sleep 0.1; done
	echo "not up"; cat "$work/serve-$1.log"; exit 1
}
kettle_stop() { kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=; }
kettle_count() { curl -s -H "Authorization: Bearer $(cat "$work/data-$1/operator-token")" "http://127.0.0.1:$PORT_K/v1/statistics" | sed -n 's/.*"measurement_count":\([0-9]*\).*/\1/p'; }
# pg_attach_month DB YYYY-MM-01: that month attached to DB's measurements
# as one partition, as a database made before day partitions holds them
# (kettle uses such a month as it is); kettle's schema is made first
# ($work/kettle expire opens the store, which migrates it, and finds
# nothing to expire), and the empty day partitions kettle made ahead
# inside the month are dropped.
pg_attach_month() {
	local name p next
	"$work/kettle" expire --db "postgres://postgres@/$1?host=$PG_DIR&port=$PG_PORT&sslmode=disable" --before 2000-01-01 >/dev/null
	name="measurements_y$(date -u -d "$2" +%Ym%m)"; next=$(date -u -d "$2 + 1 month" +%Y-%m-%d)
	for p in $(pg_sql "$1" "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass AND c.relname LIKE '${name}d%'"); do
		pg_sql "$1" "DROP TABLE $p" >/dev/null
	done
	pg_sql "$1" "CREATE TABLE $name (LIKE measurements INCLUDING DEFAULTS)" >/dev/null
	pg_sql "$1" "ALTER TABLE measurements ATTACH PARTITION $name FOR VALUES FROM ('${2}T00:00:00Z') TO ('${next}T00:00:00Z')" >/dev/null
}
