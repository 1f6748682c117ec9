package sqlite

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/kettlefleet/kettlefleet"
)

// devState is what Write needs of one device: its row in devices without
// the override. It holds no pointers, so a large map of them costs the
// garbage collector nothing to scan.
type devState struct {
	seen      int64 // last_seen, unix µs; valid when hasSeen
	n         int64
	capML     float64
	latest    reading // valid when hasLatest
	hasSeen   bool
	hasLatest bool
}

// reading is a measurement without its device, as stored in latest_*.
type reading struct {
	t                                     int64
	charge, full, rate, amb, water, level float64
}

func readingOf(m *kettle.Measurement) reading {
	return reading{t: m.Time.UnixMicro(), charge: m.ChargeMWh, full: m.FullMWh, rate: m.RateMW,
		amb: m.AmbientC, water: m.WaterC, level: m.LevelML}
}

// devCache is the writer's copy of every device's devState, valid for the
// writer connection of generation gen at data_version version. Guarded by
// Store.wmu.
type devCache struct {
	devs    map[kettle.DeviceID]devState
	version int64
	gen     uint64
	valid   bool
	deleted int // entries deleted from devs since it was made (Prune)
}

// loadCache builds the cache in a write transaction of its own (Open).
func (s *Store) loadCache(ctx context.Context) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.tx(ctx, "load device cache", func(tx *sql.Tx) error { return s.syncCache(ctx, tx) })
}

// syncCache makes the cache (and the staged-row bookkeeping) current,
// inside a write transaction (which holds the write lock, so nothing can
// commit between the check and the batch): it reloads it when it is
// invalid, when the writer connection is a new one, or when another
// connection committed since it was loaded.
func (s *Store) syncCache(ctx context.Context, tx *sql.Tx) error {
	var version int64
	if err := tx.StmtContext(ctx, s.dataVer).QueryRowContext(ctx).Scan(&version); err != nil {
		return fmt.Errorf("read data_version: %w", err)
	}
	gen := s.connGen.Load()
	c := &s.cache
	if c.valid && c.version == version && c.gen == gen {
		return nil
	}
	c.valid = false
	rows, err := tx.QueryContext(ctx, `SELECT id, last_seen, measurements, capacity_ml,
		latest_t, latest_charge, latest_full, latest_rate, latest_ambient, latest_water, latest_level FROM devices`)
	if err != nil {
		return fmt.Errorf("load devices: %w", err)
	}
	defer rows.Close()
	devs := make(map[kettle.DeviceID]devState, max(len(c.devs), 1024))
	for rows.Next() {
		var (
			id                                    sql.RawBytes
			seen, lt                              sql.NullInt64
			charge, full, rate, amb, water, level sql.NullFloat64
			d                                     devState
		)
		if err := rows.Scan(&id, &seen, &d.n, &d.capML, &lt, &charge, &full, &rate, &amb, &water, &level); err != nil {
			return fmt.Errorf("load devices: %w", err)
		}
		var key kettle.DeviceID
		if len(id) != len(key) {
			return fmt.Errorf("load devices: device id of %d bytes, want %d", len(id), len(key))
		}
		copy(key[:], id)
		d.seen, d.hasSeen = seen.Int64, seen.Valid
		if lt.Valid {
			d.hasLatest = true
			d.latest = reading{t: lt.Int64, charge: charge.Float64, full: full.Float64, rate: rate.Float64,
				amb: amb.Float64, water: water.Float64, level: level.Float64}
		}
		devs[key] = d
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("load devices: %w", err)
	}
	rows.Close()
	// Fold the staged rows on top, and count them for the merge.
	s.stage.reset()
	err = scanStaged(ctx, tx, `SELECT `+stagedColumns+` FROM staged`, nil, func(id kettle.DeviceID, r reading, recv int64) {
		d := devs[id]
		foldStagedState(&d, r, recv)
		devs[id] = d
		s.stage.add(id, 1)
	})
	if err != nil {
		return err
	}
	*c = devCache{devs: devs, version: version, gen: gen, valid: true}
	return nil
}
