package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/durable"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func init() {
	register("backup", "copy the store to one checked file, while kettle serve runs", runBackup)
}

const backupDoc = `
Writes a consistent copy of the store to one file while servers go on
writing to it: the copy is the store as of one commit, so every reading
acknowledged before the backup started is in it. The file is written and
fsynced 8 MiB at a time (so that the servers' commits never wait behind one
big fsync), checked, and only then given its name; an existing file is
never overwritten. Restore it with kettle restore.

SQLite: SQLite's online backup API inside one read transaction, which
blocks no writer (the WAL grows while it runs); the copy is checked (its
counts agree; PRAGMA quick_check reads every page, which takes longer the
larger the file; --check=false skips it). PostgreSQL: pg_dump --format=custom of a snapshot the backup
holds (so it knows the count the archive holds), checked with pg_restore
--list; pg_dump and pg_restore come from PATH or /usr/lib/postgresql/*/bin
and must be at least as new as the server. For point-in-time recovery use
pg_basebackup and WAL archiving instead.

With --keep N, a successful backup then removes the oldest backups in its
directory so that N are left, the new one among them. Only files named as
kettle backup names them (kettle-YYYYMMDDTHHMMSSZ.db, or .dump for
PostgreSQL) are counted and removed, oldest by the time in the name; other
files, a backup still being written (.partial) and the other store's
backups are left alone. Nothing is removed when the backup fails.

With --metrics-file, a successful backup leaves its time, duration, size
and count for node_exporter's textfile collector (alert: KettleBackupStale).`

func runBackup(ctx context.Context, args []string) error {
	fs := newFlagSet("backup", "--db DSN [--out FILE | --dir DIR] [--keep N]", backupDoc)
	db := fs.String("db", "sqlite:kettle-data/kettle.db", "the store to copy: sqlite:PATH or postgres://user@host:port/db")
	out := fs.String("out", "", "the backup file, which must not exist (default: backups/kettle-YYYYMMDDTHHMMSSZ.db beside a SQLite store; backups/kettle-YYYYMMDDTHHMMSSZ.dump in the working directory for PostgreSQL)")
	dir := fs.String("dir", "", "write the backup under its default name (kettle-YYYYMMDDTHHMMSSZ.db or .dump) into this directory instead of the default one; not with --out")
	keep := fs.Int("keep", 0, "after a successful backup, remove the oldest backups named kettle-YYYYMMDDTHHMMSSZ.db (or .dump) in its directory so that this many are left, the new one included; 0 keeps every backup")
	check := fs.Bool("check", true, "SQLite: run PRAGMA quick_check on the copy (reads it whole)")
	quiet := fs.Bool("quiet", false, "no progress lines (one every 5 s on stderr while it runs)")
	metricsFile := fs.String("metrics-file", "", "after a successful backup, write kettle_backup_* gauges to this file for node_exporter's textfile collector, e.g. /var/lib/prometheus/node-exporter/kettle_backup.prom (the KettleBackupStale alert watches them)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *keep < 0 {
		return fmt.Errorf("--keep %d: want the number of backups to leave (at least 1), or 0 to keep every one", *keep)
	}
	if *out != "" && *dir != "" {
		return errors.New("--out and --dir: give one (--dir writes the backup under its default name into DIR)")
	}
	if *out != "" && *keep > 0 && !backupName.MatchString(filepath.Base(*out)) {
		return fmt.Errorf("--keep %d removes only backups named kettle-YYYYMMDDTHHMMSSZ.db (or .dump), and --out %s is not one (it would never be counted): use --dir DIR instead of --out", *keep, *out)
	}
	start := time.Now()
	stamp := "kettle-" + start.UTC().Format("20060102T150405Z")
	// A line on stderr every 5 s while it runs (a big store takes minutes).
	next := start.Add(5 * time.Second)
	progress := func(done, total int64) {
		if *quiet || time.Now().Before(next) {
			return
		}
		next = time.Now().Add(5 * time.Second)
		if total > 0 {
			fmt.Fprintf(os.Stderr, "backup: %.1f of %.1f MB (%.0f %%), %s\n", float64(done)/1e6, float64(total)/1e6,
				100*float64(done)/float64(total), time.Since(start).Round(time.Second))
		} else {
			fmt.Fprintf(os.Stderr, "backup: %.1f MB written, %s\n", float64(done)/1e6, time.Since(start).Round(time.Second))
		}
	}
	var (
		what, detail      string
		bytes, n, kettles int64
	)
	if server.IsPostgresDSN(*db) {
		if *out == "" {
			*out = filepath.Join(cmp.Or(*dir, "backups"), stamp+".dump")
		}
		info, err := postgres.Backup(ctx, *db, *out, progress)
		if err != nil {
			return err
		}
		what, bytes, n, kettles = dbName(*db), info.Bytes, info.Measurements, info.Devices
		detail = fmt.Sprintf("%d tables' data; pg_restore --list ok", info.Tables)
	} else {
		path, err := sqliteFile(*db)
		if err != nil {
			return err
		}
		if *out == "" {
			*out = filepath.Join(cmp.Or(*dir, filepath.Join(filepath.Dir(path), "backups")), stamp+".db")
		}
		info, err := sqlite.Backup(ctx, path, *out, *check, progress)
		if err != nil {
			return err
		}
		what, bytes, n, kettles = path, info.Bytes, info.Measurements, info.Devices
		detail = "counts agree"
		if info.Checked {
			detail += ", quick_check ok"
		}
	}
	took := time.Since(start)
	if *metricsFile != "" {
		err := metrics.WriteBackupFile(*metricsFile, metrics.Backup{At: time.Now(), Took: took, Bytes: bytes, Measurements: n})
		if err != nil {
			return fmt.Errorf("backed up to %s, but --metrics-file: %w", *out, err)
		}
	}
	fmt.Fprintf(os.Stdout, "backed up %s to %s in %s: %d readings of %d kettles, %.1f MB (%s)\n",
		what, *out, took.Round(time.Millisecond), n, kettles, float64(bytes)/1e6, detail)
	if *keep > 0 {
		removed, left, err := pruneBackups(*out, *keep)
		if len(removed) > 0 {
			fmt.Fprintf(os.Stdout, "removed %d older backups (--keep %d; %d left in %s): %s\n",
				len(removed), *keep, left, filepath.Dir(*out), strings.Join(removed, " "))
		}
		if err != nil {
			return fmt.Errorf("backed up to %s, but --keep: %w", *out, err)
		}
	}
	return nil
}

// backupName matches the names kettle backup gives its files by default:
// the second it started, UTC, so that names sort as times do.
var backupName = regexp.MustCompile(`^kettle-\d{8}T\d{6}Z\.(db|dump)$`)

// pruneBackups removes the oldest backups beside out, the backup just
// written, so that keep are left, out among them whatever its name's time
// (a clock set back must not cost the newest backup). Only regular files
// named as backupName with out's extension count. It returns the names
// removed and how many backups are left.
func pruneBackups(out string, keep int) (removed []string, left int, err error) {
	dir, self := filepath.Dir(out), filepath.Base(out)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, 0, err
	}
	var older []string
	for _, e := range entries {
		name := e.Name()
		if name != self && e.Type().IsRegular() && backupName.MatchString(name) && filepath.Ext(name) == filepath.Ext(self) {
			older = append(older, name)
		}
	}
	slices.Sort(older) // oldest first: the names are fixed-width UTC times
	excess := max(0, len(older)-(keep-1))
	for _, name := range older[:excess] {
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			return removed, len(older) + 1 - len(removed), err
		}
		removed = append(removed, name)
	}
	if len(removed) > 0 {
		err = durable.SyncDir(dir)
	}
	return removed, len(older) + 1 - len(removed), err
}
