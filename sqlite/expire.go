package sqlite

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// errStagedAgain: rows before the bound were staged (by another process)
// between their bucket's merge and the expiry's last transaction.
var errStagedAgain = errors.New("rows staged since the merge")

// expireTxRows is about how many readings one of Expire's transactions
// removes (it finishes the device it is at): the writer waits for one such
// transaction at a time.
const expireTxRows = 5_000

// Expire removes every measurement whose device time is before before (the
// first instant of a UTC day) and takes them out of the derived figures:
// each device's measurement count and the fleet's, the hours' rollups and
// the all-history moments per hour of day. A device's latest state,
// capacity and last-seen time stay.
//
// It goes device by device in id order, in write transactions of about
// expireTxRows readings each, releasing the writer between them so that
// batches keep committing: each device's old rows in measurements are read
// (to take their moments out of their hours' rollups and hours of day,
// Moments.Without) and deleted by primary-key range, and the counts
// lowered; staged rows are left where they are (a devices row describes the
// device's rows in measurements, see stage.go). A last transaction, after
// merging the staged buckets that hold rows before the bound (back-dated
// readings, rare), takes what is still before it (a primary-key probe per
// device),
// deletes the emptied rollups and rebuilds the hours of day from the
// rollups left, so that once Expire returns every figure is what a
// recompute from the rows gives; while it runs (and after a crash in the
// middle of it, until the next Expire, which kettle serve runs at start),
// the by-hour moments are off by float rounding at most.
func (s *Store) Expire(ctx context.Context, before time.Time) (int64, error) {
	if err := kettle.CheckDayStart(before); err != nil {
		return 0, err
	}
	n, _, err := s.expire(ctx, before.UnixMicro(), 1, expireTxRows)
	if err != nil {
		return n, fmt.Errorf("sqlite expire: %w", err)
	}
	return n, nil
}

// expire is Expire over the first share (0–1] of the devices in id order,
// in transactions of about budget readings, and its last transaction when
// share is 1. It returns the readings removed and the transactions run.
func (s *Store) expire(ctx context.Context, bound int64, share float64, budget int64) (removed int64, txs int, err error) {
	s.wmu.Lock()
	ids := make([]kettle.DeviceID, 0, len(s.cache.devs))
	for id := range s.cache.devs {
		ids = append(ids, id)
	}
	s.wmu.Unlock()
	slices.SortFunc(ids, func(x, y kettle.DeviceID) int { return bytes.Compare(x[:], y[:]) })
	ids = ids[:int(float64(len(ids))*share)]
	for len(ids) > 0 {
		n, done, err := s.expireSome(ctx, ids, bound, budget, false)
		removed += n
		txs++
		if err != nil {
			return removed, txs, err
		}
		ids = ids[done:]
	}
	if share < 1 {
		return removed, txs, nil
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	for attempt := 0; ; attempt++ {
		// Merge the buckets with staged rows before the bound (back-dated
		// readings, rare), not everything staged: the writer waits for it.
		for b := range stageBuckets {
			if s.stage.bucketRows[b] == 0 {
				continue
			}
			old, err := s.stagedBefore(ctx, s.w, b, bound)
			if err == nil && old {
				err = s.mergeBucket(ctx, b)
			}
			if err != nil {
				return removed, txs, err
			}
		}
		n, _, err := s.expireSome(ctx, nil, bound, 0, true)
		txs++
		if errors.Is(err, errStagedAgain) && attempt < 3 {
			continue
		}
		return removed + n, txs, err
	}
}

// expireSome runs one of expire's transactions: it removes the readings
// before bound of ids, in order, until about budget are gone, and returns
// how many it removed and how many of ids it went through. last: the last
// transaction (nothing staged before bound; called under wmu), over every
// device, which
// also deletes the rollups before bound and rebuilds the hours of day.
func (s *Store) expireSome(ctx context.Context, ids []kettle.DeviceID, bound int64, budget int64, last bool) (int64, int, error) {
	type devCount struct {
		id kettle.DeviceID
		n  int64
	}
	if !last {
		s.wmu.Lock()
		defer s.wmu.Unlock()
	}
	var (
		removed int64
		done    int
		counts  []devCount
	)
	err := s.tx(ctx, "expire measurements", func(tx *sql.Tx) (err error) {
		removed, done, counts = 0, 0, counts[:0]
		if err := s.syncCache(ctx, tx); err != nil {
			return err
		}
		if last {
			for b := range stageBuckets {
				if old, err := s.stagedBefore(ctx, tx, b, bound); err != nil || old {
					return cmp.Or(err, errStagedAgain)
				}
			}
			ids = ids[:0]
			for id := range s.cache.devs {
				ids = append(ids, id)
			}
			slices.SortFunc(ids, func(x, y kettle.DeviceID) int { return bytes.Compare(x[:], y[:]) })
			defer func() {
				if err == nil {
					err = finishExpire(ctx, tx, bound)
				}
			}()
		}
		sel, err := tx.PrepareContext(ctx, `SELECT t, water_c, ambient_c FROM measurements WHERE device = ? AND t < ?`)
		if err != nil {
			return err
		}
		defer sel.Close()
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
		gone := map[int64]*[2]kettle.Moments{} // hour (unix s) → water, ambient moments removed
		for _, id := range ids {
			if !last && removed >= budget {
				break
			}
			done++
			n, err := oldMoments(ctx, sel, id, bound, gone)
			if err != nil {
				return fmt.Errorf("read old measurements of %s: %w", id, err)
			}
			if n == 0 {
				continue
			}
			if _, err := del.ExecContext(ctx, id[:], bound); err != nil {
				return fmt.Errorf("delete measurements of %s: %w", id, err)
			}
			if _, err := upd.ExecContext(ctx, n, id[:]); err != nil {
				return fmt.Errorf("count of %s: %w", id, err)
			}
			counts = append(counts, devCount{id, n})
			removed += n
		}
		if removed == 0 {
			return nil
		}
		var hods [24][2]kettle.Moments
		for hour, g := range gone {
			if err := without(ctx, tx.StmtContext(ctx, s.selRollup), tx.StmtContext(ctx, s.putRollup), hour, g); err != nil {
				return fmt.Errorf("rollups: %w", err)
			}
			h := &hods[floorMod(hour/3600, 24)]
			h[0], h[1] = h[0].Merge(g[0]), h[1].Merge(g[1])
		}
		for hod := range hods {
			if hods[hod][0].N > 0 {
				if err := without(ctx, tx.StmtContext(ctx, s.selHod), tx.StmtContext(ctx, s.putHod), int64(hod), &hods[hod]); err != nil {
					return fmt.Errorf("hours of day: %w", err)
				}
			}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE totals SET measurement_count = measurement_count - ? WHERE id = 0`, removed); err != nil {
			return fmt.Errorf("update totals: %w", err)
		}
		return nil
	})
	if err != nil {
		s.cache.valid = false
		return 0, 0, err
	}
	for _, c := range counts {
		st := s.cache.devs[c.id]
		st.n -= c.n
		s.cache.devs[c.id] = st
	}
	return removed, done, nil
}

// stagedBefore reports whether bucket b has staged rows before bound (a
// range of staged's primary key).
func (s *Store) stagedBefore(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}, b int, bound int64) (bool, error) {
	var old bool
	err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM staged WHERE b = ? AND t < ?)`, b, bound).Scan(&old)
	return old, err
}

// finishExpire deletes the rollups before bound (emptied by then) and
// rebuilds the hours of day from the rollups left: exact again.
func finishExpire(ctx context.Context, tx *sql.Tx, bound int64) error {
	if _, err := tx.ExecContext(ctx, `DELETE FROM rollups WHERE hour < ?`, hourOf(bound)*3600); err != nil {
		return fmt.Errorf("delete rollups: %w", err)
	}
	return rebuildHoursOfDay(ctx, tx)
}

// oldMoments folds device id's readings before bound into gone, per hour,
// and returns how many there are.
func oldMoments(ctx context.Context, sel *sql.Stmt, id kettle.DeviceID, bound int64, gone map[int64]*[2]kettle.Moments) (int64, error) {
	rows, err := sel.QueryContext(ctx, id[:], bound)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	var (
		n, t       int64
		water, amb float64
		lastH      int64 = -1 << 62
		g          *[2]kettle.Moments
		part       [2]kettle.Moments // this device's readings of hour lastH
		flush      = func() {
			if part[0].N == 0 {
				return
			}
			g[0], g[1] = g[0].Merge(part[0]), g[1].Merge(part[1])
			part = [2]kettle.Moments{}
		}
	)
	for rows.Next() {
		if err := rows.Scan(&t, &water, &amb); err != nil {
			return 0, err
		}
		if h := hourOf(t) * 3600; h != lastH {
			flush()
			lastH = h
			if g = gone[h]; g == nil {
				g = new([2]kettle.Moments)
				gone[h] = g
			}
		}
		part[0].Add(water)
		part[1].Add(amb)
		n++
	}
	flush()
	return n, rows.Err()
}

// without takes the moments g out of the row key (an hour or an hour of
// day) that sel reads and put writes.
func without(ctx context.Context, sel, put *sql.Stmt, key int64, g *[2]kettle.Moments) error {
	var w, a kettle.Moments
	if err := sel.QueryRowContext(ctx, key).Scan(&w.N, &w.Mean, &w.M2, &a.Mean, &a.M2); err != nil {
		return fmt.Errorf("%d: %w", key, err)
	}
	a.N = w.N
	w, a = w.Without(g[0]), a.Without(g[1])
	_, err := put.ExecContext(ctx, key, w.N, w.Mean, w.M2, a.Mean, a.M2)
	return err
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
