// Package sqlite is the embedded kettle.Store: one SQLite file in WAL mode,
// one writer connection and a small pool of read-only connections, so that
// statistics and device reads never wait behind an ingest transaction.
//
// Every write is one transaction that stores the measurements and everything
// derived from them (latest state, capacity, hourly rollups, fleet totals),
// and is durable when it returns (synchronous=FULL).
package sqlite

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mattn/go-sqlite3"

	"github.com/kettlefleet/kettlefleet"
)

var _ kettle.Store = (*Store)(nil)

//go:embed migrations/*.sql
var migrations embed.FS

// Store is a kettle.Store on one SQLite file.
type Store struct {
	path string
	w    *sql.DB // exactly one connection: SQLite has one writer
	r    *sql.DB // read-only pool

	busy       atomic.Uint64
	maxRetries int

	closeOnce sync.Once
	closeErr  error

	// Statements prepared on the writer connection (the hot path).
	insMeas, selDev, insDev, updDevLatest, updDev *sql.Stmt
	selRollup, putRollup, selHod, putHod          *sql.Stmt
	selTotals, putTotals, regDev, setOv, clearOv  *sql.Stmt
	devCount, addSeen, subSeen, delSeen           *sql.Stmt
}

type config struct {
	busyTimeout time.Duration
	readers     int
	cacheKiB    int
	maxRetries  int
}

// Option tunes Open.
type Option func(*config)

// WithBusyTimeout sets how long SQLite itself waits for a lock held by
// another process before Store retries (and counts a busy retry). Default 5s.
func WithBusyTimeout(d time.Duration) Option { return func(c *config) { c.busyTimeout = d } }

// WithReaders sets the size of the read-only connection pool. Default 4.
func WithReaders(n int) Option { return func(c *config) { c.readers = n } }

// WithCacheKiB sets the writer's page cache. A larger cache keeps more of the
// measurement index in memory, which is what keeps ingest fast on a large
// history. Default 65536 (64 MiB).
func WithCacheKiB(n int) Option { return func(c *config) { c.cacheKiB = n } }

// WithMaxBusyRetries sets how many times a transaction that found the
// database locked (after the busy timeout) is retried before Store gives up
// with an EUnavailable error. Default 10.
func WithMaxBusyRetries(n int) Option { return func(c *config) { c.maxRetries = n } }

// Open opens (creating it, its parent directories and its schema when
// needed) the SQLite database at path and migrates it to the current schema.
func Open(ctx context.Context, path string, opts ...Option) (*Store, error) {
	cfg := config{busyTimeout: 5 * time.Second, readers: 4, cacheKiB: 65536, maxRetries: 10}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.readers < 1 {
		cfg.readers = 1
	}
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("open sqlite store %s: create directory: %w", path, err)
		}
	}
	s := &Store{path: path, maxRetries: cfg.maxRetries}
	busyMS := strconv.FormatInt(cfg.busyTimeout.Milliseconds(), 10)
	uri := "file:" + escapePath(path)

	var err error
	s.w, err = sql.Open("sqlite3", uri+"?_journal_mode=WAL&_synchronous=FULL&_txlock=immediate"+
		"&_busy_timeout="+busyMS+"&_cache_size=-"+strconv.Itoa(cfg.cacheKiB))
	if err != nil {
		return nil, fmt.Errorf("open sqlite store %s: %w", path, err)
	}
	s.w.SetMaxOpenConns(1)
	s.w.SetMaxIdleConns(1)
	s.w.SetConnMaxLifetime(0)
	s.w.SetConnMaxIdleTime(0)
	if err := s.migrate(ctx); err != nil {
		s.w.Close()
		return nil, fmt.Errorf("open sqlite store %s: %w", path, err)
	}
	if err := s.checkPragmas(ctx); err != nil {
		s.w.Close()
		return nil, fmt.Errorf("open sqlite store %s: %w", path, err)
	}

	// Readers open after the writer has created the file and switched it to
	// WAL; mode=ro makes a stray write through them an error.
	s.r, err = sql.Open("sqlite3", uri+"?mode=ro&_txlock=deferred&_busy_timeout="+busyMS)
	if err != nil {
		s.w.Close()
		return nil, fmt.Errorf("open sqlite store %s: readers: %w", path, err)
	}
	s.r.SetMaxOpenConns(cfg.readers)
	s.r.SetMaxIdleConns(cfg.readers)
	if err := s.r.PingContext(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("open sqlite store %s: readers: %w", path, err)
	}
	if err := s.prepare(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("open sqlite store %s: %w", path, err)
	}
	return s, nil
}

// escapePath makes a file path safe inside a file: URI, where ? and # end
// the path and % starts an escape.
func escapePath(p string) string {
	return strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(p)
}

// checkPragmas verifies that the durability settings took: a silently
// ignored journal mode would break "ack means durable".
func (s *Store) checkPragmas(ctx context.Context) error {
	var mode string
	if err := s.w.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return fmt.Errorf("read journal_mode: %w", err)
	}
	if !strings.EqualFold(mode, "wal") {
		return fmt.Errorf("journal_mode is %q, want wal (is the file on a filesystem without shared memory?)", mode)
	}
	var sync int
	if err := s.w.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&sync); err != nil {
		return fmt.Errorf("read synchronous: %w", err)
	}
	if sync != 2 {
		return fmt.Errorf("synchronous is %d, want 2 (FULL)", sync)
	}
	return nil
}

// migrate applies, in order and each in its own transaction, the embedded
// migrations newer than PRAGMA user_version. Running it again is a no-op.
func (s *Store) migrate(ctx context.Context) error {
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return err
	}
	sort.Strings(names)
	var have int
	if err := s.w.QueryRowContext(ctx, "PRAGMA user_version").Scan(&have); err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if have > len(names) {
		return fmt.Errorf("schema version %d is newer than this binary knows (%d); use a newer kettle", have, len(names))
	}
	for i := have; i < len(names); i++ {
		body, err := migrations.ReadFile(names[i])
		if err != nil {
			return err
		}
		// user_version lives in the file header, so setting it commits
		// atomically with the migration itself.
		err = s.tx(ctx, "migrate", func(tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, string(body)); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", i+1))
			return err
		})
		if err != nil {
			return fmt.Errorf("migration %s: %w", names[i], err)
		}
	}
	return nil
}

func (s *Store) prepare(ctx context.Context) error {
	p := func(dst **sql.Stmt, q string) error {
		if *dst != nil {
			return nil
		}
		st, err := s.w.PrepareContext(ctx, q)
		if err != nil {
			return fmt.Errorf("prepare %q: %w", q, err)
		}
		*dst = st
		return nil
	}
	for _, x := range []struct {
		dst **sql.Stmt
		q   string
	}{
		{&s.insMeas, `INSERT OR IGNORE INTO measurements(device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml) VALUES (?,?,?,?,?,?,?,?)`},
		{&s.selDev, `SELECT last_seen, latest_t, latest_charge, latest_level, latest_water, latest_ambient FROM devices WHERE id = ?`},
		{&s.insDev, `INSERT INTO devices(id, registered_at, last_seen, measurements, capacity_ml,
			latest_t, latest_charge, latest_full, latest_rate, latest_ambient, latest_water, latest_level)
			VALUES (?,?,?,?,?,?,?,?,?,?,?,?)`},
		{&s.updDevLatest, `UPDATE devices SET last_seen = ?, measurements = measurements + ?, capacity_ml = max(capacity_ml, ?),
			latest_t = ?, latest_charge = ?, latest_full = ?, latest_rate = ?, latest_ambient = ?, latest_water = ?, latest_level = ?
			WHERE id = ?`},
		{&s.updDev, `UPDATE devices SET last_seen = ?, measurements = measurements + ?, capacity_ml = max(capacity_ml, ?) WHERE id = ?`},
		{&s.selRollup, `SELECT n, water_mean, water_m2, ambient_mean, ambient_m2 FROM rollups WHERE hour = ?`},
		{&s.putRollup, `INSERT OR REPLACE INTO rollups(hour, n, water_mean, water_m2, ambient_mean, ambient_m2) VALUES (?,?,?,?,?,?)`},
		{&s.selHod, `SELECT n, water_mean, water_m2, ambient_mean, ambient_m2 FROM hours_of_day WHERE hod = ?`},
		{&s.putHod, `INSERT OR REPLACE INTO hours_of_day(hod, n, water_mean, water_m2, ambient_mean, ambient_m2) VALUES (?,?,?,?,?,?)`},
		{&s.selTotals, `SELECT measurement_count, device_count, charge, charge_c, level, level_c, potential, potential_c FROM totals WHERE id = 0`},
		{&s.putTotals, `UPDATE totals SET measurement_count = ?, device_count = ?, charge = ?, charge_c = ?, level = ?, level_c = ?, potential = ?, potential_c = ? WHERE id = 0`},
		{&s.addSeen, `INSERT INTO last_seen(at, n) VALUES (?, ?) ON CONFLICT(at) DO UPDATE SET n = n + excluded.n`},
		{&s.subSeen, `UPDATE last_seen SET n = n - ? WHERE at = ?`},
		{&s.delSeen, `DELETE FROM last_seen WHERE at = ? AND n <= 0`},
		{&s.regDev, `INSERT OR IGNORE INTO devices(id, registered_at) VALUES (?, ?)`},
		{&s.devCount, `UPDATE totals SET device_count = device_count + ? WHERE id = 0`},
		{&s.setOv, `UPDATE devices SET ov_charge = ?, ov_fill = ?, ov_flush = ?, ov_expires = ?, ov_set = ? WHERE id = ?`},
		{&s.clearOv, `UPDATE devices SET ov_charge = NULL, ov_fill = NULL, ov_flush = NULL, ov_expires = NULL, ov_set = NULL WHERE id = ?`},
	} {
		if err := p(x.dst, x.q); err != nil {
			return err
		}
	}
	return nil
}

// BusyRetries is how many times a transaction found the database locked by
// another process (after the busy timeout) and was retried. Non-zero means
// something else is writing to the file.
func (s *Store) BusyRetries() uint64 { return s.busy.Load() }

// Path is the database file.
func (s *Store) Path() string { return s.path }

// Ping checks that both the writer and a reader answer.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.w.PingContext(ctx); err != nil {
		return fmt.Errorf("sqlite ping writer: %w", err)
	}
	var one int
	if err := s.r.QueryRowContext(ctx, "SELECT 1 FROM totals WHERE id = 0").Scan(&one); err != nil {
		return fmt.Errorf("sqlite ping reader: %w", err)
	}
	return nil
}

// Close closes the readers, then the writer (the last connection to close
// checkpoints the WAL into the database file). Calling it again is a no-op.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.r != nil {
			errs = append(errs, s.r.Close())
		}
		for _, st := range []*sql.Stmt{s.insMeas, s.selDev, s.insDev, s.updDevLatest, s.updDev,
			s.selRollup, s.putRollup, s.selHod, s.putHod, s.selTotals, s.putTotals, s.regDev, s.setOv, s.clearOv, s.devCount, s.addSeen, s.subSeen, s.delSeen} {
			if st != nil {
				st.Close()
			}
		}
		if s.w != nil {
			errs = append(errs, s.w.Close())
		}
		if err := errors.Join(errs...); err != nil {
			s.closeErr = fmt.Errorf("close sqlite store %s: %w", s.path, err)
		}
	})
	return s.closeErr
}

// tx runs fn in one write transaction (BEGIN IMMEDIATE on the single writer
// connection) and commits. When another process holds the lock past the busy
// timeout, the whole transaction is retried, up to maxRetries times, and
// each retry is counted in BusyRetries; fn must therefore be repeatable.
func (s *Store) tx(ctx context.Context, what string, fn func(*sql.Tx) error) error {
	for attempt := 0; ; attempt++ {
		err := s.tryTx(ctx, fn)
		if err == nil || !isBusy(err) {
			return err
		}
		if attempt >= s.maxRetries {
			return &kettle.Error{
				Code:       kettle.EUnavailable,
				Message:    fmt.Sprintf("sqlite %s: database %s is locked by another process (%d retries); stop the other writer or retry later: %v", what, s.path, attempt, err),
				RetryAfter: time.Second,
			}
		}
		s.busy.Add(1)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(attempt+1) * 10 * time.Millisecond):
		}
	}
}

func (s *Store) tryTx(ctx context.Context, fn func(*sql.Tx) error) error {
	tx, err := s.w.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	return tx.Commit()
}

func isBusy(err error) bool {
	var e sqlite3.Error
	return errors.As(err, &e) && (e.Code == sqlite3.ErrBusy || e.Code == sqlite3.ErrLocked)
}
