package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Register creates the devices that do not exist yet, registered at at.
func (s *Store) Register(ctx context.Context, ids []kettle.DeviceID, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	atUS := at.UnixMicro()
	err := s.tx(ctx, "register devices", func(tx *sql.Tx) error {
		reg := tx.StmtContext(ctx, s.regDev)
		var added int64
		for i := range ids {
			res, err := reg.ExecContext(ctx, ids[i][:], atUS)
			if err != nil {
				return err
			}
			n, err := res.RowsAffected()
			if err != nil {
				return err
			}
			added += n
		}
		if added == 0 {
			return nil
		}
		_, err := tx.StmtContext(ctx, s.devCount).ExecContext(ctx, added)
		return err
	})
	if err != nil {
		return fmt.Errorf("sqlite register %d devices: %w", len(ids), err)
	}
	return nil
}

// Write stores batch in one transaction and returns per row whether it was a
// duplicate. See kettle.Store.
//
// The transaction: one INSERT OR IGNORE per row (rows affected 0 = duplicate,
// which also catches a repeat inside the batch); then, aggregated in Go over
// the rows that were new, one read and one write per touched device, hour
// and hour of day, and one of the totals row. Statements run without a
// cancellable context (the driver would start a goroutine per statement for
// one); ctx is checked between rows and governs BEGIN and COMMIT.
func (s *Store) Write(ctx context.Context, batch []kettle.Measurement, receivedAt time.Time) ([]bool, error) {
	dup := make([]bool, len(batch))
	if len(batch) == 0 {
		return dup, nil
	}
	err := s.tx(ctx, "write batch", func(tx *sql.Tx) error {
		return s.writeBatch(ctx, tx, batch, receivedAt.UnixMicro(), dup)
	})
	if err != nil {
		return nil, fmt.Errorf("sqlite write batch of %d: %w", len(batch), err)
	}
	return dup, nil
}

// devAgg is what one batch changes about one device.
type devAgg struct {
	newest   int // index in the batch of the new row with the greatest time
	n        int64
	maxLevel float64
}

// momentsAgg is what one batch adds to one hour or hour of day.
type momentsAgg struct {
	key            int64
	water, ambient kettle.Moments
}

func (s *Store) writeBatch(ctx context.Context, tx *sql.Tx, batch []kettle.Measurement, recv int64, dup []bool) error {
	nc := context.WithoutCancel(ctx)
	ins := tx.StmtContext(nc, s.insMeas)
	var added int64
	for i := range batch {
		if i&255 == 255 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		m := &batch[i]
		res, err := ins.ExecContext(nc, m.Device[:], m.Time.UnixMicro(),
			m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML)
		if err != nil {
			return fmt.Errorf("insert measurement %d: %w", i, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		dup[i] = n == 0
		if n > 0 {
			added++
		}
	}
	if added == 0 {
		return nil
	}

	// Aggregate the new rows in Go, in batch order so that float results do
	// not depend on map iteration order.
	devIdx := make(map[kettle.DeviceID]int, min(len(batch), 1024))
	devs := make([]devAgg, 0, min(len(batch), 1024))
	order := make([]kettle.DeviceID, 0, cap(devs))
	hourIdx := make(map[int64]int, 4)
	var hours []momentsAgg
	var hods [24]momentsAgg
	var hodOrder []int
	for i := range batch {
		if dup[i] {
			continue
		}
		m := &batch[i]
		t := m.Time.UnixMicro()
		k, ok := devIdx[m.Device]
		if !ok {
			k = len(devs)
			devIdx[m.Device] = k
			devs = append(devs, devAgg{newest: i, maxLevel: m.LevelML})
			order = append(order, m.Device)
		} else if d := &devs[k]; t > batch[d.newest].Time.UnixMicro() {
			d.newest = i
		}
		d := &devs[k]
		d.n++
		d.maxLevel = max(d.maxLevel, m.LevelML)

		h := hourOf(t)
		j, ok := hourIdx[h]
		if !ok {
			j = len(hours)
			hourIdx[h] = j
			hours = append(hours, momentsAgg{key: h * 3600})
		}
		hours[j].water.Add(m.WaterC)
		hours[j].ambient.Add(m.AmbientC)
		hod := int(floorMod(h, 24))
		if hods[hod].water.N == 0 {
			hods[hod].key = int64(hod)
			hodOrder = append(hodOrder, hod)
		}
		hods[hod].water.Add(m.WaterC)
		hods[hod].ambient.Add(m.AmbientC)
	}

	tot, err := readTotals(tx.StmtContext(nc, s.selTotals).QueryRowContext(nc))
	if err != nil {
		return fmt.Errorf("read totals: %w", err)
	}
	tot.measurements += added

	seenDelta := make(map[int64]int64, 8)
	sel := tx.StmtContext(nc, s.selDev)
	insDev := tx.StmtContext(nc, s.insDev)
	updLatest := tx.StmtContext(nc, s.updDevLatest)
	upd := tx.StmtContext(nc, s.updDev)
	for k := range devs {
		d := &devs[k]
		id := order[k][:]
		m := &batch[d.newest]
		t := m.Time.UnixMicro()
		var (
			oldSeen, oldT                   sql.NullInt64
			oldCharge, oldLevel, oldW, oldA sql.NullFloat64
		)
		err := sel.QueryRowContext(nc, id).Scan(&oldSeen, &oldT, &oldCharge, &oldLevel, &oldW, &oldA)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("read device: %w", err)
		}
		// last_seen never goes back, even if the server clock does.
		seen := recv
		if oldSeen.Valid && oldSeen.Int64 >= recv {
			seen = oldSeen.Int64
		} else {
			if oldSeen.Valid {
				seenDelta[oldSeen.Int64]--
			}
			seenDelta[recv]++
		}
		switch {
		case errors.Is(err, sql.ErrNoRows):
			tot.devices++
			_, err = insDev.ExecContext(nc, id, recv, recv, d.n, d.maxLevel,
				t, m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML)
			if err != nil {
				return fmt.Errorf("insert device: %w", err)
			}
			tot.addLatest(m, 1)
		case !oldT.Valid || t > oldT.Int64:
			_, err = updLatest.ExecContext(nc, seen, d.n, d.maxLevel,
				t, m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML, id)
			if err != nil {
				return fmt.Errorf("update device: %w", err)
			}
			if oldT.Valid {
				old := kettle.Measurement{ChargeMWh: oldCharge.Float64, LevelML: oldLevel.Float64, WaterC: oldW.Float64, AmbientC: oldA.Float64}
				tot.addLatest(&old, -1)
			}
			tot.addLatest(m, 1)
		default: // back-dated: latest stays
			if _, err = upd.ExecContext(nc, seen, d.n, d.maxLevel, id); err != nil {
				return fmt.Errorf("update device: %w", err)
			}
		}
	}

	if err := s.moveSeen(nc, tx, seenDelta); err != nil {
		return fmt.Errorf("update last-seen counts: %w", err)
	}

	if err := mergeMoments(nc, tx.StmtContext(nc, s.selRollup), tx.StmtContext(nc, s.putRollup), hours); err != nil {
		return fmt.Errorf("merge hourly rollups: %w", err)
	}
	byHod := make([]momentsAgg, len(hodOrder))
	for i, h := range hodOrder {
		byHod[i] = hods[h]
	}
	if err := mergeMoments(nc, tx.StmtContext(nc, s.selHod), tx.StmtContext(nc, s.putHod), byHod); err != nil {
		return fmt.Errorf("merge hour-of-day rollups: %w", err)
	}

	_, err = tx.StmtContext(nc, s.putTotals).ExecContext(nc, tot.measurements, tot.devices,
		tot.charge.sum, tot.charge.c, tot.level.sum, tot.level.c, tot.potential.sum, tot.potential.c)
	if err != nil {
		return fmt.Errorf("update totals: %w", err)
	}
	return nil
}

// moveSeen applies the changes in how many devices have each last_seen
// value, dropping values no device has any more.
func (s *Store) moveSeen(ctx context.Context, tx *sql.Tx, delta map[int64]int64) error {
	add, sub, del := tx.StmtContext(ctx, s.addSeen), tx.StmtContext(ctx, s.subSeen), tx.StmtContext(ctx, s.delSeen)
	for at, n := range delta {
		var err error
		switch {
		case n > 0:
			_, err = add.ExecContext(ctx, at, n)
		case n < 0:
			if _, err = sub.ExecContext(ctx, -n, at); err == nil {
				_, err = del.ExecContext(ctx, at)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// mergeMoments merges each aggregate into its stored row (Chan et al., as
// kettle.Moments.Merge), creating the row when there is none.
func mergeMoments(ctx context.Context, sel, put *sql.Stmt, aggs []momentsAgg) error {
	for _, a := range aggs {
		var w, am kettle.Moments
		err := sel.QueryRowContext(ctx, a.key).Scan(&w.N, &w.Mean, &w.M2, &am.Mean, &am.M2)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		am.N = w.N
		w, am = w.Merge(a.water), am.Merge(a.ambient)
		if _, err := put.ExecContext(ctx, a.key, w.N, w.Mean, w.M2, am.Mean, am.M2); err != nil {
			return err
		}
	}
	return nil
}

// totals mirrors the totals row.
type totals struct {
	measurements, devices    int64
	charge, level, potential ksum
}

func readTotals(row *sql.Row) (totals, error) {
	var t totals
	err := row.Scan(&t.measurements, &t.devices, &t.charge.sum, &t.charge.c,
		&t.level.sum, &t.level.c, &t.potential.sum, &t.potential.c)
	return t, err
}

// addLatest adds (sign 1) or removes (sign −1) one latest state's share.
// The old state is removed as its own term rather than folded into a
// difference, so that each term is exact input to the compensated sum.
func (t *totals) addLatest(m *kettle.Measurement, sign float64) {
	t.charge.add(sign * m.ChargeMWh)
	t.level.add(sign * m.LevelML)
	t.potential.add(sign * m.PotentialCmL())
}

// ksum is a Neumaier-compensated running sum: value() is sum + c.
type ksum struct{ sum, c float64 }

func (k *ksum) add(x float64) {
	t := k.sum + x
	if math.Abs(k.sum) >= math.Abs(x) {
		k.c += (k.sum - t) + x
	} else {
		k.c += (x - t) + k.sum
	}
	k.sum = t
}

func (k ksum) value() float64 { return k.sum + k.c }

// hourOf is the index of the UTC hour holding unix microsecond t.
func hourOf(us int64) int64 { return floorDiv(us, int64(time.Hour/time.Microsecond)) }

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

func floorMod(a, b int64) int64 { return a - floorDiv(a, b)*b }

// SetOverride stores o for device id, or returns ENotFound.
func (s *Store) SetOverride(ctx context.Context, id kettle.DeviceID, o kettle.Override) error {
	err := s.tx(ctx, "set override", func(tx *sql.Tx) error {
		res, err := tx.StmtContext(ctx, s.setOv).ExecContext(ctx,
			nullBool(o.Charge), nullBool(o.Fill), nullFloat(o.FlushMLPerS), o.ExpiresAt.UnixMicro(), o.SetAt.UnixMicro(), id[:])
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil {
			return err
		} else if n == 0 {
			return notFound(id)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("sqlite set override of %s: %w", id, err)
	}
	return nil
}

// ClearOverride removes device id's override; no error when there is none
// or the device is unknown.
func (s *Store) ClearOverride(ctx context.Context, id kettle.DeviceID) error {
	err := s.tx(ctx, "clear override", func(tx *sql.Tx) error {
		_, err := tx.StmtContext(ctx, s.clearOv).ExecContext(ctx, id[:])
		return err
	})
	if err != nil {
		return fmt.Errorf("sqlite clear override of %s: %w", id, err)
	}
	return nil
}

func notFound(id kettle.DeviceID) error {
	return kettle.Errorf(kettle.ENotFound, "device %s is not registered", id)
}

func nullBool(b *bool) any {
	if b == nil {
		return nil
	}
	if *b {
		return int64(1)
	}
	return int64(0)
}

func nullFloat(f *float64) any {
	if f == nil {
		return nil
	}
	return *f
}
