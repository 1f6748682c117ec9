# Sourced by bench/sizing.sh with PROFILE=DIR: where a node's and its
# primary's time goes under the sizing load, written to DIR. Needs the
# topology of deploy/cluster.sh up, $leader (pgN), KETTLE_HA_DIR,
# KETTLE_HA_NET, KETTLE_BIN, DURATION, and kettle serve on
# $KETTLE_HA_NET.21 with --debug-addr $KETTLE_HA_NET.21:6060.
#   PROFILE_SECONDS (8): each sample's length; PROFILE_WARMUP (DURATION/4).

PGBIN_DIR=${KETTLE_HA_PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
PATRONICTL=${KETTLE_HA_VENV:-$REC_ROOT/.deps/venv-patroni}/bin/patronictl

# profile_prepare: pg_stat_statements loaded (a restart of the members,
# the primary staying the primary), its counters and pg_stat_wal reset.
profile_prepare() {
	mkdir -p "$PROFILE"
	"$PATRONICTL" -c "$KETTLE_HA_DIR/$leader.yml" edit-config --force --pg shared_preload_libraries=pg_stat_statements >"$PROFILE/patroni.txt" 2>&1 || echo "profile: patronictl edit-config failed ($PROFILE/patroni.txt)" >&2
	"$PATRONICTL" -c "$KETTLE_HA_DIR/$leader.yml" restart kettle --force >>"$PROFILE/patroni.txt" 2>&1 || echo "profile: patronictl restart failed ($PROFILE/patroni.txt)" >&2
	for _ in $(seq 120); do
		deploy/cluster.sh psql -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" -c "SELECT count(*) FROM pg_stat_statements" >/dev/null 2>&1 &&
			curl -fsS -m 1 "http://$KETTLE_HA_NET.21:8080/readyz" >/dev/null 2>&1 && break
		sleep 0.5
	done
	[ "$(deploy/cluster.sh leader)" = "$leader" ] || { echo "profile: the primary changed on restart" >&2; return 1; }
	deploy/cluster.sh psql -c "SELECT pg_stat_reset_shared('wal')" -c "SELECT pg_stat_statements_reset()" >/dev/null || true
}

# profile_during: in the run's middle, kettle serve's CPU profile beside
# perf of the primary's processes, then its execution trace, then strace -c
# of both at once.
profile_during() {
	local s=${PROFILE_SECONDS:-8} kpid pm pgpids a b
	sleep "${PROFILE_WARMUP:-$(( ${DURATION%s} / 4 ))}"
	kpid=$(cat "$KETTLE_HA_DIR/kettle1.pid")
	pm=$(head -1 "$KETTLE_HA_DIR/$leader/data/postmaster.pid")
	pgpids=$(pgrep -P "$pm" | paste -sd,)
	curl -fsS "http://$KETTLE_HA_NET.21:6060/debug/pprof/profile?seconds=$s" -o "$PROFILE/cpu.pprof" & a=$!
	perf record -q -F 499 -g -p "$pm,$pgpids" -o "$PROFILE/pg.perf" -- sleep "$s" >/dev/null 2>&1 & b=$!
	wait "$a" "$b" || true
	curl -fsS "http://$KETTLE_HA_NET.21:6060/debug/pprof/trace?seconds=2" -o "$PROFILE/trace.out"
	timeout -s INT "$s" strace -c -f -p "$kpid" -o "$PROFILE/strace-serve.txt" 2>/dev/null & a=$!
	# shellcheck disable=SC2046
	timeout -s INT "$s" strace -c -f $(echo "$pm,$pgpids" | tr ',' '\n' | sed 's/^/-p /') -o "$PROFILE/strace-primary.txt" 2>/dev/null & b=$!
	wait "$a" "$b" || true
}

# profile_after BEFORE AFTER (sizing.sh's state JSON): the statements, the
# WAL by record type between the two positions, and the profiles as tops.
profile_after() {
	local d=$PROFILE
	wal_profile "$d" "$1" "$2"
	deploy/cluster.sh psql -P footer=off -F ' | ' -c "SELECT calls, round(total_exec_time::numeric, 1) AS total_ms, round(mean_exec_time::numeric, 3) AS mean_ms, rows, wal_records, wal_fpi, wal_bytes, left(regexp_replace(query, '\s+', ' ', 'g'), 110) FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 25" >"$d/statements.txt"
	deploy/cluster.sh psql -x -c "SELECT * FROM pg_stat_wal" >"$d/pg_stat_wal.txt"
	go tool pprof -top -nodecount=45 "$KETTLE_BIN" "$d/cpu.pprof" >"$d/cpu-top.txt" 2>&1 || true
	go tool pprof -top -cum -nodecount=60 "$KETTLE_BIN" "$d/cpu.pprof" >"$d/cpu-cum.txt" 2>&1 || true
	for k in net sync syscall sched; do
		go tool trace -pprof="$k" "$d/trace.out" >"$d/off-$k.pprof" 2>/dev/null &&
			go tool pprof -top -nodecount=25 "$KETTLE_BIN" "$d/off-$k.pprof" >"$d/off-$k.txt" 2>&1 || true
	done
	perf report -i "$d/pg.perf" --stdio --no-children --sort comm,dso,symbol 2>/dev/null | grep -v '^$' | head -80 >"$d/pg-perf.txt" || true
	echo "profile: $d ($(ls "$d" | tr '\n' ' '))"
}

# wal_profile DIR BEFORE AFTER (sizing.sh's state JSON): where the run's WAL
# went, from pg_waldump over the primary's WAL between the two positions:
# by record type (waldump.txt) and by relation (wal-relations.txt: bytes,
# share and records of each relation's records, the first block's relation
# naming a record; "-" for records of no relation, commits among them; each
# relation's costliest record types beside it). It reads the WAL after the
# run, so the run's figures stand (sizing.sh's WAL_PROFILE=DIR).
wal_profile() {
	local d=$1 lsn0 lsn1 wal=$KETTLE_HA_DIR/$leader/data/pg_wal
	mkdir -p "$d"
	lsn() { awk -v n="$1" 'BEGIN { printf "%X/%X", int(n / 4294967296), n % 4294967296 }'; }
	lsn0=$(lsn "$(echo "$2" | jq .wal_bytes)") lsn1=$(lsn "$(echo "$3" | jq .wal_bytes)")
	"$PGBIN_DIR/pg_waldump" --stats=record -p "$wal" -s "$lsn0" -e "$lsn1" >"$d/waldump.txt" 2>&1 || true
	deploy/cluster.sh psql -d kettle -F ' ' -c "SELECT relfilenode, relname FROM pg_class WHERE relfilenode <> 0" >"$d/relfilenodes.txt"
	"$PGBIN_DIR/pg_waldump" -p "$wal" -s "$lsn0" -e "$lsn1" 2>/dev/null | awk -v names="$d/relfilenodes.txt" '
		BEGIN { while ((getline l < names) > 0) { split(l, f, " "); name[f[1]] = f[2] } }
		{
			tot = $0; sub(/.*len \(rec\/tot\): *[0-9]+\/ */, "", tot); tot += 0
			type = $0; sub(/.*desc: /, "", type); sub(/[ ,].*/, "", type); type = $2 "/" type
			rel = "-"
			if (match($0, /blkref #0: rel [0-9]+\/[0-9]+\/[0-9]+/)) {
				r = substr($0, RSTART, RLENGTH); sub(/.*\//, "", r)
				rel = (r in name) ? name[r] : "relfilenode:" r
			}
			if ($0 ~ /FPW/) fpi[rel] += 1
			bytes[rel] += tot; recs[rel]++; all += tot; n++
			tb[rel SUBSEP type] += tot; tn[rel SUBSEP type]++
		}
		END {
			for (r in bytes) {
				top = ""
				for (k in tb) { split(k, p, SUBSEP); if (p[1] == r) top = top sprintf("%s %d/%d; ", p[2], tb[k], tn[k]) }
				printf "%-28s %10d %5.1f%% %8d %5d  %s\n", r, bytes[r], 100 * bytes[r] / all, recs[r], fpi[r], top
			}
			printf "%-28s %10d %5.1f%% %8d\n", "total", all, 100, n
		}' | sort -k2,2nr | sed '1i relation bytes share records fpw record-types(bytes/records)' >"$d/wal-relations.txt"
}
