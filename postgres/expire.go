package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/kettlefleet/kettlefleet"
)

// expiredSuffix names a partition's table between its detaching and its drop.
const expiredSuffix = "_expired"

// lockExpire serialises Expire across nodes (each node of a fleet may run
// the retention loop).
const lockExpire int64 = 0x6b65_7474_6c65_0005

// expireLockWait bounds each wait of Expire's last step for a lock a writer
// holds (the measurements table): writers commit in tens of
// milliseconds, and while Expire waits for the table every new writer
// queues behind it. A wait that runs out is tried again, expireAttempts
// times in all, before Expire gives up until its next round.
const (
	expireLockWait = 500 * time.Millisecond
	expireAttempts = 10
)

// Expire removes every measurement whose device time is before before (the
// first instant of a UTC day): it drops the partitions that end at or
// before it (days; months whole, in a database made before day partitions),
// oldest first, one transaction each, and in the same transaction takes
// their readings out of every derived figure: each device's measurement
// count (kept net of device_expired, migration 7) and the fleet's, the
// hours' rollups, and the all-history moments per hour of day (rebuilt from
// the rollups that remain). A device's latest state and capacity stay: they
// are what the fleet knows of the kettle now, not history.
//
// Each partition's transaction first counts its readings per device,
// holding the partition against inserts (SHARE) but nothing a writer of
// newer data needs, however long the count takes, and adds the counts to
// device_expired (no kettle's row is locked: writers lock theirs first in
// every batch). Then it takes the measurements table (ACCESS EXCLUSIVE: it
// waits for the writers inside their transaction, each of which inserts
// before it touches rollups, hours of day and totals), detaches the
// partition and adjusts the rollups, hours of day and fleet count: from the
// table lock to the commit (milliseconds) writers wait. The detached
// partition is dropped after the commit, by itself (one left by a failure
// or crash is dropped by the next Expire). A writer that meanwhile tried to
// insert into the partition being expired (the API refuses readings older
// than the retention window, so only another tool could) would wait for the
// SHARE lock while holding the measurements table: Expire then rolls back,
// leaving the partition for its next round, instead of deadlocking with it.
func (s *Store) Expire(ctx context.Context, before time.Time) (int64, error) {
	if err := kettle.CheckDayStart(before); err != nil {
		return 0, err
	}
	if err := s.dropDetached(ctx); err != nil {
		return 0, err
	}
	var removed int64
	for {
		p, ok, err := s.oldestPartitionBefore(ctx, dayOf(before))
		if err != nil || !ok {
			return removed, err
		}
		n, err := s.expirePartition(ctx, p)
		removed += n
		if err != nil {
			return removed, err
		}
	}
}

// oldestPartitionBefore returns the oldest partition that ends at or before
// day.
func (s *Store) oldestPartitionBefore(ctx context.Context, day int) (partition, bool, error) {
	parts, err := listPartitions(ctx, s.pool)
	if err != nil {
		return partition{}, false, unavailable("expire", err)
	}
	if len(parts) == 0 || parts[0].to > day {
		return partition{}, false, nil
	}
	return parts[0], true, nil
}

// errExpireWaiter: a writer waits to insert into the partition being expired.
var errExpireWaiter = errors.New("a writer waits to insert into the partition")

// errExpireReader: a long transaction reads measurements (a pg_dump).
var errExpireReader = errors.New("a long transaction reads measurements")

// expirePartition drops partition p and takes its rows out of the derived
// figures, in one transaction (see Expire).
func (s *Store) expirePartition(ctx context.Context, p partition) (int64, error) {
	part := p.name
	var removed int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		removed = 0
		var got bool
		if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", lockExpire).Scan(&got); err != nil {
			return err
		}
		if !got {
			return kettle.ErrExpiring
		}
		// The count may take minutes on a big partition: no statement timeout.
		if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = 0"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "LOCK TABLE "+part+" IN SHARE MODE"); err != nil {
			return err
		}
		rows, _ := tx.Query(ctx, "SELECT device, count(*) FROM "+part+" GROUP BY device ORDER BY device")
		var (
			ids    []kettle.DeviceID
			counts []int64
		)
		for rows.Next() {
			var id kettle.DeviceID
			var n int64
			if err := rows.Scan(&id, &n); err != nil {
				rows.Close()
				return err
			}
			ids, counts = append(ids, id), append(counts, n)
			removed += n
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("count %s: %w", part, err)
		}
		// The kettles' counts, into device_expired, not devices, whose rows
		// writers lock first (migration 7): no writer waits for this, so it
		// goes before the table lock, which writers do wait for.
		if len(ids) > 0 {
			if _, err := tx.Exec(ctx, `INSERT INTO device_expired AS x (id, n) SELECT * FROM unnest($1::uuid[], $2::int8[])
				ON CONFLICT (id) DO UPDATE SET n = x.n + excluded.n`, ids, counts); err != nil {
				return err
			}
		}
		if s.expireCounted != nil {
			s.expireCounted()
		}
		if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", expireLockWait.Milliseconds())); err != nil {
			return err
		}
		for attempt := 1; ; attempt++ {
			if _, err := tx.Exec(ctx, "SAVEPOINT kettle_expire"); err != nil {
				return err
			}
			err := s.expireLocked(ctx, tx, p, removed)
			if err == nil {
				return nil
			}
			var pgErr *pgconn.PgError
			if attempt == expireAttempts || !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
				return err
			}
			if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT kettle_expire"); err != nil {
				return err
			}
		}
	})
	if err != nil {
		if errors.Is(err, kettle.ErrExpiring) {
			return 0, fmt.Errorf("expire %s: %w", part, err)
		}
		if errors.Is(err, errExpireWaiter) || errors.Is(err, errExpireReader) {
			return 0, &kettle.Error{Code: kettle.EUnavailable, Message: fmt.Sprintf("expire %s: %v; left for the next round", part, err), RetryAfter: time.Minute}
		}
		var ke *kettle.Error
		if errors.As(err, &ke) {
			return 0, err
		}
		return 0, unavailable("expire "+part, err)
	}
	s.partMu.Lock()
	for d := p.from; d < p.to; d++ {
		delete(s.parts, d)
	}
	s.partStarts = nil
	s.partMu.Unlock()
	if _, err := s.pool.Exec(ctx, "DROP TABLE IF EXISTS "+part+expiredSuffix); err != nil {
		return removed, unavailable(fmt.Sprintf("expire: drop the detached %s (its readings are expired; the next Expire drops it)", part), err)
	}
	return removed, nil
}

// dropDetached drops the partitions a previous Expire detached but did not
// drop (it failed or the process died between the two).
func (s *Store) dropDetached(ctx context.Context) error {
	rows, _ := s.pool.Query(ctx, `SELECT c.relname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
		WHERE ns.nspname = current_schema() AND c.relkind = 'r' AND NOT c.relispartition
		AND c.relname ~ '^measurements_y[0-9]{4}m[0-9]{2}(d[0-9]{2})?_expired$'`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return unavailable("expire: list detached partitions", err)
	}
	for _, n := range names {
		if _, err := s.pool.Exec(ctx, "DROP TABLE IF EXISTS "+pgx.Identifier{n}.Sanitize()); err != nil {
			return unavailable("expire: drop the detached "+n, err)
		}
	}
	return nil
}

// expireLocked is the last step of expirePartition: lock, drop, adjust.
func (s *Store) expireLocked(ctx context.Context, tx pgx.Tx, p partition, removed int64) error {
	part := p.name
	var waiting bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'relation'
		AND relation = $1::regclass AND NOT granted)`, part).Scan(&waiting); err != nil {
		return err
	}
	if waiting {
		return errExpireWaiter
	}
	// A transaction that has read measurements for longer than a lock wait
	// (pg_dump holds ACCESS SHARE on it for its whole run) would hold the
	// lock below for as long, each of our waits making every insert queue
	// behind it: leave the partition for the next round instead.
	var reader string
	if err := tx.QueryRow(ctx, `SELECT coalesce(min(a.application_name || ' (pid ' || a.pid || ', in a transaction for '
			|| round(extract(epoch FROM clock_timestamp() - a.xact_start)) || ' s)'), '')
		FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'relation' AND l.relation = 'measurements'::regclass AND l.granted
		AND l.pid <> pg_backend_pid() AND a.xact_start < clock_timestamp() - $1::interval`, expireLockWait).Scan(&reader); err != nil {
		return err
	}
	if reader != "" {
		return fmt.Errorf("%w: %s", errExpireReader, reader)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE measurements IN ACCESS EXCLUSIVE MODE"); err != nil {
		return err
	}
	// From here no writer is inside its transaction: each inserts into
	// measurements before it touches rollups, hours_of_day and totals.
	// Detached and renamed here, dropped after the commit (expirePartition):
	// dropping unlinks the partition's files at commit, hundreds of
	// milliseconds for a big one, with the table still locked. Renamed, so that a
	// writer whose cache still names the partition (a COPY straight into
	// it) finds no such table and creates the partition anew, instead of
	// writing into the table about to be dropped.
	if _, err := tx.Exec(ctx, "ALTER TABLE measurements DETACH PARTITION "+part); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "ALTER TABLE "+part+" RENAME TO "+part+expiredSuffix); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "DELETE FROM rollups WHERE hour >= $1 AND hour < $2", dayStart(p.from), dayStart(p.to)); err != nil {
		return err
	}
	if err := rebuildHoursOfDay(ctx, tx); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, "UPDATE totals SET measurements = measurements - $1 WHERE id = 0", removed)
	return err
}

// rebuildHoursOfDay sets the all-history moments per hour of day to the
// merge of the rollups, in (hour, shard) order, into shard 0 (the other
// shards emptied). Called with writers locked out.
func rebuildHoursOfDay(ctx context.Context, tx pgx.Tx) error {
	var hods [24]hourAgg
	var h time.Time
	var w, a kettle.Moments
	rows, _ := tx.Query(ctx, "SELECT hour, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM rollups ORDER BY hour, shard")
	_, err := pgx.ForEachRow(rows, []any{&h, &w.N, &w.Mean, &w.M2, &a.Mean, &a.M2}, func() error {
		a.N = w.N
		d := &hods[h.UTC().Hour()]
		d.water, d.ambient = d.water.Merge(w), d.ambient.Merge(a)
		return nil
	})
	if err != nil {
		return fmt.Errorf("rebuild hours of day: %w", err)
	}
	if _, err := tx.Exec(ctx, "UPDATE hours_of_day SET n = 0, water_mean = 0, water_m2 = 0, ambient_mean = 0, ambient_m2 = 0"); err != nil {
		return err
	}
	for hod, d := range hods {
		if d.water.N == 0 {
			continue
		}
		if _, err := tx.Exec(ctx, `INSERT INTO hours_of_day (hod, shard, n, water_mean, water_m2, ambient_mean, ambient_m2)
			VALUES ($1, 0, $2, $3, $4, $5, $6)
			ON CONFLICT (hod, shard) DO UPDATE SET n = excluded.n, water_mean = excluded.water_mean, water_m2 = excluded.water_m2,
				ambient_mean = excluded.ambient_mean, ambient_m2 = excluded.ambient_m2`,
			int16(hod), d.water.N, d.water.Mean, d.water.M2, d.ambient.Mean, d.ambient.M2); err != nil {
			return err
		}
	}
	return nil
}
