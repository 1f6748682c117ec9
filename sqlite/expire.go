package sqlite

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"

	"time"

	"github.com/kettlefleet/kettlefleet"
)

// errStagedAgain: another process staged rows between the merge and the
// expiry's transaction.
var errStagedAgain = errors.New("rows staged since the merge")

// Expire removes every measurement whose device time is before before (the
// first instant of a UTC month) and takes them out of the derived figures,
// in one write transaction: each device's measurement count and the
// fleet's, the hours' rollups, and the all-history moments per hour of day
// (rebuilt from the rollups that remain). A device's latest state, capacity
// and last-seen time stay. It first merges the staged rows, so that every
// measurement is in the measurements table, and finds each device's old
// rows by its primary key (device, t). Writers wait for it: the embedded
// store is for fleets whose month of history deletes in seconds.
func (s *Store) Expire(ctx context.Context, before time.Time) (int64, error) {
	if err := kettle.CheckMonthStart(before); err != nil {
		return 0, err
	}
	bound := before.UnixMicro()
	s.wmu.Lock()
	defer s.wmu.Unlock()
	for attempt := 0; ; attempt++ {
		if err := s.mergeLocked(ctx); err != nil {
			return 0, fmt.Errorf("sqlite expire: %w", err)
		}
		n, err := s.expire(ctx, bound)
		if errors.Is(err, errStagedAgain) && attempt < 3 {
			continue
		}
		if err != nil {
			s.cache.valid = false
			return 0, fmt.Errorf("sqlite expire: %w", err)
		}
		return n, nil
	}
}

// expire is Expire's transaction, under wmu with nothing staged.
func (s *Store) expire(ctx context.Context, bound int64) (int64, error) {
	type devCount struct {
		id kettle.DeviceID
		n  int64
	}
	var (
		removed int64
		counts  []devCount
	)
	err := s.tx(ctx, "expire measurements", func(tx *sql.Tx) error {
		removed, counts = 0, counts[:0]
		if err := s.syncCache(ctx, tx); err != nil {
			return err
		}
		if s.stage.rows != 0 {
			return errStagedAgain
		}
		ids := make([]kettle.DeviceID, 0, len(s.cache.devs))
		for id := range s.cache.devs {
			ids = append(ids, id)
		}
		slices.SortFunc(ids, func(a, b kettle.DeviceID) int { return bytes.Compare(a[:], b[:]) })
		del, err := tx.PrepareContext(ctx, `DELETE FROM measurements WHERE device = ? AND t < ?`)
		if err != nil {
			return err
		}
		defer del.Close()
		upd, err := tx.PrepareContext(ctx, `UPDATE devices SET measurements = measurements - ? WHERE id = ?`)
		if err != nil {
			return err
		}
		defer upd.Close()
		for _, id := range ids {
			res, err := del.ExecContext(ctx, id[:], bound)
			if err != nil {
				return fmt.Errorf("delete measurements of %s: %w", id, err)
			}
			n, err := res.RowsAffected()
			if err != nil {
				return err
			}
			if n == 0 {
				continue
			}
			if _, err := upd.ExecContext(ctx, n, id[:]); err != nil {
				return fmt.Errorf("count of %s: %w", id, err)
			}
			counts = append(counts, devCount{id, n})
			removed += n
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM rollups WHERE hour < ?`, hourOf(bound)*3600); err != nil {
			return fmt.Errorf("delete rollups: %w", err)
		}
		if err := rebuildHoursOfDay(ctx, tx); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE totals SET measurement_count = measurement_count - ? WHERE id = 0`, removed); err != nil {
			return fmt.Errorf("update totals: %w", err)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	for _, c := range counts {
		st := s.cache.devs[c.id]
		st.n -= c.n
		s.cache.devs[c.id] = st
	}
	return removed, nil
}

// rebuildHoursOfDay sets the all-history moments per hour of day to the
// merge of the rollups, in hour order.
func rebuildHoursOfDay(ctx context.Context, tx *sql.Tx) error {
	var w, a [24]kettle.Moments
	rows, err := tx.QueryContext(ctx, `SELECT hour, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM rollups ORDER BY hour`)
	if err != nil {
		return fmt.Errorf("rebuild hours of day: %w", err)
	}
	defer rows.Close()
	var hour int64
	var rw, ra kettle.Moments
	for rows.Next() {
		if err := rows.Scan(&hour, &rw.N, &rw.Mean, &rw.M2, &ra.Mean, &ra.M2); err != nil {
			return fmt.Errorf("rebuild hours of day: %w", err)
		}
		ra.N = rw.N
		hod := floorMod(hour/3600, 24)
		w[hod], a[hod] = w[hod].Merge(rw), a[hod].Merge(ra)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("rebuild hours of day: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM hours_of_day`); err != nil {
		return err
	}
	for hod := range w {
		if w[hod].N == 0 {
			continue
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO hours_of_day(hod, n, water_mean, water_m2, ambient_mean, ambient_m2) VALUES (?,?,?,?,?,?)`,
			hod, w[hod].N, w[hod].Mean, w[hod].M2, a[hod].Mean, a[hod].M2); err != nil {
			return fmt.Errorf("rebuild hours of day: %w", err)
		}
	}
	return nil
}
