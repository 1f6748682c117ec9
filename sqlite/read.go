package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Statistics reads the totals row, counts reporting devices and merges the
// rollups of the range by hour of day, all in one read transaction (one
// consistent snapshot). An open range reads the 24 all-history rows; a
// bounded one reads one row per hour in the range. Neither reads history.
func (s *Store) Statistics(ctx context.Context, q kettle.StatsQuery) (kettle.Statistics, error) {
	var st kettle.Statistics
	tx, err := s.r.BeginTx(ctx, nil)
	if err != nil {
		return st, fmt.Errorf("sqlite statistics: %w", err)
	}
	defer tx.Rollback()

	tot, err := readTotals(tx.QueryRowContext(ctx,
		`SELECT measurement_count, device_count, charge, charge_c, level, level_c, potential, potential_c FROM totals WHERE id = 0`))
	if err != nil {
		return st, fmt.Errorf("sqlite statistics: read totals: %w", err)
	}
	st.MeasurementCount = tot.measurements
	st.DevicesRegistered = tot.devices
	st.TotalChargeMWh = tot.charge.value()
	st.TotalWaterML = tot.level.value()
	st.TotalPotentialCmL = tot.potential.value()

	since := int64(minInt64)
	if !q.ReportingSince.IsZero() {
		since = q.ReportingSince.UnixMicro()
	}
	if err := tx.QueryRowContext(ctx, `SELECT ifnull(sum(n), 0) FROM last_seen WHERE at >= ?`, since).Scan(&st.DevicesReporting); err != nil {
		return st, fmt.Errorf("sqlite statistics: count reporting devices: %w", err)
	}

	for h := range st.ByHour {
		st.ByHour[h].Hour = h
	}
	var rows *sql.Rows
	if q.From.IsZero() && q.To.IsZero() {
		rows, err = tx.QueryContext(ctx, `SELECT hod, n, water_mean, water_m2, ambient_mean, ambient_m2 FROM hours_of_day`)
	} else {
		from, to := int64(minInt64), int64(maxInt64)
		if !q.From.IsZero() {
			from = hourOf(q.From.UnixMicro()) * 3600
		}
		if !q.To.IsZero() {
			to = hourOf(q.To.UnixMicro()) * 3600
		}
		rows, err = tx.QueryContext(ctx, `SELECT hour, n, water_mean, water_m2, ambient_mean, ambient_m2
			FROM rollups WHERE hour >= ? AND hour < ? ORDER BY hour`, from, to)
	}
	if err != nil {
		return st, fmt.Errorf("sqlite statistics: read rollups: %w", err)
	}
	defer rows.Close()
	open := q.From.IsZero() && q.To.IsZero()
	for rows.Next() {
		var key int64
		var w, a kettle.Moments
		if err := rows.Scan(&key, &w.N, &w.Mean, &w.M2, &a.Mean, &a.M2); err != nil {
			return st, fmt.Errorf("sqlite statistics: read rollups: %w", err)
		}
		a.N = w.N
		hod := key
		if !open {
			hod = floorMod(floorDiv(key, 3600), 24)
		}
		if hod < 0 || hod > 23 {
			return st, fmt.Errorf("sqlite statistics: rollup key %d out of range", key)
		}
		h := &st.ByHour[hod]
		h.Water, h.Ambient = h.Water.Merge(w), h.Ambient.Merge(a)
		st.RangeCount += w.N
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("sqlite statistics: read rollups: %w", err)
	}
	return st, nil
}

const (
	minInt64 = -1 << 63
	maxInt64 = 1<<63 - 1
)

const deviceColumns = `id, registered_at, last_seen, measurements, capacity_ml,
	latest_t, latest_charge, latest_full, latest_rate, latest_ambient, latest_water, latest_level,
	ov_charge, ov_fill, ov_flush, ov_expires, ov_set, revoked_at`

// Devices lists up to limit devices (all when limit ≤ 0) with ids after the
// cursor, in id byte order; uuid.Nil starts from the beginning. Each
// device's staged rows are folded into its devices row, in the same read
// transaction (so a merge cannot count a row twice or not at all).
func (s *Store) Devices(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
	if limit <= 0 {
		limit = -1 // SQLite: no limit
	}
	out, err := s.readDevices(ctx, `SELECT `+deviceColumns+` FROM devices WHERE id > ? ORDER BY id LIMIT ?`,
		[]any{after[:], limit})
	if err != nil {
		return nil, fmt.Errorf("sqlite list devices: %w", err)
	}
	return out, nil
}

// Device returns one device, or an *kettle.Error with code ENotFound.
func (s *Store) Device(ctx context.Context, id kettle.DeviceID) (kettle.DeviceState, error) {
	out, err := s.readDevices(ctx, `SELECT `+deviceColumns+` FROM devices WHERE id = ?`, []any{id[:]})
	if err != nil {
		return kettle.DeviceState{}, fmt.Errorf("sqlite read device %s: %w", id, err)
	}
	if len(out) == 0 {
		return kettle.DeviceState{}, notFound(id)
	}
	return out[0], nil
}

// readDevices reads devices rows (devQ returns them in id order) and folds
// in their staged rows, in one read transaction. It reads only the staged
// rows of the rows' id range and the buckets it spans (a bucket is a range
// of ids), not the whole table: a scan of every device (kettle serve's
// start) would otherwise fold all staged rows once a page.
func (s *Store) readDevices(ctx context.Context, devQ string, devArgs []any) ([]kettle.DeviceState, error) {
	tx, err := s.r.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	rows, err := tx.QueryContext(ctx, devQ, devArgs...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []kettle.DeviceState
	for rows.Next() {
		d, err := scanDevice(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	rows.Close()
	if len(out) == 0 {
		return out, nil
	}
	idx := make(map[kettle.DeviceID]int, len(out))
	for i := range out {
		idx[out[i].ID] = i
	}
	first, last := out[0].ID, out[len(out)-1].ID
	err = scanStaged(ctx, tx, `SELECT `+stagedColumns+` FROM staged WHERE b BETWEEN ? AND ? AND device BETWEEN ? AND ?`,
		[]any{bucketOf(first), bucketOf(last), first[:], last[:]}, func(id kettle.DeviceID, r reading, recv int64) {
			if i, ok := idx[id]; ok {
				m := measurementOf(id, r)
				foldStaged(&out[i], &m, fromMicro(recv))
			}
		})
	if err != nil {
		return nil, err
	}
	return out, tx.Commit()
}

// scanPage is how many devices Scan reads per query: it pages rather than
// holding one cursor (and one read snapshot) open while fn runs.
const scanPage = 1000

// Scan calls fn for every device in id order. It pages through the table,
// so a device registered during the scan may or may not be seen.
func (s *Store) Scan(ctx context.Context, fn func(kettle.DeviceState) error) error {
	page := func(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
		ds, err := s.Devices(ctx, after, limit)
		if err != nil {
			return nil, fmt.Errorf("sqlite scan devices: %w", err)
		}
		return ds, nil
	}
	return kettle.ScanPages(ctx, scanPage, page, fn) // fn's own error comes back as it is
}

type scanner interface{ Scan(dst ...any) error }

func scanDevice(r scanner) (kettle.DeviceState, error) {
	var (
		d                                     kettle.DeviceState
		id                                    []byte
		reg                                   int64
		seen, lt, ovExp, ovSet, ovChg, ovFill sql.NullInt64
		charge, full, rate, amb, water, level sql.NullFloat64
		ovFlush                               sql.NullFloat64
		revoked                               sql.NullInt64
	)
	err := r.Scan(&id, &reg, &seen, &d.Measurements, &d.CapacityML,
		&lt, &charge, &full, &rate, &amb, &water, &level,
		&ovChg, &ovFill, &ovFlush, &ovExp, &ovSet, &revoked)
	if err != nil {
		return d, err
	}
	if len(id) != len(d.ID) {
		return d, fmt.Errorf("device id of %d bytes, want %d", len(id), len(d.ID))
	}
	copy(d.ID[:], id)
	d.RegisteredAt = fromMicro(reg)
	if revoked.Valid {
		d.RevokedAt = fromMicro(revoked.Int64)
	}
	if seen.Valid {
		d.LastSeen = fromMicro(seen.Int64)
	}
	if lt.Valid {
		d.Latest = &kettle.Measurement{
			Device: d.ID, Time: fromMicro(lt.Int64),
			ChargeMWh: charge.Float64, FullMWh: full.Float64, RateMW: rate.Float64,
			AmbientC: amb.Float64, WaterC: water.Float64, LevelML: level.Float64,
		}
	}
	if ovExp.Valid {
		o := &kettle.Override{ExpiresAt: fromMicro(ovExp.Int64)}
		if ovSet.Valid {
			o.SetAt = fromMicro(ovSet.Int64)
		}
		if ovChg.Valid {
			b := ovChg.Int64 != 0
			o.Charge = &b
		}
		if ovFill.Valid {
			b := ovFill.Int64 != 0
			o.Fill = &b
		}
		if ovFlush.Valid {
			f := ovFlush.Float64
			o.FlushMLPerS = &f
		}
		d.Override = o
	}
	return d, nil
}

// History returns up to q.Limit (all when ≤ 0) of one device's measurements
// in device-time order, From inclusive, To exclusive, after the cursor.
// An unknown device has no history (no error).
func (s *Store) History(ctx context.Context, q kettle.HistoryQuery) ([]kettle.Measurement, error) {
	lo, hi := int64(minInt64), int64(maxInt64)
	// Stored times are whole microseconds: t ≥ From is t ≥ ⌈From⌉,
	// t < To is t < ⌈To⌉ and t > After is t ≥ ⌊After⌋+1.
	if !q.From.IsZero() {
		lo = ceilMicro(q.From)
	}
	if !q.After.IsZero() {
		lo = max(lo, q.After.UnixMicro()+1)
	}
	if !q.To.IsZero() {
		hi = ceilMicro(q.To)
	}
	limit := q.Limit
	if limit <= 0 {
		limit = -1
	}
	// A row is in measurements or staged, never both; one statement reads
	// both from one snapshot.
	rows, err := s.r.QueryContext(ctx, `SELECT t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml FROM (
		SELECT t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml FROM measurements WHERE device = ?1 AND t >= ?2 AND t < ?3
		UNION ALL
		SELECT t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml FROM staged WHERE b = ?5 AND t >= ?2 AND t < ?3 AND device = ?1)
		ORDER BY t LIMIT ?4`, q.Device[:], lo, hi, limit, bucketOf(q.Device))
	if err != nil {
		return nil, fmt.Errorf("sqlite history of %s: %w", q.Device, err)
	}
	defer rows.Close()
	var out []kettle.Measurement
	for rows.Next() {
		m := kettle.Measurement{Device: q.Device}
		var t int64
		if err := rows.Scan(&t, &m.ChargeMWh, &m.FullMWh, &m.RateMW, &m.AmbientC, &m.WaterC, &m.LevelML); err != nil {
			return nil, fmt.Errorf("sqlite history of %s: %w", q.Device, err)
		}
		m.Time = fromMicro(t)
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlite history of %s: %w", q.Device, err)
	}
	return out, nil
}

// ceilMicro is t in unix microseconds, rounded up. (UnixMicro rounds down:
// the nanosecond part of a Time is never negative.)
func ceilMicro(t time.Time) int64 {
	us := t.UnixMicro()
	if t.Nanosecond()%1000 != 0 {
		us++
	}
	return us
}

func fromMicro(us int64) time.Time { return time.UnixMicro(us).UTC() }
