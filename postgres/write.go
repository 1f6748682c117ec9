package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/kettlefleet/kettlefleet"
)

// key is the idempotency key of a measurement.
type key struct {
	dev kettle.DeviceID
	us  int64
}

// Register creates the devices that do not exist yet, registered at at.
func (s *Store) Register(ctx context.Context, ids []kettle.DeviceID, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	sorted := sortedUnique(ids)
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sqlRegister, sorted, at.UTC())
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		_, err = tx.Exec(ctx, sqlAddTotals, 0, tag.RowsAffected(), nil, nil, nil)
		return err
	})
	if err != nil {
		return unavailable(fmt.Sprintf("postgres register %d devices", len(ids)), err)
	}
	return nil
}

func sortedUnique(ids []kettle.DeviceID) []kettle.DeviceID {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b kettle.DeviceID) int { return bytesCompare(a, b) })
	return slices.Compact(out)
}

func bytesCompare(a, b kettle.DeviceID) int {
	for i := range a {
		if a[i] != b[i] {
			if a[i] < b[i] {
				return -1
			}
			return 1
		}
	}
	return 0
}

const (
	// Rows are inserted in id order (the caller sorts), like every lock we take.
	// The NOT EXISTS pre-check makes the common case (all known) a read:
	// an index probe is much cheaper than a speculative insertion.
	sqlRegister = `INSERT INTO devices (id, registered_at)
		SELECT u, $2 FROM unnest($1::uuid[]) u WHERE NOT EXISTS (SELECT 1 FROM devices d WHERE d.id = u)
		ON CONFLICT DO NOTHING`
	sqlLock = `SELECT id, measurements, capacity_ml, last_seen, latest_t,
		charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml
		FROM devices WHERE id = ANY($1) ORDER BY id FOR UPDATE`
	sqlInsertStaged = `INSERT INTO measurements SELECT * FROM stage ON CONFLICT DO NOTHING RETURNING device, t`
	sqlUpdateDevs   = `UPDATE devices d SET measurements = u.n, capacity_ml = u.cap, last_seen = u.seen,
		latest_t = u.t, charge_mwh = u.c, full_mwh = u.f, rate_mw = u.r, ambient_c = u.a, water_c = u.w, level_ml = u.l
		FROM unnest($1::uuid[], $2::int8[], $3::float8[], $4::timestamptz[], $5::timestamptz[],
			$6::float8[], $7::float8[], $8::float8[], $9::float8[], $10::float8[], $11::float8[])
			AS u(id, n, cap, seen, t, c, f, r, a, w, l)
		WHERE d.id = u.id`
	// The merge is kettle.Moments.Merge, operation for operation, so every
	// store computes bit-identical moments from the same partial aggregates.
	mergeMoments = `n = r.n + excluded.n,
		water_mean = r.water_mean + (excluded.water_mean - r.water_mean) * excluded.n::float8 / (r.n + excluded.n)::float8,
		water_m2 = r.water_m2 + excluded.water_m2 + (excluded.water_mean - r.water_mean) * (excluded.water_mean - r.water_mean) * r.n::float8 * excluded.n::float8 / (r.n + excluded.n)::float8,
		ambient_mean = r.ambient_mean + (excluded.ambient_mean - r.ambient_mean) * excluded.n::float8 / (r.n + excluded.n)::float8,
		ambient_m2 = r.ambient_m2 + excluded.ambient_m2 + (excluded.ambient_mean - r.ambient_mean) * (excluded.ambient_mean - r.ambient_mean) * r.n::float8 * excluded.n::float8 / (r.n + excluded.n)::float8`
	sqlMergeRollups = `INSERT INTO rollups AS r (hour, n, water_mean, water_m2, ambient_mean, ambient_m2)
		SELECT * FROM unnest($1::timestamptz[], $2::int8[], $3::float8[], $4::float8[], $5::float8[], $6::float8[])
		ON CONFLICT (hour) DO UPDATE SET ` + mergeMoments
	sqlMergeHods = `INSERT INTO hours_of_day AS r (hod, n, water_mean, water_m2, ambient_mean, ambient_m2)
		SELECT * FROM unnest($1::int2[], $2::int8[], $3::float8[], $4::float8[], $5::float8[], $6::float8[])
		ON CONFLICT (hod) DO UPDATE SET ` + mergeMoments
	sqlAddTotals = `SELECT kettle_add_totals($1, $2, $3, $4, $5)`
)

// Write stores batch in one transaction and returns per row whether it was a
// duplicate. See kettle.Store.
//
// The transaction: binary COPY of the batch (its first occurrence of each
// key) into the session's staging table; then, pipelined in one round trip,
// register unknown devices, lock the batch's devices in id order (so that two
// nodes writing overlapping devices queue instead of deadlocking) and
// INSERT … ON CONFLICT DO NOTHING RETURNING the keys that were new; then,
// aggregated in Go over the new rows and again in one round trip, the
// devices' new state, the hourly and hour-of-day rollups and, last, the
// totals row; then COMMIT.
func (s *Store) Write(ctx context.Context, batch []kettle.Measurement, receivedAt time.Time) ([]bool, error) {
	dup := make([]bool, len(batch))
	if len(batch) == 0 {
		return dup, nil
	}
	rows := make([]kettle.Measurement, 0, len(batch))
	first := make(map[key]int, len(batch)) // key → index in rows
	pos := make([]int, len(batch))         // batch index → index in rows, or -1
	for i := range batch {
		m := batch[i]
		m.Normalize()
		k := key{m.Device, m.Time.UnixMicro()}
		if _, ok := first[k]; ok {
			dup[i], pos[i] = true, -1
			continue
		}
		first[k] = len(rows)
		pos[i] = len(rows)
		rows = append(rows, m)
	}
	res, err := s.write(ctx, rows, first, receivedAt.UTC(), false)
	if err != nil {
		return nil, fmt.Errorf("postgres write batch of %d: %w", len(batch), err)
	}
	for i, p := range pos {
		if p >= 0 {
			dup[i] = !res.inserted[p]
		}
	}
	return dup, nil
}

// writeResult says which rows were new.
type writeResult struct {
	inserted []bool
	n        int64
}

// write runs the write transaction for rows, unique by key, retrying on a
// deadlock (which the lock order should prevent, but another client of the
// database may not follow it) and on a partition dropped behind our back.
// idx maps keys to rows when the caller has built it, else nil.
// bulk chooses the seeding path (see SeedCopy) and its last_seen rule.
func (s *Store) write(ctx context.Context, rows []kettle.Measurement, idx map[key]int, at time.Time, bulk bool) (writeResult, error) {
	lo, hi := rows[0].Time, rows[0].Time
	for i := range rows {
		lo, hi = minTime(lo, rows[i].Time), maxTime(hi, rows[i].Time)
	}
	var lastErr error
	for attempt := 0; attempt < 4; attempt++ {
		if err := s.ensureRows(ctx, rows); err != nil {
			return writeResult{}, err
		}
		res, err := s.writeOnce(ctx, rows, idx, at, bulk, lo, hi)
		if err == nil {
			return res, nil
		}
		lastErr = err
		var pgErr *pgconn.PgError
		switch {
		case isNoPartition(err):
			s.forgetPartitions()
			if err := s.loadPartitions(ctx); err != nil {
				return writeResult{}, err
			}
		case errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001"):
			// deadlock or serialization failure: run it again
		default:
			return writeResult{}, unavailable("write", err)
		}
	}
	return writeResult{}, unavailable("write (4 attempts)", lastErr)
}

// devState is a device row as locked by the write transaction.
type devState struct {
	n        int64
	capML    float64
	lastSeen *time.Time
	latest   *kettle.Measurement
	// changed by this batch
	touched bool
	newest  int // index in rows of the newest inserted row
	seenMax time.Time
}

func (s *Store) writeOnce(ctx context.Context, rows []kettle.Measurement, idx map[key]int, at time.Time, bulk bool, lo, hi time.Time) (res writeResult, err error) {
	ids := make([]kettle.DeviceID, 0, 16)
	{
		seen := make(map[kettle.DeviceID]struct{}, 16)
		var prev kettle.DeviceID
		for i := range rows {
			if d := rows[i].Device; i == 0 || d != prev {
				prev = d
				if _, ok := seen[d]; !ok {
					seen[d] = struct{}{}
					ids = append(ids, d)
				}
			}
		}
	}
	ids = sortedUnique(ids)

	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		if err != nil {
			tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	conn := tx.Conn().PgConn()
	if !bulk {
		if _, err := conn.CopyFrom(ctx, newCopyReader(rows), "COPY stage "+copyColumns+" FROM STDIN (FORMAT binary)"); err != nil {
			return res, fmt.Errorf("copy into staging table: %w", err)
		}
	}

	b := &pgx.Batch{}
	b.Queue(sqlRegister, ids, at)
	b.Queue(sqlLock, ids)
	if !bulk {
		b.Queue(sqlInsertStaged)
	}
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err != nil {
		br.Close()
		return res, fmt.Errorf("register devices: %w", err)
	}
	newDevs := tag.RowsAffected()
	devs := make(map[kettle.DeviceID]*devState, len(ids))
	if err := lockedDevices(br, devs); err != nil {
		br.Close()
		return res, fmt.Errorf("lock devices: %w", err)
	}
	res.inserted = make([]bool, len(rows))
	if !bulk {
		if idx == nil {
			idx = indexRows(rows)
		}
		if err := markInserted(br, idx, res.inserted); err != nil {
			br.Close()
			return res, fmt.Errorf("insert measurements: %w", err)
		}
	}
	if err := br.Close(); err != nil {
		return res, err
	}
	if bulk {
		if err := s.bulkInsert(ctx, tx, rows, ids, idx, lo, hi, res.inserted); err != nil {
			return res, err
		}
	}

	// Aggregate the new rows in Go, in row order so that float results do not
	// depend on map iteration order.
	var hours []hourAgg
	hourIdx := map[int64]int{}
	var hods [24]hourAgg
	for i := range rows {
		if !res.inserted[i] {
			continue
		}
		res.n++
		m := &rows[i]
		d := devs[m.Device]
		if !d.touched {
			d.touched, d.newest = true, i
		} else if m.Time.After(rows[d.newest].Time) {
			d.newest = i
		}
		d.n++
		d.capML = max(d.capML, m.LevelML)
		if m.Time.After(d.seenMax) {
			d.seenMax = m.Time
		}
		h := m.Time.UnixMicro() / int64(time.Hour/time.Microsecond)
		j, ok := hourIdx[h]
		if !ok {
			j = len(hours)
			hourIdx[h] = j
			hours = append(hours, hourAgg{hour: h})
		}
		hours[j].water.Add(m.WaterC)
		hours[j].ambient.Add(m.AmbientC)
		hod := &hods[h%24]
		hod.hour = h % 24
		hod.water.Add(m.WaterC)
		hod.ambient.Add(m.AmbientC)
	}
	if res.n == 0 && newDevs == 0 {
		return res, tx.Commit(ctx)
	}

	var u devUpdate
	var terms [3][]float64 // charge, level, potential: −old, +new per changed latest
	for _, id := range ids {
		d := devs[id]
		if !d.touched {
			continue
		}
		latest := d.latest
		if newest := &rows[d.newest]; latest == nil || newest.Time.After(latest.Time) {
			if latest != nil {
				terms[0] = append(terms[0], -latest.ChargeMWh)
				terms[1] = append(terms[1], -latest.LevelML)
				terms[2] = append(terms[2], -latest.PotentialCmL())
			}
			terms[0] = append(terms[0], newest.ChargeMWh)
			terms[1] = append(terms[1], newest.LevelML)
			terms[2] = append(terms[2], newest.PotentialCmL())
			latest = newest
		}
		seen := at
		if bulk {
			seen = d.seenMax
			if d.lastSeen != nil && d.lastSeen.After(seen) {
				seen = *d.lastSeen
			}
		}
		u.add(id, d.n, d.capML, seen, latest)
	}
	slices.SortFunc(hours, func(a, b hourAgg) int { return int(a.hour - b.hour) })
	var hodList []hourAgg
	for _, h := range hods {
		if h.water.N > 0 {
			hodList = append(hodList, h)
		}
	}

	b = &pgx.Batch{}
	if len(u.id) > 0 {
		b.Queue(sqlUpdateDevs, u.id, u.n, u.capML, u.seen, u.t, u.c, u.f, u.r, u.a, u.w, u.l)
	}
	if len(hours) > 0 {
		hourTimes := make([]time.Time, len(hours))
		for i, h := range hours {
			hourTimes[i] = time.UnixMicro(h.hour * int64(time.Hour/time.Microsecond)).UTC()
		}
		b.Queue(sqlMergeRollups, momentArgs(hourTimes, hours)...)
	}
	if len(hodList) > 0 {
		hodNums := make([]int16, len(hodList))
		for i, h := range hodList {
			hodNums[i] = int16(h.hour)
		}
		b.Queue(sqlMergeHods, momentArgs(hodNums, hodList)...)
	}
	b.Queue(sqlAddTotals, res.n, newDevs, terms[0], terms[1], terms[2])
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return res, fmt.Errorf("update devices, rollups and totals: %w", err)
	}
	return res, tx.Commit(ctx)
}

// momentArgs returns the arguments of a moments merge: key, then the columns.
func momentArgs(keys any, aggs []hourAgg) []any {
	n := make([]int64, len(aggs))
	wm, wm2, am, am2 := make([]float64, len(aggs)), make([]float64, len(aggs)), make([]float64, len(aggs)), make([]float64, len(aggs))
	for i, a := range aggs {
		n[i], wm[i], wm2[i], am[i], am2[i] = a.water.N, a.water.Mean, a.water.M2, a.ambient.Mean, a.ambient.M2
	}
	return []any{keys, n, wm, wm2, am, am2}
}

// hourAgg is what one batch adds to one hour (or hour of day).
type hourAgg struct {
	hour           int64 // hours since the unix epoch, or hour of day
	water, ambient kettle.Moments
}

// devUpdate holds the columns of sqlUpdateDevs.
type devUpdate struct {
	id               []kettle.DeviceID
	n                []int64
	capML            []float64
	seen, t          []time.Time
	c, f, r, a, w, l []float64
}

func (u *devUpdate) add(id kettle.DeviceID, n int64, capML float64, seen time.Time, m *kettle.Measurement) {
	u.id = append(u.id, id)
	u.n = append(u.n, n)
	u.capML = append(u.capML, capML)
	u.seen = append(u.seen, seen)
	u.t = append(u.t, m.Time)
	u.c = append(u.c, m.ChargeMWh)
	u.f = append(u.f, m.FullMWh)
	u.r = append(u.r, m.RateMW)
	u.a = append(u.a, m.AmbientC)
	u.w = append(u.w, m.WaterC)
	u.l = append(u.l, m.LevelML)
}

func lockedDevices(br pgx.BatchResults, devs map[kettle.DeviceID]*devState) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id         uuid.UUID
			d          devState
			lt         *time.Time
			c, f, r, a *float64
			w, l       *float64
		)
		if err := rows.Scan(&id, &d.n, &d.capML, &d.lastSeen, &lt, &c, &f, &r, &a, &w, &l); err != nil {
			return err
		}
		if lt != nil {
			d.latest = &kettle.Measurement{Device: id, Time: lt.UTC(), ChargeMWh: deref(c), FullMWh: deref(f), RateMW: deref(r), AmbientC: deref(a), WaterC: deref(w), LevelML: deref(l)}
		}
		devs[id] = &d
	}
	return rows.Err()
}

func deref(p *float64) float64 {
	if p == nil {
		return 0
	}
	return *p
}

func indexRows(rows []kettle.Measurement) map[key]int {
	idx := make(map[key]int, len(rows))
	for i := range rows {
		idx[key{rows[i].Device, rows[i].Time.UnixMicro()}] = i
	}
	return idx
}

// markInserted reads the RETURNING device, t of an insert and marks the rows.
func markInserted(br pgx.BatchResults, idx map[key]int, inserted []bool) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	defer rows.Close()
	var id uuid.UUID
	var t time.Time
	for rows.Next() {
		if err := rows.Scan(&id, &t); err != nil {
			return err
		}
		i, ok := idx[key{id, t.UnixMicro()}]
		if !ok {
			return fmt.Errorf("insert returned a row (%s, %s) that is not in the batch", id, t.UTC().Format(time.RFC3339Nano))
		}
		inserted[i] = true
	}
	return rows.Err()
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
