package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mattn/go-sqlite3"

	"github.com/kettlefleet/kettlefleet/internal/durable"
)

// FileInfo is what a kettle database file holds, as Inspect read it.
type FileInfo struct {
	Schema       int   // PRAGMA user_version: migrations applied
	Bytes        int64 // page_size × page_count
	Measurements int64 // statistic 1
	Devices      int64 // registered kettles
	Checked      bool  // PRAGMA quick_check ran and said ok
}

// Backup writes a consistent copy of the kettle database at path to out, a
// file that must not exist yet, while other processes (a running kettle
// serve) go on writing to path.
//
// The copy is SQLite's online backup API run from a read-only connection
// inside one read transaction, so the copy is the database as of one
// commit, with every reading acknowledged before Backup started; in WAL
// mode it blocks no writer (the WAL grows while it runs: SQLite's automatic
// checkpoints are PASSIVE and copy no further than the oldest reader's
// snapshot). The copy is made durable step by step, switched to a rollback
// journal (one self-contained file), checked with Inspect (quick_check
// when check is set) and only then renamed to out, so a file named out is
// always a whole, checked backup. progress, if not nil, is called after
// each step with the bytes copied and the bytes to copy.
func Backup(ctx context.Context, path, out string, check bool, progress func(done, total int64)) (FileInfo, error) {
	return backup(ctx, path, out, check, progress, backupStepPages)
}

// backup is Backup copying stepPages pages a step.
func backup(ctx context.Context, path, out string, check bool, progress func(done, total int64), stepPages int) (FileInfo, error) {
	if st, err := os.Stat(path); err != nil || !st.Mode().IsRegular() {
		return FileInfo{}, fmt.Errorf("back up %s: no database file there", path)
	}
	tmp, err := durable.NewFile(out)
	if err != nil {
		return FileInfo{}, fmt.Errorf("back up to %s", err)
	}
	info, err := backupInto(ctx, path, tmp, check, progress, stepPages)
	if err != nil {
		os.Remove(tmp)
		return FileInfo{}, err
	}
	if err := durable.Publish(tmp, out); err != nil {
		return FileInfo{}, fmt.Errorf("back up to %s: %w", out, err)
	}
	return info, nil
}

func backupInto(ctx context.Context, path, tmp string, check bool, progress func(done, total int64), stepPages int) (FileInfo, error) {
	sc, closeSrc, err := open1(ctx, path, "mode=ro&_busy_timeout=5000")
	if err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: %w", path, err)
	}
	defer closeSrc()
	if _, err := schemaOf(ctx, sc, path); err != nil {
		return FileInfo{}, err
	}
	// One read transaction for the whole copy: the backup's steps run in
	// it (sqlite3_backup_step opens one of its own only when the source
	// connection has none), so every page comes from the same commit and
	// other processes' commits do not restart the copy.
	if _, err := sc.ExecContext(ctx, "BEGIN"); err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: %w", path, err)
	}
	defer sc.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
	var n, pageSize int64
	if err := sc.QueryRowContext(ctx, "SELECT measurement_count FROM totals WHERE id = 0").Scan(&n); err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: %w", path, err)
	}
	if err := sc.QueryRowContext(ctx, "PRAGMA page_size").Scan(&pageSize); err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: %w", path, err)
	}
	// The copy is written with synchronous=OFF and made durable step by
	// step (syncStep), not by SQLite's one fsync at the end.
	dc, closeDst, err := open1(ctx, tmp, "_synchronous=OFF")
	if err != nil {
		return FileInfo{}, fmt.Errorf("back up to %s: %w", tmp, err)
	}
	defer closeDst()
	var f *os.File // the copy, for the fsyncs
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	syncStep := func() error {
		if f == nil {
			var err error
			if f, err = os.OpenFile(tmp, os.O_RDWR, 0); err != nil {
				return err
			}
		}
		return f.Sync()
	}
	err = dc.Raw(func(d any) error {
		return sc.Raw(func(s any) error {
			bk, err := d.(*sqlite3.SQLiteConn).Backup("main", s.(*sqlite3.SQLiteConn), "main")
			if err != nil {
				return err
			}
			left := -1
			for {
				done, err := bk.Step(stepPages)
				if err == nil {
					err = syncStep()
				}
				if err == nil && progress != nil {
					total := int64(bk.PageCount())
					progress((total-int64(bk.Remaining()))*pageSize, total*pageSize)
				}
				if err != nil || done {
					return errors.Join(err, bk.Finish())
				}
				if r := bk.Remaining(); r == left { // busy: nothing copied
					select {
					case <-ctx.Done():
						return errors.Join(ctx.Err(), bk.Finish())
					case <-time.After(10 * time.Millisecond):
					}
				} else {
					left = r
				}
				if err := ctx.Err(); err != nil {
					return errors.Join(err, bk.Finish())
				}
			}
		})
	})
	if err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: %w", path, err)
	}
	// The copy has the source's header, WAL flag included; a reader of a
	// WAL file creates -wal and -shm files beside it. A backup is one file.
	var mode string
	if err := dc.QueryRowContext(ctx, "PRAGMA journal_mode = DELETE").Scan(&mode); err != nil || !strings.EqualFold(mode, "delete") {
		return FileInfo{}, fmt.Errorf("back up to %s: set the rollback journal: %q, %v", tmp, mode, err)
	}
	if err := syncStep(); err != nil {
		return FileInfo{}, fmt.Errorf("back up to %s: %w", tmp, err)
	}
	info, err := Inspect(ctx, tmp, check)
	if err != nil {
		return FileInfo{}, fmt.Errorf("back up %s: the copy failed its check: %w", path, err)
	}
	if info.Measurements != n {
		return FileInfo{}, fmt.Errorf("back up %s: the copy holds %d readings, the source said %d", path, info.Measurements, n)
	}
	return info, nil
}

// backupStepPages is how many pages a backup copies, then fsyncs, at a
// time (8 MiB of 4 KiB pages). One fsync of a file with hundreds of MB not
// yet on the disk holds up every other fsync on the machine until it is
// done (the disk's write cache is flushed for all at once), so a backup
// synced only at its end stalls a running server's commits; a step at a
// time spreads that cost (docs/performance.md, "Backups").
const backupStepPages = 2048

// Inspect opens the kettle database file at path read-only and checks
// that it is one this binary can open and that its counts agree: statistic
// 1 equals the kettles' counts plus the staged readings, and the devices
// count the kettles' rows. With quick set it also runs PRAGMA quick_check
// (every page of the file is read: its time grows with the file).
func Inspect(ctx context.Context, path string, quick bool) (FileInfo, error) {
	if _, err := os.Stat(path); err != nil {
		return FileInfo{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	conn, closeConn, err := open1(ctx, path, "mode=ro&_busy_timeout=5000")
	if err != nil {
		return FileInfo{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	defer closeConn()
	// One read transaction: every count below is of the same commit.
	if _, err := conn.ExecContext(ctx, "BEGIN"); err != nil {
		return FileInfo{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
	var info FileInfo
	if info.Schema, err = schemaOf(ctx, conn, path); err != nil {
		return FileInfo{}, err
	}
	var pageSize, pages, devRows, devSum, staged int64
	q := func(query string, dst ...any) {
		if err == nil {
			if err = conn.QueryRowContext(ctx, query).Scan(dst...); err != nil {
				err = fmt.Errorf("%s: %w", query, err)
			}
		}
	}
	q("PRAGMA page_size", &pageSize)
	q("PRAGMA page_count", &pages)
	q("SELECT measurement_count, device_count FROM totals WHERE id = 0", &info.Measurements, &info.Devices)
	q("SELECT count(*), coalesce(sum(measurements), 0) FROM devices", &devRows, &devSum)
	if info.Schema >= 3 { // 0003_staging.sql
		q("SELECT count(*) FROM staged", &staged)
	}
	if err != nil {
		return FileInfo{}, fmt.Errorf("inspect %s: %w", path, err)
	}
	info.Bytes = pageSize * pages
	if devSum+staged != info.Measurements || devRows != info.Devices {
		return FileInfo{}, fmt.Errorf("inspect %s: totals say %d readings of %d kettles; the kettles' rows say %d + %d staged readings of %d kettles",
			path, info.Measurements, info.Devices, devSum, staged, devRows)
	}
	if quick {
		rows, err := conn.QueryContext(ctx, "PRAGMA quick_check")
		if err != nil {
			return FileInfo{}, fmt.Errorf("inspect %s: quick_check: %w", path, err)
		}
		var problems []string
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				rows.Close()
				return FileInfo{}, fmt.Errorf("inspect %s: quick_check: %w", path, err)
			}
			if line != "ok" && len(problems) < 5 {
				problems = append(problems, line)
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return FileInfo{}, fmt.Errorf("inspect %s: quick_check: %w", path, err)
		}
		if len(problems) > 0 {
			return FileInfo{}, fmt.Errorf("inspect %s: quick_check: %s", path, strings.Join(problems, "; "))
		}
		info.Checked = true
	}
	return info, nil
}

// querier is what schemaOf needs of a *sql.DB or *sql.Conn.
type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// schemaOf reads the schema version and refuses a file that is not a
// kettle database or is newer than this binary.
func schemaOf(ctx context.Context, db querier, path string) (int, error) {
	var v int
	if err := db.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	names, _ := fs.Glob(migrations, "migrations/*.sql")
	switch {
	case v == 0:
		return 0, fmt.Errorf("%s: not a kettle database (schema version 0)", path)
	case v > len(names):
		return 0, fmt.Errorf("%s: schema version %d is newer than this binary knows (%d); use a newer kettle", path, v, len(names))
	}
	return v, nil
}

// Restore replaces the database at path (created if missing) with the
// content of the backup at from, after Inspect has checked the backup
// (quick_check included). It refuses while any other process has path
// open — a kettle serve on it would go on answering from its caches — by
// taking SQLite's exclusive lock without waiting; it holds that lock until
// the content is copied in (SQLite's online backup API, through the pager,
// so a stale WAL beside path cannot be replayed over it) and the WAL is
// folded back into the file.
func Restore(ctx context.Context, from, path string) (FileInfo, error) {
	info, err := Inspect(ctx, from, true)
	if err != nil {
		return FileInfo{}, fmt.Errorf("restore from %s: %w", from, err)
	}
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return FileInfo{}, fmt.Errorf("restore to %s: create directory: %w", path, err)
		}
	}
	lockErr := func(err error) error {
		if isBusy(err) {
			return fmt.Errorf("restore to %s: the file is open in another process (a running kettle serve or kettle expire?); stop it first", path)
		}
		return fmt.Errorf("restore to %s: %w", path, err)
	}
	dc, closeDst, err := open1(ctx, path, "_locking_mode=EXCLUSIVE&_busy_timeout=0&_synchronous=FULL")
	if err != nil {
		return FileInfo{}, lockErr(err)
	}
	defer closeDst()
	if _, err := dc.ExecContext(ctx, "BEGIN EXCLUSIVE"); err != nil {
		return FileInfo{}, lockErr(err)
	}
	// Exclusive locking mode keeps the lock after the commit, until the
	// connection closes.
	if _, err := dc.ExecContext(ctx, "COMMIT"); err != nil {
		return FileInfo{}, fmt.Errorf("restore to %s: %w", path, err)
	}
	sc, closeSrc, err := open1(ctx, from, "mode=ro")
	if err != nil {
		return FileInfo{}, fmt.Errorf("restore from %s: %w", from, err)
	}
	defer closeSrc()
	err = dc.Raw(func(d any) error {
		return sc.Raw(func(s any) error {
			bk, err := d.(*sqlite3.SQLiteConn).Backup("main", s.(*sqlite3.SQLiteConn), "main")
			if err != nil {
				return err
			}
			for {
				done, err := bk.Step(-1)
				if err != nil || done {
					return errors.Join(err, bk.Finish())
				}
				// Busy or locked: nobody else can hold path; the backup
				// file is read-only here. Try again shortly.
				select {
				case <-ctx.Done():
					return errors.Join(ctx.Err(), bk.Finish())
				case <-time.After(10 * time.Millisecond):
				}
			}
		})
	})
	if err != nil {
		return FileInfo{}, fmt.Errorf("restore %s from %s: %w", path, from, err)
	}
	var busy, log, done int
	if err := dc.QueryRowContext(ctx, "PRAGMA wal_checkpoint(TRUNCATE)").Scan(&busy, &log, &done); err != nil {
		return FileInfo{}, fmt.Errorf("restore to %s: checkpoint: %w", path, err)
	}
	return info, nil
}

// open1 opens one connection to the SQLite file at path with the URI
// parameters params (the driver's and SQLite's); close releases it.
func open1(ctx context.Context, path, params string) (c *sql.Conn, close func(), err error) {
	db, err := sql.Open("sqlite3", "file:"+escapePath(path)+"?"+params)
	if err != nil {
		return nil, nil, err
	}
	if c, err = db.Conn(ctx); err != nil {
		db.Close()
		return nil, nil, err
	}
	return c, func() { c.Close(); db.Close() }, nil
}
