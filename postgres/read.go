package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kettlefleet/kettlefleet"
)

// Statistics reads the totals rows, counts the reporting devices and merges
// the rollups of the range by hour of day, in one round trip and one
// REPEATABLE READ snapshot. An open range reads the 24 hour-of-day rows of
// each shard in use; a bounded one reads one row per hour in the range and
// shard. Neither reads history.
func (s *Store) Statistics(ctx context.Context, q kettle.StatsQuery) (kettle.Statistics, error) {
	var st kettle.Statistics
	for h := range st.ByHour {
		st.ByHour[h].Hour = h
	}
	open := q.From.IsZero() && q.To.IsZero()
	// BEGIN, the queries and COMMIT go in one round trip (a pgx.Tx would
	// take three): this is the operator's dashboard query, latency matters.
	err := func() error {
		conn, err := s.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release() // left in a transaction after an error: closed, not reused
		b := &pgx.Batch{}
		b.Queue(`BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY`)
		// The totals' shards (migration 4), added up with compensation.
		b.Queue(`SELECT measurements, devices, charge, charge_c, level, level_c, potential, potential_c FROM totals ORDER BY id`).
			Query(func(rows pgx.Rows) error {
				defer rows.Close()
				var sums [3]ksum
				for rows.Next() {
					var n, d int64
					var v [6]float64
					if err := rows.Scan(&n, &d, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]); err != nil {
						return err
					}
					st.MeasurementCount += n
					st.DevicesRegistered += d
					for i := range sums {
						sums[i].add(v[2*i])
						sums[i].add(v[2*i+1])
					}
				}
				st.TotalChargeMWh, st.TotalWaterML, st.TotalPotentialCmL = sums[0].s+sums[0].c, sums[1].s+sums[1].c, sums[2].s+sums[2].c
				return rows.Err()
			})
		// From last_seen_counts (migration 3) and the changes not yet folded
		// into it (last_seen_moves, migrations 4 and 9: a row per batch of
		// the last second or so): a handful of rows, not a scan of devices.
		since := time.Time{}
		if !q.ReportingSince.IsZero() {
			since = q.ReportingSince.UTC()
		}
		b.Queue(`SELECT (SELECT coalesce(sum(n), 0) FROM last_seen_counts WHERE at >= $1)::int8
			+ (SELECT coalesce(sum(u.n), 0) FROM last_seen_moves m, unnest(m.at, m.n) u(at, n) WHERE u.at >= $1)::int8`, since).
			QueryRow(func(r pgx.Row) error { return r.Scan(&st.DevicesReporting) })
		merge := func(rows pgx.Rows, hod func(k time.Time, h int16) int) error {
			defer rows.Close()
			// Scanned into once per query, not once per row: their
			// addresses go to Scan, so declared in the loop each would be
			// a heap allocation a row, and so would Scan's argument slice
			// (696 rows for 29 days of hours: a quarter of the bounded
			// range's CPU went to allocating them).
			var (
				t    time.Time
				h    int16
				w, a kettle.Moments
			)
			dst := []any{&h, &w.N, &w.Mean, &w.M2, &a.Mean, &a.M2}
			if !open {
				dst[0] = &t
			}
			for rows.Next() {
				if err := rows.Scan(dst...); err != nil {
					return err
				}
				a.N = w.N
				i := hod(t, h)
				if i < 0 || i > 23 {
					return fmt.Errorf("hour of day %d out of range", i)
				}
				bh := &st.ByHour[i]
				bh.Water, bh.Ambient = bh.Water.Merge(w), bh.Ambient.Merge(a)
				st.RangeCount += w.N
			}
			return rows.Err()
		}
		if open {
			b.Queue(`SELECT hod, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM hours_of_day ORDER BY hod, shard`).
				Query(func(rows pgx.Rows) error { return merge(rows, func(_ time.Time, h int16) int { return int(h) }) })
		} else {
			var conds []string
			var args []any
			if !q.From.IsZero() {
				args = append(args, q.From.UTC().Truncate(time.Hour))
				conds = append(conds, fmt.Sprintf("hour >= $%d", len(args)))
			}
			if !q.To.IsZero() {
				args = append(args, q.To.UTC().Truncate(time.Hour))
				conds = append(conds, fmt.Sprintf("hour < $%d", len(args)))
			}
			b.Queue(`SELECT hour, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM rollups WHERE `+strings.Join(conds, " AND ")+` ORDER BY hour, shard`, args...).
				Query(func(rows pgx.Rows) error {
					return merge(rows, func(t time.Time, _ int16) int { return t.UTC().Hour() })
				})
		}
		b.Queue(`COMMIT`)
		return conn.SendBatch(ctx, b).Close()
	}()
	if err != nil {
		return kettle.Statistics{}, unavailable("postgres statistics", err)
	}
	return st, nil
}

// deviceCols are what scanDevice reads from deviceFrom: the count is net of
// the readings Expire removed (migration 7).
const (
	deviceCols = `id, registered_at, last_seen, measurements - coalesce(n, 0), capacity_ml,
	latest_t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml,
	ov_charge, ov_fill, ov_flush, ov_expires_at, ov_set_at, revoked_at`
	deviceFrom = `devices LEFT JOIN device_expired USING (id)`
)

func scanDevice(r pgx.Row) (kettle.DeviceState, error) {
	var (
		d                        kettle.DeviceState
		reg                      time.Time
		seen, lt, ovExp, ovSet   *time.Time
		revoked                  *time.Time
		c, f, rate, a, w, l, ovF *float64
		ovC, ovFill              *bool
	)
	err := r.Scan(&d.ID, &reg, &seen, &d.Measurements, &d.CapacityML,
		&lt, &c, &f, &rate, &a, &w, &l, &ovC, &ovFill, &ovF, &ovExp, &ovSet, &revoked)
	if err != nil {
		return d, err
	}
	d.RegisteredAt = reg.UTC()
	if revoked != nil {
		d.RevokedAt = revoked.UTC()
	}
	if seen != nil {
		d.LastSeen = seen.UTC()
	}
	if lt != nil {
		d.Latest = &kettle.Measurement{Device: d.ID, Time: lt.UTC(), ChargeMWh: deref(c), FullMWh: deref(f), RateMW: deref(rate), AmbientC: deref(a), WaterC: deref(w), LevelML: deref(l)}
	}
	if ovExp != nil {
		o := &kettle.Override{ExpiresAt: ovExp.UTC(), Charge: ovC, Fill: ovFill, FlushMLPerS: ovF}
		if ovSet != nil {
			o.SetAt = ovSet.UTC()
		}
		d.Override = o
	}
	return d, nil
}

// Devices lists up to limit devices (all when limit ≤ 0) with ids after the
// cursor, in id byte order; uuid.Nil starts from the beginning.
func (s *Store) Devices(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
	return s.devices(ctx, s.reader(), after, limit)
}

// devices is Devices on pool.
func (s *Store) devices(ctx context.Context, pool *pgxpool.Pool, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
	var rows pgx.Rows
	if limit > 0 {
		rows, _ = pool.Query(ctx, `SELECT `+deviceCols+` FROM `+deviceFrom+` WHERE id > $1 ORDER BY id LIMIT $2`, after, limit)
	} else {
		rows, _ = pool.Query(ctx, `SELECT `+deviceCols+` FROM `+deviceFrom+` WHERE id > $1 ORDER BY id`, after)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (kettle.DeviceState, error) { return scanDevice(r) })
	if err != nil {
		return nil, unavailable("postgres list devices", err)
	}
	return out, nil
}

// Device returns one device, or an *kettle.Error with code ENotFound.
func (s *Store) Device(ctx context.Context, id kettle.DeviceID) (kettle.DeviceState, error) {
	d, err := scanDevice(s.pool.QueryRow(ctx, `SELECT `+deviceCols+` FROM `+deviceFrom+` WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return kettle.DeviceState{}, notFound(id)
	}
	if err != nil {
		return kettle.DeviceState{}, unavailable(fmt.Sprintf("postgres read device %s", id), err)
	}
	return d, nil
}

// scanPage is how many devices Scan reads per query: it pages rather than
// holding one cursor (and one snapshot) open while fn runs.
const scanPage = 1000

// Scan calls fn for every device in id order, a page at a time, so a device
// registered during the scan may or may not be seen.
func (s *Store) Scan(ctx context.Context, fn func(kettle.DeviceState) error) error {
	page := func(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
		// The primary: Scan loads the server's caches, which must not lag.
		ds, err := s.devices(ctx, s.pool, after, limit)
		if err != nil {
			return nil, fmt.Errorf("postgres scan devices: %w", err)
		}
		return ds, nil
	}
	return kettle.ScanPages(ctx, scanPage, page, fn) // fn's own error comes back as it is
}

// History returns up to q.Limit (all when ≤ 0) of one device's measurements
// in device-time order, From inclusive, To exclusive, after the cursor.
// An unknown device has no history (no error).
//
// A query on measurements plans every partition its bounds leave in: a read
// without `from` over many day partitions spends most of its time planning
// and locking partitions the LIMIT never reaches (bench/pg-partitions.sh). So a read with a limit (every
// API read) goes through the partitions in time order, a window of them at
// a time, and stops as soon as it holds the limit. The first window spans
// historyMinWindow partitions (the partition q starts in, and, without a
// lower bound, any older one this store does not know of); each next one as
// many as the rows still wanted take at the density read so far (twice the
// last when it found none), within historyMinWindow and historyMaxWindow;
// the last is open above. A walk past the first window reads the kettle's
// newest reading time (devices.latest_t) and ends there. The windows cover
// q's range whatever the cache of partitions holds (empty: one window, the
// whole range); the cache only decides where they meet.
func (s *Store) History(ctx context.Context, q kettle.HistoryQuery) ([]kettle.Measurement, error) {
	out := []kettle.Measurement{}
	pool := s.reader()
	if q.Limit <= 0 {
		return s.historyWindow(ctx, pool, q, time.Time{}, time.Time{}, out)
	}
	starts, bounded := s.historyStarts(q)
	var lo, latest time.Time // latest: the kettle's newest reading, once read
	latestRead := false
	width, read := historyMinWindow, 0
	k := width // index in starts of the first window's end
	if bounded {
		k-- // the first window starts in a partition before starts[0]
	}
	for {
		var hi time.Time // the last window is open above
		if k < len(starts) {
			hi = dayStart(starts[k])
		}
		wq := q
		wq.Limit = q.Limit - len(out)
		var err error
		if out, err = s.historyWindow(ctx, pool, wq, lo, hi, out); err != nil {
			return nil, err
		}
		if len(out) >= q.Limit || hi.IsZero() || !latest.IsZero() && hi.After(latest) {
			return out, nil
		}
		if !latestRead {
			// The page is not full after the first window: the kettle's
			// newest reading bounds the walk (a kettle that never reported,
			// or went quiet long ago, does not walk to today).
			latestRead = true
			var lt *time.Time
			err := pool.QueryRow(ctx, `SELECT latest_t FROM devices WHERE id = $1`, q.Device).Scan(&lt)
			switch {
			case errors.Is(err, pgx.ErrNoRows) || err == nil && lt == nil:
				return out, nil // no device, or no reading
			case err != nil:
				return nil, unavailable(fmt.Sprintf("postgres history of %s", q.Device), err)
			}
			if latest = *lt; hi.After(latest) {
				return out, nil
			}
		}
		read += width
		if len(out) == 0 {
			width *= 2
		} else {
			width = (q.Limit-len(out))*read/len(out) + 1
		}
		width = min(max(width, historyMinWindow), historyMaxWindow)
		lo, k = hi, k+width
	}
}

// The partitions one window of History spans, at least and at most.
const (
	historyMinWindow = 16
	historyMaxWindow = 256
)

// historyStarts returns the first days of the cached partitions that start
// strictly inside q's bounds, in order (not to be changed), and whether q
// has a lower bound.
func (s *Store) historyStarts(q kettle.HistoryQuery) (starts []int, bounded bool) {
	bounded = !q.From.IsZero() || !q.After.IsZero()
	var lower, upper int64 // unix µs
	if !q.From.IsZero() {
		lower = ceilMicro(q.From).UnixMicro()
	}
	if !q.After.IsZero() {
		lower = max(lower, q.After.UTC().Truncate(time.Microsecond).UnixMicro()+1)
	}
	if !q.To.IsZero() {
		upper = ceilMicro(q.To).UnixMicro()
	}
	s.partMu.Lock()
	if s.partStarts == nil {
		s.partStarts = make([]int, 0, len(s.parts))
		for d, name := range s.parts {
			if s.parts[d-1] != name { // its partition's first day
				s.partStarts = append(s.partStarts, d)
			}
		}
		slices.Sort(s.partStarts)
	}
	// the days starting strictly after lower and before upper
	first, last := 0, len(s.partStarts)
	if bounded {
		first = sort.Search(last, func(i int) bool { return dayStart(s.partStarts[i]).UnixMicro() > lower })
	}
	if !q.To.IsZero() {
		last = sort.Search(last, func(i int) bool { return dayStart(s.partStarts[i]).UnixMicro() >= upper })
	}
	// not copied: a change to the cache makes a new slice
	starts = s.partStarts[first:max(first, last)]
	s.partMu.Unlock()
	return starts, bounded
}

// historyWindow appends to out up to q.Limit (all when ≤ 0) of q's rows
// with times from lo (inclusive) to hi (exclusive); a zero lo or hi is no
// bound.
func (s *Store) historyWindow(ctx context.Context, pool *pgxpool.Pool, q kettle.HistoryQuery, lo, hi time.Time, out []kettle.Measurement) ([]kettle.Measurement, error) {
	conds := []string{"device = $1"}
	args := []any{q.Device}
	arg := func(cond string, v any) {
		args = append(args, v)
		conds = append(conds, fmt.Sprintf(cond, len(args)))
	}
	// Stored times are whole microseconds, and so are the bounds once
	// rounded the right way: t ≥ From is t ≥ ⌈From⌉, t < To is t < ⌈To⌉,
	// t > After is t > ⌊After⌋. (The driver truncates to microseconds.)
	if !q.From.IsZero() {
		arg("t >= $%d", ceilMicro(q.From))
	}
	if !q.To.IsZero() {
		arg("t < $%d", ceilMicro(q.To))
	}
	if !q.After.IsZero() {
		arg("t > $%d", q.After.UTC().Truncate(time.Microsecond))
	}
	if !lo.IsZero() {
		arg("t >= $%d", lo)
	}
	if !hi.IsZero() {
		arg("t < $%d", hi)
	}
	sql := `SELECT t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml FROM measurements WHERE ` + strings.Join(conds, " AND ") + ` ORDER BY t`
	if q.Limit > 0 {
		args = append(args, q.Limit)
		sql += fmt.Sprintf(" LIMIT $%d", len(args))
	}
	rows, _ := pool.Query(ctx, sql, args...)
	// Every row scanned into one m (not one allocated a row, as with
	// CollectRows and a Scan of a fresh value's fields) and copied out.
	m := kettle.Measurement{Device: q.Device}
	_, err := pgx.ForEachRow(rows, []any{&m.Time, &m.ChargeMWh, &m.FullMWh, &m.RateMW, &m.AmbientC, &m.WaterC, &m.LevelML}, func() error {
		m.Time = m.Time.UTC()
		out = append(out, m)
		return nil
	})
	if err != nil {
		return nil, unavailable(fmt.Sprintf("postgres history of %s", q.Device), err)
	}
	return out, nil
}

func ceilMicro(t time.Time) time.Time {
	t = t.UTC()
	if c := t.Truncate(time.Microsecond); !c.Equal(t) {
		return c.Add(time.Microsecond)
	}
	return t
}

// SetOverride stores o for device id, or returns ENotFound.
func (s *Store) SetOverride(ctx context.Context, id kettle.DeviceID, o kettle.Override) error {
	tag, err := s.pool.Exec(ctx, `UPDATE devices SET ov_charge = $2, ov_fill = $3, ov_flush = $4, ov_expires_at = $5, ov_set_at = $6 WHERE id = $1`,
		id, o.Charge, o.Fill, o.FlushMLPerS, o.ExpiresAt.UTC(), o.SetAt.UTC())
	if err != nil {
		return unavailable(fmt.Sprintf("postgres set override of %s", id), err)
	}
	if tag.RowsAffected() == 0 {
		return notFound(id)
	}
	return nil
}

// ClearOverride removes device id's override; no error when there is none
// or the device is unknown.
func (s *Store) ClearOverride(ctx context.Context, id kettle.DeviceID) error {
	_, err := s.pool.Exec(ctx, `UPDATE devices SET ov_charge = NULL, ov_fill = NULL, ov_flush = NULL, ov_expires_at = NULL, ov_set_at = NULL
		WHERE id = $1 AND ov_expires_at IS NOT NULL`, id)
	if err != nil {
		return unavailable(fmt.Sprintf("postgres clear override of %s", id), err)
	}
	return nil
}

// Revoke marks device id revoked at at (ENotFound for an unknown device);
// revoking again keeps the first time. Its history stays.
func (s *Store) Revoke(ctx context.Context, id kettle.DeviceID, at time.Time) error {
	tag, err := s.pool.Exec(ctx, `UPDATE devices SET revoked_at = coalesce(revoked_at, $2) WHERE id = $1`, id, at.UTC())
	if err != nil {
		return unavailable(fmt.Sprintf("postgres revoke %s", id), err)
	}
	if tag.RowsAffected() == 0 {
		return notFound(id)
	}
	return nil
}

func notFound(id kettle.DeviceID) error {
	return kettle.Errorf(kettle.ENotFound, "device %s is not registered", id)
}
