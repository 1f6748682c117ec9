// Package postgres is kettlefleet's production store: kettle.Store on
// PostgreSQL through pgx and its pool.
//
// Measurements live in a table partitioned by UTC day of device time (see
// partition.go; databases made before keep their month partitions). A write
// batch locks its devices, then goes in optimistically: by a plain INSERT
// from arrays in the same round trip (up to 1000 readings), or by binary COPY
// straight into the day's partition; only if a row is already stored does
// it fall back (to a savepoint) to INSERT … ON CONFLICT DO NOTHING from
// arrays, so duplicates are detected and counted.
// The devices' latest state, the hourly rollups and the fleet totals are
// updated in the same transaction, two round trips in all (three with the
// COPY, more on the fallback). The
// rows every batch would update (totals, the current hour's rollups) are
// sharded per connection, and the counts of devices per last_seen value are
// appended and folded in the background, so concurrent writers do not queue
// behind each other's commit (migration 4); the background compactor also
// folds closed hours' rollup shards into shard 0, so that a bounded-range
// statistic reads about one row per hour (migration 5). The schema is
// migrated at Open.
package postgres

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/redact"
)

var _ kettle.Store = (*Store)(nil)

//go:embed migrations/*.sql
var migrations embed.FS

// Advisory lock keys (pg_advisory_lock), one per kind of DDL.
const (
	lockMigrate   int64 = 0x6b65_7474_6c65_0001 // "kettle" 1
	lockPartition int64 = 0x6b65_7474_6c65_0002
	lockSeen      int64 = 0x6b65_7474_6c65_0003 // compactSeen
	lockRollups   int64 = 0x6b65_7474_6c65_0004 // compactRollups
)

// DefaultMaxReadLag is Options.MaxReadLag's default (kettle serve
// --max-read-lag).
const DefaultMaxReadLag = 5 * time.Second

// Options tune the store. The zero value is usable.
type Options struct {
	// MaxConns caps the connection pool. Every in-flight write batch and
	// query holds one connection; beyond this they wait (see
	// PoolStats.AcquireDuration). 0 means 4 × GOMAXPROCS, at least 8.
	MaxConns int32
	// MinConns are kept open even when idle, so a burst does not pay for
	// connection set-up. 0 means none.
	MinConns int32
	// StatementTimeout makes the server cancel any statement running longer
	// (statement_timeout), so a stuck query fails instead of holding a
	// connection forever. 0 leaves the server's setting.
	StatementTimeout time.Duration
	// ConnectTimeout bounds opening one connection (to each host of a
	// multi-host DSN in turn). 0 means the DSN's connect_timeout, or 10s
	// without one.
	ConnectTimeout time.Duration
	// PartitionsAhead is how many days after the current one (UTC) have
	// their measurement partition made ahead: at Open, and again each day
	// by the store's background loop. Partitions for other days are created
	// when a batch needs them. 0 means 2.
	PartitionsAhead int
	// Now is the clock used to choose the partitions created at Open; nil
	// means time.Now.
	Now func() time.Time
	// ReadDSN, when set, is a standby (or a multi-host DSN with
	// target_session_attrs=prefer-standby) that reads which tolerate lag go
	// to: device lists, a device's history, the dashboard's charts. Writes,
	// statistics and the server's own cache loads stay on the primary.
	ReadDSN string
	// MaxReadLag: while the replica's replay lag is over it (or cannot be
	// measured), its reads go to the primary. 0: DefaultMaxReadLag.
	MaxReadLag time.Duration
	// CompactEvery is how often the changes writers append to
	// last_seen_moves are folded into last_seen_counts (the statistic adds
	// both up, so this bounds the rows it reads, not its correctness),
	// and closed hours' rollup shards into shard 0 (likewise).
	// 0 means 1s.
	CompactEvery time.Duration
	// HostHoldoff is how long a host that refused, failed or was not
	// writable (target_session_attrs=read-write) is not dialled again: the
	// pace of the reconnection attempts while no primary is writable (see
	// hostGate). 0 means DefaultHostHoldoff; negative, no holdoff.
	HostHoldoff time.Duration

	// pingIdle: a connection idle longer is pinged (within pingTimeout)
	// before the pool hands it out. 0 means pgxpool's default, a second;
	// tests set it lower to meet the rule without waiting it out.
	pingIdle time.Duration
}

// Store is kettle.Store on PostgreSQL. It is safe for concurrent use, also by
// several processes (server nodes) on one database.
type Store struct {
	pool *pgxpool.Pool
	opts Options

	partMu sync.Mutex
	parts  map[int]string // partition of each day (see dayOf) known to have one
	// the first days of the partitions in parts, in order (History's
	// windows); nil when parts changed since it was made
	partStarts []int
	// days whose partition a DayLoad made (frozen and analyzed: SeedDone
	// does not vacuum them)
	loadedDays map[int]bool

	// shard of the hot rows (migration 4) each open connection writes
	shardMu    sync.Mutex
	shards     map[*pgconn.PgConn]int16
	shardConns [numShards]int // open connections per shard

	// devices this store has seen registered (see allKnown)
	knownMu sync.RWMutex
	known   map[kettle.DeviceID]struct{}
	// entries deleted from known since it was made (forget)
	knownDeleted int

	// connections whose last commit's wait for the synchronous standby was
	// cut short (see onNotice)
	syncCut sync.Map // *pgconn.PgConn → struct{}

	replica *replica // nil without Options.ReadDSN

	stopCompact chan struct{} // closed by Close
	compactDone chan struct{} // closed when the compactor returned

	// registered counts the devices this store registered since its last
	// ANALYZE of devices; analyzed, the ones counted up to then
	// (analyzeGrowth, the compactor's).
	registered atomic.Int64
	analyzed   int64

	// write transactions run again after a deadlock or serialization
	// failure, and after a partition was found missing (see Store.write)
	conflictRetries, partitionRetries atomic.Uint64

	// Maintenance's own connection (opened on its first call, again after
	// an error): the server's statistics stay readable while every pool
	// connection waits for a commit, the moment they explain. monVersion
	// (server_version_num) and monWALDir (may list pg_wal) are asked once a
	// connection.
	// dsn is Open's, for connections outside the pool (freshPassword).
	dsn string

	monMu      sync.Mutex
	mon        *pgx.Conn
	monVersion int32
	monWALDir  bool

	// the largest live batch written by a plain INSERT (see
	// defaultPlainBatchRows)
	plainBatchRows int
	// expireCounted, when set (tests), runs after expirePartition counted
	// the partition, holding it against inserts
	expireCounted func()
}

// Open connects to the database at dsn (a postgres:// URL or keyword/value
// string), applies the schema migrations the database lacks, and creates the
// measurement partitions of today and the next Options.PartitionsAhead days.
func Open(ctx context.Context, dsn string, opts Options) (*Store, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	if opts.MaxConns <= 0 {
		opts.MaxConns = int32(max(8, 4*runtime.GOMAXPROCS(0)))
	}
	if opts.ConnectTimeout <= 0 {
		// The DSN's connect_timeout: a host that accepts connections and
		// never answers (a paused machine) costs each connection attempt
		// this long before the driver tries the next host.
		opts.ConnectTimeout = cfg.ConnConfig.ConnectTimeout
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = 10 * time.Second
	}
	if opts.PartitionsAhead <= 0 {
		opts.PartitionsAhead = 2
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.CompactEvery <= 0 {
		opts.CompactEvery = time.Second
	}
	if opts.MaxReadLag <= 0 {
		opts.MaxReadLag = DefaultMaxReadLag
	}
	cfg.MaxConns = opts.MaxConns
	cfg.MinConns = min(opts.MinConns, opts.MaxConns)
	cfg.ConnConfig.ConnectTimeout = opts.ConnectTimeout
	if opts.HostHoldoff == 0 {
		opts.HostHoldoff = DefaultHostHoldoff
	}
	if opts.HostHoldoff > 0 {
		g := newHostGate(opts.HostHoldoff, time.Now)
		cfg.ConnConfig.DialFunc = g.dial(cfg.ConnConfig.DialFunc)
		cfg.ConnConfig.ValidateConnect = g.validate(cfg.ConnConfig.ValidateConnect)
		pingIdle := cmp.Or(opts.pingIdle, time.Second) // pgxpool's default
		cfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
			if g.stale(p.Conn.PgConn().Conn()) {
				// Closed here, the ping fails at once and the pool
				// destroys the connection and hands out the next.
				p.Conn.PgConn().Conn().Close()
				return true
			}
			return p.IdleDuration > pingIdle
		}
	}
	cfg.PingTimeout = pingTimeout
	rp := cfg.ConnConfig.RuntimeParams
	if rp["application_name"] == "" {
		// Not "kettle": the name of every version before the nodes table
		// (migration 6), which Beat counts as processes that write without
		// beating.
		rp["application_name"] = appName
	}
	rp["timezone"] = "UTC"
	if opts.StatementTimeout > 0 {
		rp["statement_timeout"] = strconv.FormatInt(opts.StatementTimeout.Milliseconds(), 10)
	}
	s := &Store{opts: opts, plainBatchRows: defaultPlainBatchRows, parts: map[int]string{}, loadedDays: map[int]bool{}, shards: map[*pgconn.PgConn]int16{}, known: map[kettle.DeviceID]struct{}{}}
	// A connection's set-up writes nothing (see sqlInsertNew): a new
	// connection reads even while every commit waits for a standby.
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if err := prepareWrite(ctx, c.PgConn()); err != nil {
			return err
		}
		s.assignShard(c.PgConn())
		return nil
	}
	cfg.BeforeClose = func(c *pgx.Conn) {
		s.releaseShard(c.PgConn())
		s.syncCut.Delete(c.PgConn())
	}
	cfg.ConnConfig.OnNotice = s.onNotice
	rereadPassword(dsn, cfg)
	s.dsn = dsn
	// Migrate on a plain connection first: AfterConnect needs the schema.
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	err = migrate(ctx, conn)
	conn.Close(context.Background())
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	s.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	if err := s.loadPartitions(ctx); err != nil {
		s.pool.Close()
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	if err := s.ensureAhead(ctx); err != nil {
		s.pool.Close()
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	if opts.ReadDSN != "" {
		params := map[string]string{"application_name": rp["application_name"], "timezone": "UTC"}
		if v := rp["statement_timeout"]; v != "" {
			params["statement_timeout"] = v
		}
		if s.replica, err = openReplica(ctx, opts.ReadDSN, opts, params); err != nil {
			s.pool.Close()
			return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
		}
	}
	s.stopCompact, s.compactDone = make(chan struct{}), make(chan struct{})
	go s.compactor()
	return s, nil
}

// compactor runs compactSeen and compactRollups every Options.CompactEvery
// until Close. A
// failure (the database is down) is retried at the next tick: until then the
// statistic just reads more rows.
func (s *Store) compactor() {
	defer close(s.compactDone)
	t := time.NewTicker(s.opts.CompactEvery)
	defer t.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-s.stopCompact
		cancel()
	}()
	for {
		select {
		case <-s.stopCompact:
			return
		case <-t.C:
			s.compactSeen(ctx, false)
			s.compactRollups(ctx, false)
			s.analyzeGrowth(ctx)
			s.ensureAhead(ctx) // a failure: again at the next tick, or by the first writer of the day
		}
	}
}

// analyzeMinDevices is the fewest registrations that analyzeGrowth
// analyzes devices for.
const analyzeMinDevices = 256

// analyzeGrowth runs ANALYZE devices once the devices this store
// registered since the last one are a tenth of those it counted then (at
// least analyzeMinDevices). Each pooled connection keeps the plan of every
// write statement from its first uses; made while devices held a handful
// of rows (a new database, a fleet registering), the batch's update of
// devices joins them by a sequential scan of the whole table, and keeps
// doing so as the fleet grows, until autovacuum's ANALYZE invalidates the
// plan, a minute or more later (bench/sizing.sh's profile: most of the
// primary's CPU). ANALYZE invalidates it at once; the new plan reaches
// each device row by its ctid.
func (s *Store) analyzeGrowth(ctx context.Context) {
	n := s.registered.Load()
	if n < max(analyzeMinDevices, s.analyzed/10) {
		return
	}
	if _, err := s.pool.Exec(ctx, "ANALYZE devices"); err != nil {
		return // the next tick tries again
	}
	s.registered.Add(-n)
	s.analyzed += n
}

// compactSeen folds last_seen_moves (what writers append: a row per batch,
// the changes in how many devices have each last_seen value) into
// last_seen_counts, and drops the values no device has any more, in one
// statement. Writers never touch last_seen_counts, so this waits for none
// of them; a second node compacting at the same time skips (advisory lock),
// so nothing else writes last_seen_counts meanwhile and each value's row is
// written once, by a plain insert, update or delete (sqlFoldSeen). Rows a
// writer appends meanwhile are not in this snapshot and stay for the next
// round.
//
// With wait false it skips the run when another node's compactor holds the
// lock (the background loop); with wait true it waits for that one (tests,
// which then expect last_seen_moves empty).
func (s *Store) compactSeen(ctx context.Context, wait bool) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if wait {
			if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockSeen); err != nil {
				return err
			}
		} else {
			var got bool
			if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", lockSeen).Scan(&got); err != nil || !got {
				return err
			}
		}
		if _, err := tx.Exec(ctx, sqlFoldSeen); err != nil {
			return fmt.Errorf("compact last_seen_moves: %w", err)
		}
		return nil
	})
}

// sqlFoldSeen is compactSeen's fold: the moves summed per value, then each
// value's row of last_seen_counts deleted when it reaches 0, updated when it
// moves, inserted when new. Not an INSERT … ON CONFLICT DO UPDATE, which
// logs a row lock before each update and a confirmation after each insert
// (a third of last_seen_counts' WAL in bench/sizing.sh's WAL profile), nor an
// update to 0 followed by a delete. The data-modifying parts touch disjoint
// rows, so one snapshot serves them all.
const sqlFoldSeen = `WITH m AS (DELETE FROM last_seen_moves RETURNING at, n),
	d AS (SELECT u.at, sum(u.n)::int8 AS n FROM m, unnest(m.at, m.n) AS u(at, n) GROUP BY u.at HAVING sum(u.n) <> 0),
	j AS (SELECT d.at, d.n, c.n AS old FROM d LEFT JOIN last_seen_counts c USING (at)),
	gone AS (DELETE FROM last_seen_counts c USING j WHERE c.at = j.at AND j.old + j.n = 0),
	moved AS (UPDATE last_seen_counts c SET n = j.old + j.n FROM j WHERE c.at = j.at AND j.old + j.n <> 0)
	INSERT INTO last_seen_counts (at, n) SELECT at, n FROM j WHERE old IS NULL ORDER BY at`

// foldRows bounds the rollup rows one compactRollups transaction folds;
// the rest wait for the next round.
const foldRows = 5000

// compactRollups folds the rollups of closed hours (before the current one
// by Options.Now) from every other shard into shard 0 and deletes them, so
// that a bounded-range statistic reads about one row per hour, not one per
// hour and shard (migration 4; the statistic adds up whatever shards an
// hour has, so folding changes no answer beyond float rounding). Rows a
// writer holds (a back-dated batch still open) are skipped (SKIP LOCKED)
// and folded in a later round; the merge into shard 0 may wait for a writer
// of shard 0, never the reverse (writers touch only their own shard). A
// second node compacting at the same time skips (advisory lock) unless wait.
func (s *Store) compactRollups(ctx context.Context, wait bool) error {
	cutoff := s.opts.Now().UTC().Truncate(time.Hour)
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if wait {
			if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockRollups); err != nil {
				return err
			}
		} else {
			var got bool
			if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", lockRollups).Scan(&got); err != nil || !got {
				return err
			}
			// While the merge waits for a writer of shard 0 (a long seeding
			// transaction), the rows it deleted hold up their writers: give
			// up soon instead, and try again next round.
			if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '200ms'"); err != nil {
				return err
			}
		}
		rows, _ := tx.Query(ctx, `SELECT hour, shard, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM rollups
			WHERE shard <> 0 AND hour < $1 ORDER BY hour, shard LIMIT $2 FOR UPDATE SKIP LOCKED`, cutoff, foldRows)
		var (
			hours  []time.Time
			shards []int16
			aggs   []hourAgg
		)
		for rows.Next() {
			var h time.Time
			var sh int16
			var w, a kettle.Moments
			if err := rows.Scan(&h, &sh, &w.N, &w.Mean, &w.M2, &a.Mean, &a.M2); err != nil {
				return fmt.Errorf("fold rollups: %w", err)
			}
			a.N = w.N
			hours, shards = append(hours, h), append(shards, sh)
			// in (hour, shard) order, as the statistic merges them
			if k := len(aggs) - 1; k >= 0 && aggs[k].hour == h.Unix() {
				aggs[k].water, aggs[k].ambient = aggs[k].water.Merge(w), aggs[k].ambient.Merge(a)
			} else {
				aggs = append(aggs, hourAgg{hour: h.Unix(), water: w, ambient: a})
			}
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("fold rollups: %w", err)
		}
		if len(hours) == 0 {
			return nil
		}
		if _, err := tx.Exec(ctx, `DELETE FROM rollups r USING unnest($1::timestamptz[], $2::int2[]) u(hour, shard)
			WHERE r.hour = u.hour AND r.shard = u.shard`, hours, shards); err != nil {
			return fmt.Errorf("fold rollups: delete %d shard rows: %w", len(hours), err)
		}
		keys := make([]time.Time, len(aggs))
		for i, a := range aggs {
			keys[i] = time.Unix(a.hour, 0).UTC()
		}
		// the writers' merge statement, into shard 0
		params := append(momentParams(timestamptzArray(keys), aggs), []byte{0, 0}) // int2 0
		if _, err := tx.Conn().PgConn().ExecPrepared(ctx, "kettle_rollups", params, bin(7), nil).Close(); err != nil {
			return fmt.Errorf("fold rollups: merge %d hours into shard 0: %w", len(aggs), err)
		}
		return nil
	})
}

// migrate applies, in order and each in its own transaction, the embedded
// migrations not yet recorded in schema_migrations. A session advisory lock
// makes a second server starting at the same time wait, then find nothing to
// do.
func migrate(ctx context.Context, conn *pgx.Conn) (err error) {
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", lockMigrate); err != nil {
		return fmt.Errorf("migrate: lock: %w", err)
	}
	defer func() {
		if _, uerr := conn.Exec(context.Background(), "SELECT pg_advisory_unlock($1)", lockMigrate); uerr != nil && err == nil {
			err = fmt.Errorf("migrate: unlock: %w", uerr)
		}
	}()
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    int PRIMARY KEY,
		name       text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	applied := map[int]bool{}
	rows, _ := conn.Query(ctx, "SELECT version FROM schema_migrations")
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	for _, v := range vs {
		applied[int(v)] = true
	}
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return err
	}
	sort.Strings(names)
	for _, name := range names {
		base := strings.TrimPrefix(name, "migrations/")
		v, err := strconv.Atoi(strings.SplitN(base, "_", 2)[0])
		if err != nil {
			return fmt.Errorf("migrate: %s: name must start with a version number", name)
		}
		if applied[v] {
			continue
		}
		sql, err := migrations.ReadFile(name)
		if err != nil {
			return err
		}
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, string(sql)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", v, base)
			return err
		})
		if err != nil {
			return fmt.Errorf("migrate %s: %w", base, err)
		}
	}
	return nil
}

// Close stops the compactor and closes every connection of the pool.
func (s *Store) Close() error {
	select {
	case <-s.stopCompact:
	default:
		close(s.stopCompact)
	}
	<-s.compactDone
	if s.replica != nil {
		s.replica.close()
	}
	s.monMu.Lock()
	if s.mon != nil {
		s.mon.Close(context.Background())
		s.mon = nil
	}
	s.monMu.Unlock()
	s.pool.Close()
	return nil
}

// Ping checks that the database answers a query.
func (s *Store) Ping(ctx context.Context) error {
	var one int
	if err := s.pool.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		return unavailable("ping", err)
	}
	return nil
}

var _ kettle.Nodes = (*Store)(nil)

var _ kettle.StoreClock = (*Store)(nil)

// Now is the database server's clock (clock_timestamp(): the time of the
// call, not of a transaction's start), which every node shares.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&t); err != nil {
		return time.Time{}, unavailable("clock", err)
	}
	return t, nil
}

// appName is the application_name of kettle's connections (unless the DSN
// names one); legacyAppName that of kettle versions that do not beat.
const (
	appName       = "kettlefleet"
	legacyAppName = "kettle"
)

// Beat records node alive in the nodes table (migration 6) by the database's
// clock, deletes the rows of processes gone for a day, and counts the other
// nodes alive (kettle.Nodes): one statement. Connections to the database
// named as kettle's versions before the nodes table were (they write and do
// not beat: a rolling upgrade) count as one more node while any is open.
func (s *Store) Beat(ctx context.Context, node uuid.UUID, kind string, every time.Duration) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `WITH beat AS (
			INSERT INTO nodes (id, kind, every_us, seen_at) VALUES ($1, $2, $3, now())
			ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at, every_us = excluded.every_us
		), gone AS (
			DELETE FROM nodes WHERE seen_at < now() - interval '1 day' AND id <> $1
		)
		SELECT (SELECT count(*) FROM nodes
			WHERE id <> $1 AND seen_at >= now() - 3 * greatest(every_us, $3) * interval '1 microsecond')
		+ (SELECT count(*) FROM (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = $4 AND pid <> pg_backend_pid() LIMIT 1) legacy)`,
		node, kind, max(every.Microseconds(), 1), legacyAppName).Scan(&n)
	if err != nil {
		return 0, unavailable("beat", err)
	}
	return n, nil
}

// PoolStats is a snapshot of the connection pool, for metrics. Acquire wait
// is where a too-small pool shows: requests queue for a connection while the
// database itself is idle.
type PoolStats struct {
	MaxConns      int32 // pool capacity
	TotalConns    int32 // open connections
	AcquiredConns int32 // in use
	IdleConns     int32 // open and free
	// AcquireCount is how many acquires succeeded; EmptyAcquireCount how many
	// of those had to wait because no connection was idle.
	AcquireCount      int64
	EmptyAcquireCount int64
	// AcquireDuration is the cumulative time spent waiting in acquires.
	AcquireDuration time.Duration
	// CanceledAcquireCount counts acquires given up by their context.
	CanceledAcquireCount int64
}

// PoolStats returns the current pool statistics.
func (s *Store) PoolStats() PoolStats {
	st := s.pool.Stat()
	return PoolStats{
		MaxConns:             st.MaxConns(),
		TotalConns:           st.TotalConns(),
		AcquiredConns:        st.AcquiredConns(),
		IdleConns:            st.IdleConns(),
		AcquireCount:         st.AcquireCount(),
		EmptyAcquireCount:    st.EmptyAcquireCount(),
		AcquireDuration:      st.AcquireDuration(),
		CanceledAcquireCount: st.CanceledAcquireCount(),
	}
}

// Maintenance is the database server's periodic work since its statistics
// were last reset: what a short benchmark may leave out (a checkpoint every
// CheckpointTimeout writes the dirty buffers, and every page written after
// it goes into the WAL whole once: a full-page image).
type Maintenance struct {
	// Checkpoints by what started them: checkpoint_timeout (timed), or
	// WAL reaching max_wal_size, a CHECKPOINT command, a restart
	// (requested: many of these say max_wal_size is too small).
	CheckpointsTimed, CheckpointsRequested int64
	CheckpointBuffers                      int64 // buffers written by checkpoints
	WALBytes                               int64
	WALFullPageImages                      int64
	CheckpointTimeout                      time.Duration
	// The WAL segment file being written (its number, counting from the
	// first segment of the server's WAL) and how many segment files wait
	// ready after it (recycled by a checkpoint, or preallocated). While
	// none wait, every segment switch creates a new file, zero-filling
	// all 16 MiB of it (wal_init_zero) while the commits that need the
	// space wait: on a young cluster, or when the WAL outgrows
	// min_wal_size. SegmentsKnown is false when the role may not list
	// pg_wal (pg_ls_waldir: superuser or pg_monitor).
	Segment, SegmentsReady int64
	SegmentsKnown          bool
}

// Maintenance reads the server's checkpoint and WAL statistics
// (pg_stat_bgwriter and pg_stat_wal up to PostgreSQL 16, pg_stat_checkpointer
// from 17), its checkpoint_timeout and, where the role may list pg_wal, its
// WAL segment files: one statement, on a connection of its own outside the
// pool (one more connection to the server than --pool-size), so that it
// answers while the pool is exhausted.
func (s *Store) Maintenance(ctx context.Context) (Maintenance, error) {
	s.monMu.Lock()
	defer s.monMu.Unlock()
	m, err := s.maintenance(ctx)
	if err != nil && s.mon != nil {
		s.mon.Close(context.WithoutCancel(ctx))
		s.mon = nil
	}
	return m, err
}

func (s *Store) maintenance(ctx context.Context) (Maintenance, error) {
	if s.mon == nil {
		cc := s.pool.Config().ConnConfig.Copy()
		freshPassword(s.dsn, cc)
		c, err := pgx.ConnectConfig(ctx, cc)
		if err != nil {
			return Maintenance{}, unavailable("maintenance statistics: connect", err)
		}
		// The privilege is checked when a plan starts, so the listing
		// cannot hide behind a CASE: ask first.
		if err := c.QueryRow(ctx, `SELECT current_setting('server_version_num')::int4,
			has_function_privilege('pg_catalog.pg_ls_waldir()', 'EXECUTE')`).Scan(&s.monVersion, &s.monWALDir); err != nil {
			c.Close(context.WithoutCancel(ctx))
			return Maintenance{}, unavailable("maintenance statistics", err)
		}
		s.mon = c
	}
	cp := `SELECT checkpoints_timed, checkpoints_req, buffers_checkpoint FROM pg_stat_bgwriter`
	if s.monVersion >= 170000 {
		cp = `SELECT num_timed, num_requested, buffers_written FROM pg_stat_checkpointer`
	}
	// The segment files: the one being written and the newest in pg_wal
	// (names sort as segment numbers within a timeline, and a newer
	// timeline sorts after).
	seg := `, '', '', 0::int8`
	if s.monWALDir {
		seg = `, pg_walfile_name(pg_current_wal_insert_lsn()),
			(SELECT max(name) FROM pg_ls_waldir() WHERE name ~ '^[0-9A-F]{24}$'),
			(SELECT setting::int8 FROM pg_settings WHERE name = 'wal_segment_size')`
	}
	var m Maintenance
	var timeoutS, segSize int64
	var cur, newest string
	err := s.mon.QueryRow(ctx, `WITH cp(timed, requested, buffers) AS (`+cp+`)
		SELECT cp.timed, cp.requested, cp.buffers, w.wal_bytes::int8, w.wal_fpi,
			extract(epoch FROM current_setting('checkpoint_timeout')::interval)::int8`+seg+`
		FROM cp, pg_stat_wal w`).Scan(&m.CheckpointsTimed, &m.CheckpointsRequested, &m.CheckpointBuffers, &m.WALBytes, &m.WALFullPageImages, &timeoutS,
		&cur, &newest, &segSize)
	if err != nil {
		return Maintenance{}, unavailable("maintenance statistics", err)
	}
	m.CheckpointTimeout = time.Duration(timeoutS) * time.Second
	if c, ok := walSegmentNo(cur, segSize); ok {
		if n, ok := walSegmentNo(newest, segSize); ok && cur[:8] == newest[:8] {
			m.Segment, m.SegmentsReady, m.SegmentsKnown = c, max(n-c, 0), true
		}
	}
	return m, nil
}

// walSegmentNo is the number of the WAL segment file name (timeline, log,
// segment: 24 hex digits) of segSize-byte segments, counted from the first.
func walSegmentNo(name string, segSize int64) (int64, bool) {
	if len(name) != 24 || segSize <= 0 {
		return 0, false
	}
	log, err1 := strconv.ParseUint(name[8:16], 16, 32)
	seg, err2 := strconv.ParseUint(name[16:], 16, 32)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return int64(log)*(0x100000000/segSize) + int64(seg), true
}

// numShards is the number of shards of the hot rows: totals, rollups and
// hours_of_day rows, one shard per connection (migration 4).
const numShards = 16

// assignShard gives a new connection the shard fewest open connections
// write, so that the pool's connections (up to 16) update different hot
// rows and concurrent write transactions do not queue behind each other's
// commit. Other nodes sharing the database may pick the same shards: that
// costs waiting, never correctness.
func (s *Store) assignShard(c *pgconn.PgConn) {
	s.shardMu.Lock()
	defer s.shardMu.Unlock()
	best := 0
	for i, n := range s.shardConns {
		if n < s.shardConns[best] {
			best = i
		}
	}
	s.shardConns[best]++
	s.shards[c] = int16(best)
}

func (s *Store) releaseShard(c *pgconn.PgConn) {
	s.shardMu.Lock()
	defer s.shardMu.Unlock()
	if sh, ok := s.shards[c]; ok {
		s.shardConns[sh]--
		delete(s.shards, c)
	}
}

// shard returns the shard connection c writes.
func (s *Store) shard(c *pgconn.PgConn) int16 {
	s.shardMu.Lock()
	defer s.shardMu.Unlock()
	return s.shards[c]
}

// ConflictRetries is how many times a write transaction lost a deadlock or
// a serialization conflict and was run again. Our own writers take their
// locks in one global order, so this stays 0 unless another client of the
// database locks the same rows in another order; rising, it names that
// client's lock order as the problem (the server log's deadlock DETAIL says
// which statements collided).
func (s *Store) ConflictRetries() uint64 { return s.conflictRetries.Load() }

// PartitionRetries is how many times a write transaction found a
// measurement partition missing (dropped behind the store's back) and was
// run again after re-creating it.
func (s *Store) PartitionRetries() uint64 { return s.partitionRetries.Load() }

// unavailable wraps a database failure as EUnavailable when it looks like the
// database is unreachable or the request timed out, EInternal otherwise, with
// a message for the operator. Context cancellation is returned as is.
func unavailable(op string, err error) error {
	if errors.Is(err, context.Canceled) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "57014": // query_canceled: statement_timeout
			return &kettle.Error{Code: kettle.EUnavailable, Message: fmt.Sprintf("%s: the database timed out (%s); retry later, or raise the statement timeout", op, pgErr.Message), RetryAfter: time.Second}
		case pgErr.Code == "25006": // read_only_sql_transaction: a standby, or a primary being demoted
			return &kettle.Error{Code: kettle.EUnavailable, Message: fmt.Sprintf("%s: the database is read-only (a failover is under way?); retry later", op), RetryAfter: time.Second}
		case strings.HasPrefix(pgErr.Code, "08"), strings.HasPrefix(pgErr.Code, "53"), strings.HasPrefix(pgErr.Code, "57P"):
			return &kettle.Error{Code: kettle.EUnavailable, Message: fmt.Sprintf("%s: the database is unavailable (%s %s); retry later", op, pgErr.Code, pgErr.Message), RetryAfter: time.Second}
		}
		return fmt.Errorf("%s: %w", op, err)
	}
	if errors.Is(err, context.DeadlineExceeded) || pgconn.SafeToRetry(err) || pgconn.Timeout(err) || isConnErr(err) {
		return &kettle.Error{Code: kettle.EUnavailable, Message: fmt.Sprintf("%s: the database is unreachable (%v); retry later", op, err), RetryAfter: time.Second}
	}
	return fmt.Errorf("%s: %w", op, err)
}

func isConnErr(err error) bool {
	var ce *pgconn.ConnectError
	return errors.As(err, &ce)
}

// errSyncCut: the commit holds on the primary, but its wait for the
// synchronous standby was cancelled (statement_timeout, a cancel request),
// so no second machine is known to hold it. The readings are not
// acknowledged; the kettles send them again and the retry finds them
// stored (a duplicate), acknowledged once a standby confirms.
var errSyncCut = &kettle.Error{Code: kettle.EUnavailable, Message: "write: committed on the primary, but no synchronous standby confirmed it in time (standbys lost? see the Patroni cluster); not acknowledged, retry later", RetryAfter: 5 * time.Second}

// onNotice notes the warning PostgreSQL sends instead of an error when a
// commit's wait for synchronous replication is cancelled: the COMMIT
// itself then succeeds, and only this notice tells that the transaction
// may exist on the primary alone. The message is matched in English
// (lc_messages=C, deploy/patroni/patroni.yml).
func (s *Store) onNotice(c *pgconn.PgConn, n *pgconn.Notice) {
	if strings.Contains(n.Message, "wait for synchronous replication") {
		s.syncCut.Store(c, struct{}{})
	}
}
