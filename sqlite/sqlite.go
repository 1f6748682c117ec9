// Package sqlite is the embedded kettle.Store: one SQLite file in WAL mode,
// one writer connection and a small pool of read-only connections, so that
// statistics and device reads never wait behind an ingest transaction.
//
// Every write is one transaction that stores the measurements and everything
// derived from them (latest state, capacity, hourly rollups, fleet totals),
// and is durable when it returns (synchronous=FULL).
//
// The store is an embedded file owned by one process, so the writer keeps
// what it needs of each device (latest reading, capacity, count, last seen)
// in memory: a batch never reads the devices table. The cache is rebuilt from
// the file at Open and whenever PRAGMA data_version shows that another
// process committed to it, so it stays an accelerator, never a source of
// truth. WAL checkpoints are SQLite's automatic ones (PASSIVE, inside the
// commit that takes the WAL past 1,000 pages): they never wait for a reader.
package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
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
	selRollup, putRollup, selHod, putHod                 *sql.Stmt
	selTotals, putTotals, regDev, setOv, clearOv, revoke *sql.Stmt
	devCount, addSeen, subSeen, delSeen, dataVer         *sql.Stmt
	// Multi-row statements, one per chunk size (see chunkSizes).
	insStaged, insMeas, upsDev [len(chunkSizes)]*sql.Stmt

	// wmu serializes Write and Register and guards the cache and scratch.
	wmu   sync.Mutex
	cache devCache
	wsc   writeScratch

	// connGen counts writer connections opened; a new one means the cache
	// must be rebuilt (data_version is per connection).
	connGen atomic.Uint64

	stage stage // guarded by wmu (see stage.go)
}

type config struct {
	busyTimeout time.Duration
	readers     int
	cacheKiB    int
	maxRetries  int
	pageSize    int
	mergeRows   int
	mergeEvery  time.Duration
	log         *slog.Logger
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

// WithPageSize sets the page size of a new database file (an existing file
// keeps its own). Default 4096. See DefaultPageSize.
func WithPageSize(n int) Option { return func(c *config) { c.pageSize = n } }

// WithMerge sets how many staged rows start a merge into measurements, and
// how long rows stay staged at most (see stage.go). Defaults
// DefaultMergeRows and DefaultMergeEvery.
func WithMerge(rows int, every time.Duration) Option {
	return func(c *config) { c.mergeRows, c.mergeEvery = max(rows, 1), every }
}

// WithLogger sets where the store reports what it does on its own (a failed
// merge). Default: discard.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.log = l } }

// WithMaxBusyRetries sets how many times a transaction that found the
// database locked (after the busy timeout) is retried before Store gives up
// with an EUnavailable error. Default 10.
func WithMaxBusyRetries(n int) Option { return func(c *config) { c.maxRetries = n } }

// Open opens (creating it, its parent directories and its schema when
// needed) the SQLite database at path and migrates it to the current schema.
func Open(ctx context.Context, path string, opts ...Option) (*Store, error) {
	cfg := config{busyTimeout: 5 * time.Second, readers: 4, cacheKiB: 65536, maxRetries: 10,
		pageSize:  DefaultPageSize,
		mergeRows: DefaultMergeRows, mergeEvery: DefaultMergeEvery}
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
	s.stage.mergeRows, s.stage.mergeEvery, s.stage.log = cfg.mergeRows, cfg.mergeEvery, cfg.log
	if s.stage.log == nil {
		s.stage.log = slog.New(slog.DiscardHandler)
	}
	if s.stage.mergeEvery <= 0 {
		s.stage.mergeEvery = DefaultMergeEvery
	}
	busyMS := strconv.FormatInt(cfg.busyTimeout.Milliseconds(), 10)
	uri := "file:" + escapePath(path)

	// The journal mode is set by the connect hook, after the page size
	// (which a WAL database can no longer change).
	hook := []string{fmt.Sprintf("PRAGMA page_size = %d", cfg.pageSize), "PRAGMA journal_mode = WAL"}
	s.w = sql.OpenDB(&connector{
		dsn: uri + "?_synchronous=FULL&_txlock=immediate" +
			"&_busy_timeout=" + busyMS + "&_cache_size=-" + strconv.Itoa(cfg.cacheKiB),
		drv: &sqlite3.SQLiteDriver{ConnectHook: func(c *sqlite3.SQLiteConn) error {
			for _, q := range hook {
				if _, err := c.Exec(q, nil); err != nil {
					return fmt.Errorf("%s: %w", q, err)
				}
			}
			s.connGen.Add(1)
			return nil
		}},
	})
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
	var err error
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
	if err := s.loadCache(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("open sqlite store %s: load device cache: %w", path, err)
	}
	s.startMerger()
	return s, nil
}

// DefaultPageSize is the page size of new database files. A batch dirties
// about one measurements page per device it touches (the table is keyed by
// device, then time), and each dirty page is written whole to the WAL, so
// the page size is most of the bytes a commit writes.
const DefaultPageSize = 4096

// connector opens writer connections through a driver with a connect hook
// (per-connection pragmas and connGen), which sql.Open cannot give.
type connector struct {
	dsn string
	drv *sqlite3.SQLiteDriver
}

func (c *connector) Connect(context.Context) (driver.Conn, error) { return c.drv.Open(c.dsn) }
func (c *connector) Driver() driver.Driver                        { return c.drv }

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
		{&s.revoke, `UPDATE devices SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?`},
		{&s.dataVer, `PRAGMA data_version`},
	} {
		if err := p(x.dst, x.q); err != nil {
			return err
		}
	}
	for i, n := range chunkSizes {
		if err := p(&s.insStaged[i], insStagedSQL(n)); err != nil {
			return err
		}
		if err := p(&s.insMeas[i], insMeasSQL(n)); err != nil {
			return err
		}
		if err := p(&s.upsDev[i], upsDevSQL(n)); err != nil {
			return err
		}
	}
	return nil
}

// chunkSizes are the row counts of the prepared multi-row statements,
// largest first: a batch is cut into at most one chunk of each size below
// the largest (a binary decomposition), so a few statements serve any batch
// size. 512 rows × 12 parameters stays far below the bundled SQLite's
// limit of 32766 parameters.
var chunkSizes = [...]int{512, 256, 128, 64, 32, 16, 8, 4, 2, 1}

// chunk returns the index in chunkSizes of the largest size ≤ n (n ≥ 1).
func chunk(n int) int {
	for i, c := range chunkSizes {
		if c <= n {
			return i
		}
	}
	panic("sqlite: chunk of 0 rows")
}

func values(n int, row string) string {
	var b strings.Builder
	b.Grow(n * (len(row) + 1))
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(row)
	}
	return b.String()
}

// insMeasSQL inserts n rows (t, device, the six values) into measurements,
// for a dense batch when nothing is staged, and returns the keys of those
// that were new: a key already stored, or earlier in the statement, is
// ignored.
func insMeasSQL(n int) string {
	return `INSERT OR IGNORE INTO measurements(t, device, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml) VALUES ` +
		values(n, "(?,?,?,?,?,?,?,?)") + ` RETURNING device, t`
}

// insStagedSQL stages n rows (bucket, t, device, the six values, recv) and returns
// the keys of those that were new: a key already in measurements, already
// staged, or earlier in the statement is ignored.
func insStagedSQL(n int) string {
	return `INSERT OR IGNORE INTO staged(b, t, device, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml, recv)
		SELECT v.column1, v.column2, v.column3, v.column4, v.column5, v.column6, v.column7, v.column8, v.column9, v.column10
		FROM (VALUES ` + values(n, "(?,?,?,?,?,?,?,?,?,?)") + `) AS v
		WHERE NOT EXISTS (SELECT 1 FROM measurements m WHERE m.device = v.column3 AND m.t = v.column2)
		RETURNING device, t`
}

// upsDevSQL writes the new state of n devices computed by the writer;
// registered_at is used only for a device that is not there yet, and the
// override columns are left alone.
func upsDevSQL(n int) string {
	return `INSERT INTO devices(id, registered_at, last_seen, measurements, capacity_ml,
		latest_t, latest_charge, latest_full, latest_rate, latest_ambient, latest_water, latest_level) VALUES ` +
		values(n, "(?,?,?,?,?,?,?,?,?,?,?,?)") + `
		ON CONFLICT(id) DO UPDATE SET last_seen = excluded.last_seen, measurements = excluded.measurements,
		capacity_ml = excluded.capacity_ml, latest_t = excluded.latest_t, latest_charge = excluded.latest_charge,
		latest_full = excluded.latest_full, latest_rate = excluded.latest_rate, latest_ambient = excluded.latest_ambient,
		latest_water = excluded.latest_water, latest_level = excluded.latest_level`
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

// Close stops the merger, closes the readers, then the writer (the last
// connection to close checkpoints the WAL into the file and removes it).
// Calling it again is a no-op.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		s.stopMerger()
		if s.r != nil {
			errs = append(errs, s.r.Close())
		}
		sts := []*sql.Stmt{s.selRollup, s.putRollup, s.selHod, s.putHod, s.selTotals, s.putTotals, s.regDev,
			s.setOv, s.clearOv, s.devCount, s.addSeen, s.subSeen, s.delSeen, s.dataVer}
		sts = append(append(append(sts, s.insStaged[:]...), s.insMeas[:]...), s.upsDev[:]...)
		for _, st := range sts {
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
