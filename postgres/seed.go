package postgres

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/kettlefleet/kettlefleet"
	"golang.org/x/sync/errgroup"
)

// SeedCopy stores rows, a bulk of generated history, in one transaction, and
// returns how many were new. It is Write without the batch limit and with a
// faster path: under the devices' row locks it checks whether any of them
// already has a measurement in its own time range in rows; if none has (the
// usual case: a first seeding) the rows are COPYed straight into their partition,
// no conflict check. Otherwise (a re-run) they go by INSERT … ON CONFLICT
// like Write, so re-seeding adds no
// duplicates. Either way the devices, rollups and totals are updated from the
// rows that were new, in the same transaction, so every derived figure stays
// exact.
//
// rows must be grouped by device (each device in one run) in strictly
// increasing time; their times are normalized in place. Unknown devices are
// registered at registeredAt. A device's last_seen becomes the greatest
// device time stored for it (history is taken to have arrived when it was
// measured), not the time of seeding.
//
// Chunks of 50,000–500,000 rows within one UTC day (one partition)
// are the sweet spot; run several SeedCopy calls in parallel for throughput.
// Rows in (device, time) order that go on where the caller's previous chunk
// of the same partition ended (seed.Chunks) append to the partition's index
// instead of inserting all over it.
func (s *Store) SeedCopy(ctx context.Context, rows []kettle.Measurement, registeredAt time.Time) (int64, error) {
	if len(rows) == 0 {
		return 0, nil
	}
	if err := checkRuns(rows); err != nil {
		return 0, err
	}
	res, err := s.write(ctx, rows, nil, registeredAt.UTC(), true)
	if err != nil {
		return 0, fmt.Errorf("postgres seed %d rows: %w", len(rows), err)
	}
	return res.n, nil
}

// bulkInsert is the insert step of SeedCopy, run with the devices locked.
//
// The check for stored rows is per device, over that device's own time span
// in rows (first to last reading): a chunk that ends in the middle of a
// device's readings and the next chunk, which starts with the rest of them,
// do not overlap, so the second goes straight in too. (Checked over the
// chunk's whole span, each chunk after the first would find its first
// device's earlier readings and go the slow way.) The chunk's span bounds
// the probe too, so only its partitions are searched.
func (s *Store) bulkInsert(ctx context.Context, c *pgx.Conn, rows []kettle.Measurement, _ []byte, idx map[key]int, lo, hi time.Time, inserted []bool) error {
	conn := c.PgConn()
	var ids []kettle.DeviceID
	var firsts, lasts []time.Time
	for i := range rows {
		if i == 0 || rows[i].Device != rows[i-1].Device {
			ids = append(ids, rows[i].Device)
			firsts = append(firsts, rows[i].Time)
			lasts = append(lasts, rows[i].Time)
		} else {
			lasts[len(lasts)-1] = rows[i].Time
		}
	}
	rr := conn.ExecParams(ctx, `SELECT count(*) FROM unnest($1::uuid[], $2::timestamptz[], $3::timestamptz[]) d(id, lo, hi)
		WHERE EXISTS (SELECT 1 FROM measurements m WHERE m.device = d.id AND m.t >= d.lo AND m.t <= d.hi AND m.t >= $4 AND m.t <= $5)`,
		[][]byte{uuidArray(ids), timestamptzArray(firsts), timestamptzArray(lasts), timestamptzBin(lo), timestamptzBin(hi)}, nil, bin(5), bin(1))
	var existing int64
	for rr.NextRow() {
		existing = decInt8(rr.Values()[0])
	}
	if _, err := rr.Close(); err != nil {
		return fmt.Errorf("check for existing measurements: %w", err)
	}
	if existing == 0 {
		table := "measurements"
		if p, ok := s.partitionOf(lo, hi); ok {
			table = p // skip tuple routing
		}
		if _, err := conn.CopyFrom(ctx, newCopyReader(rows), "COPY "+table+" "+copyColumns+" FROM STDIN (FORMAT binary)"); err != nil {
			return fmt.Errorf("copy into %s: %w", table, err)
		}
		for i := range inserted {
			inserted[i] = true
		}
		return nil
	}
	return insertNew(ctx, conn, rows, idx, inserted)
}

// SeedDone leaves a freshly seeded store compact for its readers: it folds
// last_seen_moves and every closed hour's rollup shards into shard 0 (what
// the background compactor does a slice of every second; a seeder can open
// the store with a long Options.CompactEvery and fold once here), then
// rewrites the small derived tables the statistics read (VACUUM FULL of
// rollups, hours_of_day, last_seen_counts, last_seen_moves). A seeding's
// chunks each merge hundreds of hours into rollups, which leaves tens of
// megabytes of dead row versions around a few thousand live rows, and a
// bounded-range statistic then reads pages, not rows. No figure changes.
//
// The rewrite takes each table's exclusive lock for milliseconds; it waits
// at most 1 s for it (a live writer's open transaction) and otherwise skips
// that table: autovacuum still cleans it, only less compactly.
//
// Last, VACUUM (ANALYZE) of the measurement partitions of the days from
// from to to (the seeded span) that SeedCopy filled (a DayLoad's partition
// is written frozen and analyzed already), as after any bulk load: their
// visibility map and planner statistics are set in the seeding's time. Otherwise
// autovacuum's first pass over the new rows (it starts on inserted rows
// alone) reads every seeded page in the first minutes of live traffic.
// VACUUM takes no lock that blocks writers; a partition autovacuum holds
// for longer than the 1 s lock timeout is left to it.
func (s *Store) SeedDone(ctx context.Context, from, to time.Time) error {
	if err := s.compactSeen(ctx, true); err != nil {
		return fmt.Errorf("postgres seed: fold last_seen_moves: %w", err)
	}
	for range 1000 { // foldRows a round; a 10-year hourly history of 16 shards is 280 rounds
		if err := s.compactRollups(ctx, true); err != nil {
			return fmt.Errorf("postgres seed: fold rollups: %w", err)
		}
		var left bool
		if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM rollups WHERE shard <> 0 AND hour < $1)`,
			s.opts.Now().UTC().Truncate(time.Hour)).Scan(&left); err != nil {
			return fmt.Errorf("postgres seed: fold rollups: %w", err)
		}
		if !left {
			break
		}
	}
	small := []string{"rollups", "hours_of_day", "last_seen_counts", "last_seen_moves"}
	for i := range small {
		small[i] = "VACUUM (FULL, ANALYZE) " + small[i]
	}
	if err := s.seedVacuum(ctx, small, 1); err != nil {
		return err
	}
	var parts []string
	s.partMu.Lock()
	for d := dayOf(from); d <= dayOf(to); d++ {
		if p := s.parts[d]; p != "" && !s.loadedDays[d] && !slices.Contains(parts, "VACUUM (ANALYZE) "+p) {
			parts = append(parts, "VACUUM (ANALYZE) "+p)
		}
	}
	s.partMu.Unlock()
	// The partitions several at once: a VACUUM runs on one core, and a
	// month of day partitions one after the other is a long serial tail of
	// a seeding (docs/performance.md).
	return s.seedVacuum(ctx, parts, seedVacuumStreams)
}

// seedVacuumStreams is how many connections SeedDone vacuums partitions on
// at once (at most the pool's size).
const seedVacuumStreams = 3

// seedVacuum runs the VACUUM statements over up to streams connections of
// the pool, each waiting at most 1 s for a table's lock (a live writer's
// open transaction, or autovacuum already at it: that table is left to
// autovacuum).
func (s *Store) seedVacuum(ctx context.Context, vacuums []string, streams int) error {
	streams = min(streams, len(vacuums), int(s.pool.Config().MaxConns))
	g, gctx := errgroup.WithContext(ctx)
	next := make(chan string)
	for range streams {
		g.Go(func() error {
			c, err := s.pool.Acquire(gctx)
			if err != nil {
				return fmt.Errorf("postgres seed: %w", err)
			}
			defer c.Release()
			if _, err := c.Exec(gctx, "SET lock_timeout = '1s'"); err != nil {
				return fmt.Errorf("postgres seed: %w", err)
			}
			defer c.Exec(context.WithoutCancel(gctx), "RESET lock_timeout")
			for v := range next {
				if _, err := c.Exec(gctx, v); err != nil && !isLockNotAvailable(err) {
					return fmt.Errorf("postgres seed: %s: %w", v, err)
				}
			}
			return nil
		})
	}
feed:
	for _, v := range vacuums {
		select {
		case next <- v:
		case <-gctx.Done():
			break feed
		}
	}
	close(next)
	return g.Wait()
}
