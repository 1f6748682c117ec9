package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func init() {
	register("backup", "copy the SQLite store to one checked file, while kettle serve runs", runBackup)
}

const backupDoc = `
Writes a consistent copy of the embedded SQLite store to one file, safely
while kettle serve runs on it: the copy is the store as of one commit (every
reading acknowledged before the backup started is in it), written and
fsynced 8 MiB at a time (so that the server's commits never wait behind one
big fsync), checked (the counts agree; PRAGMA quick_check reads every page,
~1 s a GB, --check=false skips it) and only then given its name. Uploads go
on meanwhile: the copy is one read transaction, which blocks no writer (the
WAL grows while it runs). Restore it with kettle restore. With --metrics-file, a successful backup
leaves its time, duration, size and count for node_exporter's textfile
collector (alert: KettleBackupStale). For PostgreSQL use its own tools (pg_dump,
pg_basebackup): see the README's Backups.`

func runBackup(ctx context.Context, args []string) error {
	fs := newFlagSet("backup", "--db sqlite:PATH [--out FILE]", backupDoc)
	db := fs.String("db", "sqlite:kettle-data/kettle.db", "the store to copy: sqlite:PATH")
	out := fs.String("out", "", "the backup file, which must not exist (default: backups/kettle-YYYYMMDDTHHMMSSZ.db beside the store)")
	check := fs.Bool("check", true, "run PRAGMA quick_check on the copy (reads it whole)")
	metricsFile := fs.String("metrics-file", "", "after a successful backup, write kettle_backup_* gauges to this file for node_exporter's textfile collector, e.g. /var/lib/prometheus/node-exporter/kettle_backup.prom (the KettleBackupStale alert watches them)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	path, err := sqliteFile(*db, "kettle backup copies")
	if err != nil {
		return err
	}
	start := time.Now()
	if *out == "" {
		*out = filepath.Join(filepath.Dir(path), "backups", "kettle-"+start.UTC().Format("20060102T150405Z")+".db")
	}
	info, err := sqlite.Backup(ctx, path, *out, *check)
	if err != nil {
		return err
	}
	took := time.Since(start)
	if *metricsFile != "" {
		err := metrics.WriteBackupFile(*metricsFile, metrics.Backup{At: time.Now(), Took: took, Bytes: info.Bytes, Measurements: info.Measurements})
		if err != nil {
			return fmt.Errorf("backed up to %s, but --metrics-file: %w", *out, err)
		}
	}
	checked := "counts agree"
	if info.Checked {
		checked += ", quick_check ok"
	}
	fmt.Fprintf(os.Stdout, "backed up %s to %s in %s: %d readings of %d kettles, %.1f MB (%s)\n",
		path, *out, took.Round(time.Millisecond), info.Measurements, info.Devices, float64(info.Bytes)/1e6, checked)
	return nil
}
