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

// Measurements are partitioned by calendar month (UTC) of device time. A
// month is numbered year*12 + (month-1).

func monthOf(t time.Time) int {
	t = t.UTC()
	return t.Year()*12 + int(t.Month()) - 1
}

func monthStart(m int) time.Time {
	return time.Date(m/12, time.Month(m%12+1), 1, 0, 0, 0, 0, time.UTC)
}

func partitionName(m int) string {
	return fmt.Sprintf("measurements_y%04dm%02d", m/12, m%12+1)
}

// partitionMonths lists the months whose partition exists.
func (s *Store) partitionMonths(ctx context.Context) ([]int, error) {
	rows, _ := s.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'measurements'::regclass`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list partitions: %w", err)
	}
	var months []int
	for _, n := range names {
		var y, mo int
		if _, err := fmt.Sscanf(n, "measurements_y%04dm%02d", &y, &mo); err == nil && partitionName(y*12+mo-1) == n {
			months = append(months, y*12+mo-1)
		}
	}
	return months, nil
}

// loadPartitions fills the cache with the partitions that exist.
func (s *Store) loadPartitions(ctx context.Context) error {
	months, err := s.partitionMonths(ctx)
	if err != nil {
		return err
	}
	s.partMu.Lock()
	defer s.partMu.Unlock()
	for _, m := range months {
		s.parts[m] = true
	}
	return nil
}

// ensureRows makes sure the partitions of the months that rows fall in
// exist (not the months between: a backlog from 2019 creates one partition,
// not eighty). The common case, every month cached, takes no round trip.
func (s *Store) ensureRows(ctx context.Context, rows []kettle.Measurement) error {
	var months []int
	last := -1
	for i := range rows {
		if m := monthOf(rows[i].Time); m != last && !slices.Contains(months, m) {
			months = append(months, m)
			last = m
		}
	}
	return s.ensureMonths(ctx, months)
}

// ensureSpan creates the partitions of months first..last.
func (s *Store) ensureSpan(ctx context.Context, first, last int) error {
	var months []int
	for m := first; m <= last; m++ {
		months = append(months, m)
	}
	return s.ensureMonths(ctx, months)
}

// ensureMonths creates the missing partitions of the months. Creation
// runs in its own transaction under an advisory lock, so concurrent writers
// (in this process or another node) never race on the catalog; a partition
// found existing is left as it is.
//
// A partition is created as a table of its own and then attached: ATTACH
// PARTITION takes SHARE UPDATE EXCLUSIVE on measurements, which waits for
// nobody's reads or writes and makes nobody wait, where CREATE TABLE …
// PARTITION OF takes ACCESS EXCLUSIVE: behind a long reader of
// measurements (a pg_dump holds ACCESS SHARE on it for its whole run) it
// waits, and every insert queues behind it — ingest stopped until the dump
// ended (TestPartitionBesideADump). The new table is empty, so attaching it
// scans nothing.
func (s *Store) ensureMonths(ctx context.Context, months []int) error {
	s.partMu.Lock()
	var missing []int
	for _, m := range months {
		if !s.parts[m] {
			missing = append(missing, m)
		}
	}
	s.partMu.Unlock()
	if len(missing) == 0 {
		return nil
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockPartition); err != nil {
			return err
		}
		for _, m := range missing {
			name := partitionName(m)
			var exists bool
			if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", name).Scan(&exists); err != nil {
				return err
			}
			if exists {
				continue
			}
			from, to := monthStart(m).Format(time.RFC3339), monthStart(m+1).Format(time.RFC3339)
			if _, err := tx.Exec(ctx, fmt.Sprintf("CREATE TABLE %s (LIKE measurements INCLUDING DEFAULTS)", name)); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE measurements ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s')", name, from, to)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return unavailable(fmt.Sprintf("create measurement partitions %s…%s", partitionName(missing[0]), partitionName(missing[len(missing)-1])), err)
	}
	s.partMu.Lock()
	for _, m := range missing {
		s.parts[m] = true
	}
	s.partMu.Unlock()
	return nil
}

// forgetPartitions empties the cache after the database reported a missing
// partition (someone dropped one), so the next attempt recreates it.
func (s *Store) forgetPartitions() {
	s.partMu.Lock()
	clear(s.parts)
	s.partMu.Unlock()
}

// isNoPartition reports the error of an insert whose row has no partition:
// through the parent table (no partition for the row), or a COPY straight
// into a month's partition that is gone (undefined_table: Expire dropped it,
// perhaps on another node, after this store cached it).
func isNoPartition(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "23514" && pgErr.ConstraintName == "" || pgErr.Code == "42P01")
}
