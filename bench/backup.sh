#!/usr/bin/env bash
# kettle backup while kettle serve runs on the store under a simulated
# fleet: how long the backup takes and what it does to the uploads'
# latency. Seeds DEVICES kettles × DAYS of history at INTERVAL into a fresh
# store (STORE=sqlite, the default, or STORE=postgres: a throwaway cluster,
# bench/lib/pg-cluster.sh), starts kettle serve on it, runs kettle swarm
# (SWARM kettles every 2 s for DURATION) and, AT seconds in, kettle backup
# (the build of the tree, or KETTLE_BIN); with BACKUP_A=<kettle binary>
# also that binary's backup first, AT_A seconds in, for an A/B in one run.
# Prints the backups' lines, the swarm's 5 s windows (the backup's windows
# marked) and its summary and audit; then, the server stopped, how long
# backup B takes to restore into a new store.
#
#   bench/backup.sh
#   BACKUP_A=/tmp/kettle-old AT_A=20 AT=50 DURATION=90s bench/backup.sh
#   STORE=postgres bench/backup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# SMOKE=1: seconds, tiny sizes, not recorded (bench/smoke_test.go runs it so).
[ "${SMOKE:-}" != 1 ] || : "${DEVICES:=20}" "${DAYS:=1}" "${INTERVAL:=6h}" "${SWARM:=10}" "${DURATION:=6s}" "${AT:=3}" "${AT_A:=2}"
DEVICES=${DEVICES:-2000} DAYS=${DAYS:-33} INTERVAL=${INTERVAL:-15m}
SWARM=${SWARM:-1000} DURATION=${DURATION:-60s} AT=${AT:-20} AT_A=${AT_A:-20}
STORE=${STORE:-sqlite}
case $STORE in sqlite | postgres) ;; *) echo "STORE must be sqlite or postgres, got $STORE" >&2; exit 2 ;; esac
. bench/lib/pg-cluster.sh # machine_line, build_kettle, free_port; the cluster only for STORE=postgres
work=$(mktemp -d /tmp/kettle-backup-XXXXXX) kpid=
trap '[ -n "$kpid" ] && kill "$kpid" 2>/dev/null; wait 2>/dev/null || true; pg_stop; rm -rf "$work"' EXIT
rerun="STORE=$STORE DEVICES=$DEVICES DAYS=$DAYS INTERVAL=$INTERVAL SWARM=$SWARM DURATION=$DURATION AT=$AT${BACKUP_A:+ BACKUP_A=$BACKUP_A AT_A=$AT_A} bench/backup.sh"
echo "rerun: $rerun"
rec_begin backup.sh "$rerun"
machine_line
build_kettle "$work"
K=$work/kettle db="sqlite:$work/kettle.db" ext=db
if [ "$STORE" = postgres ]; then
	pg_start
	pg_settings
	db=$(pg_db kettle) ext=dump
fi
"$K" seed --db "$db" --devices "$DEVICES" --days "$DAYS" --interval "$INTERVAL" --quiet | tail -1
# The seed's writes on the disk before the run: their checkpoint and
# writeback would stall commits in the first windows, backup or not.
[ "$STORE" = postgres ] && pg_sql kettle "CHECKPOINT" >/dev/null
sync
port=$(free_port)
"$K" serve --addr 127.0.0.1:$port --db "$db" --data-dir "$work/data" --log-level warn 2>"$work/serve.log" &
kpid=$!
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
"$K" swarm --target "http://127.0.0.1:$port" --data-dir "$work/data" --devices "$SWARM" --interval 2s --duration "$DURATION" \
	--out "$work/swarm" --report=false --server-pid "$kpid" >"$work/swarm.out" 2>&1 &
spid=$!
t0=$(date +%s)
backup() { # NAME BIN AT
	sleep $(($3 - ($(date +%s) - t0)))
	local s=$(($(date +%s) - t0)) b0=$(date +%s.%N)
	echo "backup $1 at ${s}s: $("$2" backup --db "$db" --out "$work/backup-$1.$ext")"
	echo "$1 $s $(($(date +%s) - t0))" >>"$work/marks"
	rec_fig "backup $1" "$(awk -v a="$b0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')" s
	rec_fig "backup $1 file" "$(stat -c %s "$work/backup-$1.$ext")" bytes
}
[ -n "${BACKUP_A:-}" ] && backup A "$BACKUP_A" "$AT_A"
backup B "$K" "$AT"
wait $spid || true
# the swarm's progress lines, a window marked with the backup(s) it overlaps
while read -r line; do
	w=$(sed -n 's/^\[ *\([0-9]*\)s\].*/\1/p' <<<"$line")
	mark=
	[ -n "$w" ] && while read -r name from to; do ((w > from && w - 5 <= to)) && mark="$mark <- backup $name"; done <"$work/marks"
	echo "$line$mark"
done < <(grep -E '^\[' "$work/swarm.out" | sed -E 's/ \| command.*//')
grep -E 'measurement  |command  |audit:' "$work/swarm.out"
ls -l "$work"/backup-*."$ext" | awk '{print $5, $NF}'
# How long backup B takes to restore, into a new store (the server stopped).
kill "$kpid"; wait "$kpid" 2>/dev/null || true; kpid=
to="sqlite:$work/restored.db"
[ "$STORE" = postgres ] && to=$(pg_db kettle_restored)
r0=$(date +%s.%N)
"$K" restore --db "$to" --from "$work/backup-B.$ext"
rec_fig "restore B" "$(awk -v a="$r0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')" s
rec_swarm "$work/swarm/results.json" swarm
rec_end
