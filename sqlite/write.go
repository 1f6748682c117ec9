package sqlite

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Register creates the devices that do not exist yet, registered at at.
func (s *Store) Register(ctx context.Context, ids []kettle.DeviceID, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	atUS := at.UnixMicro()
	s.wmu.Lock()
	defer s.wmu.Unlock()
	var added []kettle.DeviceID
	err := s.tx(ctx, "register devices", func(tx *sql.Tx) error {
		added = added[:0]
		reg := tx.StmtContext(ctx, s.regDev)
		for i := range ids {
			res, err := reg.ExecContext(ctx, ids[i][:], atUS)
			if err != nil {
				return err
			}
			n, err := res.RowsAffected()
			if err != nil {
				return err
			}
			if n > 0 {
				added = append(added, ids[i])
			}
		}
		if len(added) == 0 {
			return nil
		}
		_, err := tx.StmtContext(ctx, s.devCount).ExecContext(ctx, len(added))
		return err
	})
	if err != nil {
		s.cache.valid = false
		return fmt.Errorf("sqlite register %d devices: %w", len(ids), err)
	}
	if s.cache.valid {
		for _, id := range added {
			s.cache.devs[id] = devState{}
		}
	}
	return nil
}

// Write stores batch in one transaction and returns per row whether it was a
// duplicate. See kettle.Store.
//
// The transaction: multi-row INSERT OR IGNORE … RETURNING of the batch's
// distinct keys into staged, skipping keys already in measurements (a key
// not returned was already stored; a repeat inside the batch is a duplicate
// of its first occurrence), then, aggregated in Go from the rows that were
// new and the cached device states, the registration of devices not known
// yet, the last_seen counts, a read and a write per touched hour and hour of
// day, and the totals row. The devices rows are brought up to date by the
// merge (see stage.go), not by every batch.
//
// A dense batch (many rows per device: a seeder's day of history, not a
// fleet's round of readings) goes straight into measurements, in (device,
// t) order, where each device's rows share pages anyway, and its devices
// rows are written in the same transaction; staged rows, if any, are merged
// first, so that devices rows keep describing measurements alone.
//
// The cache takes the new device states only after the commit. Statements
// run without a cancellable context (the driver would start a goroutine per
// statement for one); ctx governs BEGIN and COMMIT.
func (s *Store) Write(ctx context.Context, batch []kettle.Measurement, receivedAt time.Time) ([]bool, error) {
	return s.write(ctx, batch, receivedAt.UnixMicro(), false)
}

// SeedWrite is Write for a seeder's history: each device of the batch
// counts as seen at the time of its newest reading in it (what a fleet that
// sent that history live would have left), not at one receive time for the
// whole batch.
func (s *Store) SeedWrite(ctx context.Context, batch []kettle.Measurement) ([]bool, error) {
	return s.write(ctx, batch, 0, true)
}

// write is Write; seenAtNewest: see SeedWrite (recv is then unused).
func (s *Store) write(ctx context.Context, batch []kettle.Measurement, recv int64, seenAtNewest bool) ([]bool, error) {
	dup := make([]bool, len(batch))
	if len(batch) == 0 {
		return dup, nil
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	sc := &s.wsc
	direct := dense(batch)
	if direct && s.stage.rows > 0 {
		if err := s.mergeLocked(ctx); err != nil {
			return nil, fmt.Errorf("sqlite write batch of %d: %w", len(batch), err)
		}
	}
	err := s.tx(ctx, "write batch", func(tx *sql.Tx) error {
		if err := s.syncCache(context.WithoutCancel(ctx), tx); err != nil {
			return err
		}
		// Another process may have staged rows since the merge.
		direct = direct && s.stage.rows == 0
		return s.writeBatch(ctx, tx, batch, recv, seenAtNewest, dup, direct)
	})
	if err != nil {
		// The commit may or may not have happened: rebuild from the file.
		s.cache.valid = false
		sc.reset()
		return nil, fmt.Errorf("sqlite write batch of %d: %w", len(batch), err)
	}
	for i := range sc.devs {
		s.cache.devs[sc.devs[i].id] = sc.devs[i].st
		if !direct {
			s.stage.add(sc.devs[i].id, int(sc.devs[i].n))
		}
	}
	sc.reset()
	s.stage.poke()
	return dup, nil
}

type rowKey struct {
	dev kettle.DeviceID
	t   int64
}

// devAgg is what one batch changes about one device.
type devAgg struct {
	id       kettle.DeviceID
	newest   int // index in the batch of the new row with the greatest time
	n        int64
	maxLevel float64
	st       devState // the state after the batch
}

// momentsAgg is what one batch adds to one hour or hour of day.
type momentsAgg struct {
	key            int64
	water, ambient kettle.Moments
}

// writeScratch is Write's reusable memory. Its maps and slices keep their
// capacity between batches up to maxScratch entries.
type writeScratch struct {
	keys   map[rowKey]int32 // first index in the batch of each key
	cand   []int32          // indices of first occurrences
	devIdx map[kettle.DeviceID]int32
	devs   []devAgg
	args   []any
}

// maxScratch caps what writeScratch keeps between batches.
const maxScratch = 8192

func (w *writeScratch) reset() {
	if len(w.keys) > maxScratch {
		w.keys = nil
	}
	if len(w.devIdx) > maxScratch {
		w.devIdx = nil
	}
	clear(w.keys)
	clear(w.devIdx)
	if cap(w.devs) > maxScratch {
		w.devs = nil
	}
	if cap(w.cand) > maxScratch {
		w.cand = nil
	}
	w.cand, w.devs = w.cand[:0], w.devs[:0]
	clear(w.args[:cap(w.args)]) // drop references to the batch
	w.args = w.args[:0]
}

// dense reports whether batch should bypass the staging table: at least
// 1024 rows and on average 8 or more per device.
func dense(batch []kettle.Measurement) bool {
	if len(batch) < 1024 {
		return false
	}
	devs := make(map[kettle.DeviceID]struct{}, len(batch)/8+1)
	for i := range batch {
		devs[batch[i].Device] = struct{}{}
		if len(devs) > len(batch)/8 {
			return false
		}
	}
	return true
}

// writeBatch inserts the batch's new rows and, in the same transaction,
// what they change: the devices' states, the last-seen counts, the hourly
// and hour-of-day rollups and the totals. dup[i] is set for every row that
// was already stored (or repeated in the batch).
func (s *Store) writeBatch(ctx context.Context, tx *sql.Tx, batch []kettle.Measurement, recv int64, seenAtNewest bool, dup []bool, direct bool) error {
	nc := context.WithoutCancel(ctx)
	sc := &s.wsc
	sc.reset()
	if sc.keys == nil {
		sc.keys = make(map[rowKey]int32, len(batch))
		sc.devIdx = make(map[kettle.DeviceID]int32, len(batch))
	}
	sc.candidates(batch, dup)
	added, err := s.insertNew(ctx, tx, batch, recv, seenAtNewest, dup, direct)
	if err != nil || added == 0 {
		return err
	}
	hours, byHod := sc.aggregate(batch, dup)

	tot, err := readTotals(tx.StmtContext(nc, s.selTotals).QueryRowContext(nc))
	if err != nil {
		return fmt.Errorf("read totals: %w", err)
	}
	tot.measurements += added
	seenDelta := s.nextStates(batch, recv, seenAtNewest, &tot)
	if err := s.writeDevices(nc, tx, batch, recv, seenAtNewest, direct); err != nil {
		return err
	}
	if err := s.moveSeen(nc, tx, seenDelta); err != nil {
		return fmt.Errorf("update last-seen counts: %w", err)
	}
	if err := mergeMoments(nc, tx.StmtContext(nc, s.selRollup), tx.StmtContext(nc, s.putRollup), hours); err != nil {
		return fmt.Errorf("merge hourly rollups: %w", err)
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

// candidates puts in w.cand the index of each key's first occurrence in
// batch, the one that may be stored; later ones are duplicates whatever
// happens. Every dup[i] is set until the insert returns the row.
func (w *writeScratch) candidates(batch []kettle.Measurement, dup []bool) {
	for i := range batch {
		k := rowKey{batch[i].Device, batch[i].Time.UnixMicro()}
		if _, ok := w.keys[k]; ok {
			dup[i] = true
			continue
		}
		w.keys[k] = int32(i)
		w.cand = append(w.cand, int32(i))
		dup[i] = true // until the insert returns it
	}
}

// insertNew inserts the candidate rows into staged (or, direct, into
// measurements), clears dup of each row the insert returned (the new ones)
// and returns how many there were.
func (s *Store) insertNew(ctx context.Context, tx *sql.Tx, batch []kettle.Measurement, recv int64, seenAtNewest bool, dup []bool, direct bool) (int64, error) {
	nc := context.WithoutCancel(ctx)
	sc := &s.wsc
	// Insert in the table's key order, (bucket, time, device) for staged,
	// (device, time) for measurements: consecutive rows land on neighbouring B-tree
	// pages.
	byDevice := func(x, y *kettle.Measurement) int {
		if c := bytes.Compare(x.Device[:], y.Device[:]); c != 0 {
			return c
		}
		return x.Time.Compare(y.Time)
	}
	byTime := func(x, y *kettle.Measurement) int {
		if c := bucketOf(x.Device) - bucketOf(y.Device); c != 0 {
			return c
		}
		if c := x.Time.Compare(y.Time); c != 0 {
			return c
		}
		return bytes.Compare(x.Device[:], y.Device[:])
	}
	order, ins := byTime, &s.insStaged
	if direct {
		order, ins = byDevice, &s.insMeas
	}
	slices.SortFunc(sc.cand, func(a, b int32) int { return order(&batch[a], &batch[b]) })
	var added int64
	for off := 0; off < len(sc.cand); {
		c := chunk(len(sc.cand) - off)
		part := sc.cand[off : off+chunkSizes[c]]
		off += len(part)
		args := sc.args[:0]
		for _, i := range part {
			m := &batch[i]
			if !direct {
				args = append(args, bucketOf(m.Device))
			}
			args = append(args, m.Time.UnixMicro(), m.Device[:],
				m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML)
			if !direct {
				if seenAtNewest {
					args = append(args, m.Time.UnixMicro())
				} else {
					args = append(args, recv)
				}
			}
		}
		sc.args = args
		rows, err := tx.StmtContext(nc, ins[c]).QueryContext(nc, args...)
		if err != nil {
			return 0, fmt.Errorf("insert measurements: %w", err)
		}
		for rows.Next() {
			var (
				dev sql.RawBytes
				k   rowKey
			)
			if err := rows.Scan(&dev, &k.t); err != nil {
				rows.Close()
				return 0, fmt.Errorf("insert measurements: %w", err)
			}
			copy(k.dev[:], dev)
			i, ok := sc.keys[k]
			if !ok || !dup[i] {
				rows.Close()
				return 0, fmt.Errorf("insert measurements: returned key (%s, %d) not in the chunk", k.dev, k.t)
			}
			dup[i] = false
			added++
		}
		if err := rows.Close(); err != nil {
			return 0, fmt.Errorf("insert measurements: %w", err)
		}
		if err := rows.Err(); err != nil {
			return 0, fmt.Errorf("insert measurements: %w", err)
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
	}
	return added, nil
}

// aggregate sums the new rows of batch (dup[i] false) per device into
// w.devs and per hour and hour of day, in batch order so that float
// results do not depend on map iteration order.
func (w *writeScratch) aggregate(batch []kettle.Measurement, dup []bool) (hours, byHod []momentsAgg) {
	hourIdx := make(map[int64]int, 4)
	var hods [24]momentsAgg
	var hodOrder []int
	for i := range batch {
		if dup[i] {
			continue
		}
		m := &batch[i]
		t := m.Time.UnixMicro()
		k, ok := w.devIdx[m.Device]
		if !ok {
			k = int32(len(w.devs))
			w.devIdx[m.Device] = k
			w.devs = append(w.devs, devAgg{id: m.Device, newest: i, maxLevel: m.LevelML})
		} else if d := &w.devs[k]; t > batch[d.newest].Time.UnixMicro() {
			d.newest = i
		}
		d := &w.devs[k]
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

	byHod = make([]momentsAgg, len(hodOrder))
	for i, h := range hodOrder {
		byHod[i] = hods[h]
	}
	return hours, byHod
}

// nextStates sets each device's state after the batch (in w.devs[k].st),
// from the cache: no read of devices. It adds to tot the devices new to the
// store and the change of the latest readings, and returns the change of the
// last-seen counts.
func (s *Store) nextStates(batch []kettle.Measurement, recv int64, seenAtNewest bool, tot *totals) map[int64]int64 {
	sc := &s.wsc
	seenDelta := make(map[int64]int64, 8)
	for k := range sc.devs {
		d := &sc.devs[k]
		m := &batch[d.newest]
		old, known := s.cache.devs[d.id]
		st := old
		seen := recv
		if seenAtNewest {
			seen = m.Time.UnixMicro()
		}
		// last_seen never goes back, even if the server clock does.
		if !old.hasSeen || old.seen < seen {
			if old.hasSeen {
				seenDelta[old.seen]--
			}
			seenDelta[seen]++
			st.seen, st.hasSeen = seen, true
		}
		st.n += d.n
		if known {
			st.capML = max(old.capML, d.maxLevel)
		} else {
			tot.devices++
			st.capML = d.maxLevel
		}
		if r := readingOf(m); !old.hasLatest || r.t > old.latest.t {
			if old.hasLatest {
				prev := kettle.Measurement{ChargeMWh: old.latest.charge, LevelML: old.latest.level, WaterC: old.latest.water, AmbientC: old.latest.amb}
				tot.addLatest(&prev, -1)
			}
			tot.addLatest(m, 1)
			st.latest, st.hasLatest = r, true
		}
		d.st = st
	}
	return seenDelta
}

// writeDevices writes the devices rows the batch changes: every one when
// direct; only the devices not registered yet when staged.
func (s *Store) writeDevices(nc context.Context, tx *sql.Tx, batch []kettle.Measurement, recv int64, seenAtNewest, direct bool) error {
	sc := &s.wsc
	if direct {
		// The devices rows follow measurements in the same transaction.
		slices.SortFunc(sc.devs, func(a, b devAgg) int { return bytes.Compare(a.id[:], b.id[:]) })
		if err := s.upsertDevices(nc, tx); err != nil {
			return fmt.Errorf("update devices: %w", err)
		}
	} else {
		// Staged: the devices rows of known devices stay as they are until
		// the merge (their new states are in the cache, and in staged for a
		// reader); a device not registered yet is registered now.
		reg := tx.StmtContext(nc, s.regDev)
		for k := range sc.devs {
			if _, known := s.cache.devs[sc.devs[k].id]; known {
				continue
			}
			at := recv
			if seenAtNewest {
				at = batch[sc.devs[k].newest].Time.UnixMicro()
			}
			if _, err := reg.ExecContext(nc, sc.devs[k].id[:], at); err != nil {
				return fmt.Errorf("register device %s: %w", sc.devs[k].id, err)
			}
		}
	}

	return nil
}

// upsertDevices writes the state of every device in s.wsc.devs, in chunks.
// registered_at is bound to the last-seen time, which is the receive time
// for a device that a direct write registers.
func (s *Store) upsertDevices(ctx context.Context, tx *sql.Tx) error {
	sc := &s.wsc
	for off := 0; off < len(sc.devs); {
		c := chunk(len(sc.devs) - off)
		part := sc.devs[off : off+chunkSizes[c]]
		off += len(part)
		args := sc.args[:0]
		for k := range part {
			d := &part[k]
			l := &d.st.latest
			args = append(args, d.id[:], d.st.seen, d.st.seen, d.st.n, d.st.capML,
				l.t, l.charge, l.full, l.rate, l.amb, l.water, l.level)
		}
		sc.args = args
		if _, err := tx.StmtContext(ctx, s.upsDev[c]).ExecContext(ctx, args...); err != nil {
			return err
		}
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
	return s.updateDevice(ctx, "set override of", id, s.setOv,
		nullBool(o.Charge), nullBool(o.Fill), nullFloat(o.FlushMLPerS), o.ExpiresAt.UnixMicro(), o.SetAt.UnixMicro(), id[:])
}

// updateDevice runs st (an UPDATE of device id's row) with args in its own
// transaction: ENotFound when no row changed.
func (s *Store) updateDevice(ctx context.Context, what string, id kettle.DeviceID, st *sql.Stmt, args ...any) error {
	err := s.tx(ctx, what, func(tx *sql.Tx) error {
		res, err := tx.StmtContext(ctx, st).ExecContext(ctx, args...)
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
		return fmt.Errorf("sqlite %s %s: %w", what, id, err)
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

// Revoke marks device id revoked at at (ENotFound for an unknown device);
// revoking again keeps the first time. Its history stays.
func (s *Store) Revoke(ctx context.Context, id kettle.DeviceID, at time.Time) error {
	return s.updateDevice(ctx, "revoke", id, s.revoke, at.UnixMicro(), id[:])
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
