package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/kettlefleet/kettlefleet"
)

// Measurements are partitioned by UTC day of device time: a fleet of
// 20,000 kettles at 30 s stores 57.6 million readings a day, so a partition
// stays within the sizes whose insert speed bench/pg-growth.sh measures, and
// a retention removes a day at a time. Databases made by versions that
// partitioned by month hold month partitions; those stay as
// they are, keep taking the readings of their month, and are expired whole
// once the month is past the retention. A new partition never overlaps an
// existing one: a day inside a month partition is already covered.
//
// Days are numbered from the Unix epoch (day 0 is 1970-01-01).

const secondsPerDay = 24 * 60 * 60

// dayOf is the number of the UTC day that holds t.
func dayOf(t time.Time) int {
	s := t.Unix()
	d := s / secondsPerDay
	if s%secondsPerDay < 0 {
		d--
	}
	return int(d)
}

// dayStart is the first instant of day d.
func dayStart(d int) time.Time {
	return time.Unix(int64(d)*secondsPerDay, 0).UTC()
}

// partition is one partition of measurements: its table and the days it
// covers, from to to (exclusive).
type partition struct {
	name     string
	from, to int
}

const (
	dayLayout   = "measurements_y2006m01d02" // a day's partition
	monthLayout = "measurements_y2006m01"    // a month's, made before day partitions
)

// dayPartition is the partition a store creates for day d.
func dayPartition(d int) partition {
	return partition{name: dayStart(d).Format(dayLayout), from: d, to: d + 1}
}

// parsePartition reads a partition's days from its name; ok is false for a
// name kettle did not give.
func parsePartition(name string) (partition, bool) {
	if t, err := time.Parse(dayLayout, name); err == nil && t.Format(dayLayout) == name {
		return dayPartition(dayOf(t)), true
	}
	if t, err := time.Parse(monthLayout, name); err == nil && t.Format(monthLayout) == name {
		return partition{name: name, from: dayOf(t), to: dayOf(t.AddDate(0, 1, 0))}, true
	}
	return partition{}, false
}

// listPartitions lists the partitions of measurements, oldest first.
func listPartitions(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]partition, error) {
	rows, _ := q.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'measurements'::regclass`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list partitions: %w", err)
	}
	var parts []partition
	for _, n := range names {
		if p, ok := parsePartition(n); ok {
			parts = append(parts, p)
		}
	}
	slices.SortFunc(parts, func(a, b partition) int { return a.from - b.from })
	return parts, nil
}

// cachePartitions records parts in the cache (s.partMu held).
func (s *Store) cachePartitions(parts []partition) {
	if len(parts) > 0 {
		s.partStarts = nil
	}
	for _, p := range parts {
		for d := p.from; d < p.to; d++ {
			s.parts[d] = p.name
		}
	}
}

// loadPartitions fills the cache with the partitions that exist.
func (s *Store) loadPartitions(ctx context.Context) error {
	parts, err := listPartitions(ctx, s.pool)
	if err != nil {
		return err
	}
	s.partMu.Lock()
	defer s.partMu.Unlock()
	s.cachePartitions(parts)
	return nil
}

// partitionOf names the partition that holds every time from lo to hi, if
// one does and the cache knows it: a batch COPYed straight into it skips
// tuple routing.
func (s *Store) partitionOf(lo, hi time.Time) (string, bool) {
	s.partMu.Lock()
	defer s.partMu.Unlock()
	a, b := s.parts[dayOf(lo)], s.parts[dayOf(hi)]
	return a, a != "" && a == b
}

// ensureRows makes sure the partitions of the days that rows fall in
// exist (not the days between: a backlog from 2019 creates one partition,
// not thousands). The common case, every day cached, takes no round trip.
func (s *Store) ensureRows(ctx context.Context, rows []kettle.Measurement) error {
	var days []int
	last := 0
	for i := range rows {
		if d := dayOf(rows[i].Time); (i == 0 || d != last) && !slices.Contains(days, d) {
			days = append(days, d)
			last = d
		}
	}
	return s.ensureDays(ctx, days)
}

// ensureSpan creates the partitions of days first..last.
func (s *Store) ensureSpan(ctx context.Context, first, last int) error {
	var days []int
	for d := first; d <= last; d++ {
		days = append(days, d)
	}
	return s.ensureDays(ctx, days)
}

// ensureAhead creates the partitions of today and the next
// Options.PartitionsAhead days, so that no writer waits for one at
// midnight. With them cached (every call but one a day) it takes no round
// trip.
func (s *Store) ensureAhead(ctx context.Context) error {
	today := dayOf(s.opts.Now())
	return s.ensureSpan(ctx, today, today+s.opts.PartitionsAhead)
}

// ensureDays creates the missing partitions of the days. Creation runs in
// its own transaction under an advisory lock, so concurrent writers (in
// this process or another node) never race on the catalog; under the lock
// the partitions are listed again, so a day another node covered meanwhile
// (by a day's partition, or a month's from an older node) is left as it is.
//
// A partition is created as a table of its own and then attached: ATTACH
// PARTITION takes SHARE UPDATE EXCLUSIVE on measurements, which waits for
// nobody's reads or writes and makes nobody wait, where CREATE TABLE …
// PARTITION OF takes ACCESS EXCLUSIVE: behind a long reader of
// measurements (a pg_dump holds ACCESS SHARE on it for its whole run) it
// waits, and every insert queues behind it — ingest stopped until the dump
// ended (TestPartitionBesideADump). The new table is empty, so attaching it
// scans nothing.
func (s *Store) ensureDays(ctx context.Context, days []int) error {
	s.partMu.Lock()
	var missing []int
	for _, d := range days {
		if s.parts[d] == "" {
			missing = append(missing, d)
		}
	}
	s.partMu.Unlock()
	if len(missing) == 0 {
		return nil
	}
	var existing, created []partition
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		created = created[:0]
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockPartition); err != nil {
			return err
		}
		var err error
		if existing, err = listPartitions(ctx, tx); err != nil {
			return err
		}
		for _, d := range missing {
			if covered(existing, d) {
				continue
			}
			p := dayPartition(d)
			var taken bool // a table of that name that is not a partition (a detached day being expired)
			if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", p.name).Scan(&taken); err != nil {
				return err
			}
			if taken {
				return fmt.Errorf("a table %s exists and is not a partition of measurements", p.name)
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf("CREATE TABLE %s (LIKE measurements INCLUDING DEFAULTS)", p.name)); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE measurements ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s')",
				p.name, dayStart(p.from).Format(time.RFC3339), dayStart(p.to).Format(time.RFC3339))); err != nil {
				return err
			}
			created = append(created, p)
		}
		return nil
	})
	if err != nil {
		return unavailable(fmt.Sprintf("create measurement partitions %s…%s", dayPartition(missing[0]).name, dayPartition(missing[len(missing)-1]).name), err)
	}
	s.partMu.Lock()
	s.cachePartitions(existing)
	s.cachePartitions(created)
	s.partMu.Unlock()
	return nil
}

// covered reports whether one of parts holds day d.
func covered(parts []partition, d int) bool {
	return slices.ContainsFunc(parts, func(p partition) bool { return p.from <= d && d < p.to })
}

// forgetPartitions empties the cache after the database reported a missing
// partition (someone dropped one), so the next attempt recreates it.
func (s *Store) forgetPartitions() {
	s.partMu.Lock()
	clear(s.parts)
	s.partStarts = nil
	s.partMu.Unlock()
}

// isNoPartition reports the error of an insert whose row has no partition:
// through the parent table (no partition for the row), or a COPY straight
// into a partition that is gone (undefined_table: Expire dropped it,
// perhaps on another node, after this store cached it).
func isNoPartition(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "23514" && pgErr.ConstraintName == "" || pgErr.Code == "42P01")
}
