package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/kettlefleet/kettlefleet"
)

// DayLoad loads one UTC day of generated history whose partition does not
// exist yet, the way a bulk load into PostgreSQL goes fastest, in one
// transaction:
//
//  1. a table of its own (kettle_load_measurements_yYYYYmMMdDD, with the
//     day's range as a CHECK constraint) created in the transaction, and the
//     rows COPYed into it with FREEZE: no index to maintain row by row, and
//     the rows are written frozen and all-visible, so no VACUUM has to visit
//     them afterwards (PostgreSQL 14 and later set the visibility map);
//  2. at Commit, the primary key built in one sort, and ANALYZE;
//  3. under the partition lock, the table attached as the day's partition
//     (the CHECK constraint proves the range, so attaching scans nothing)
//     and renamed;
//  4. the devices, rollups and totals updated from the day's rows, then
//     COMMIT: the day becomes visible with every derived figure exact.
//
// If the day's partition appears meanwhile (a live kettle's back-dated
// reading, or another seeder), Commit inserts the rows into it with INSERT …
// ON CONFLICT DO NOTHING instead and counts only those that were new.
//
// A DayLoad is used by one goroutine. Commit or Rollback ends it.
type DayLoad struct {
	s     *Store
	pc    *pgxpool.Conn
	part  partition
	table string
	reg   time.Time

	devs  map[kettle.DeviceID]*dayDev
	hours [24]hourAgg // by hour of the day
	n     int64
}

// dayDev is what a day's rows add to a device.
type dayDev struct {
	n      int64
	capML  float64
	newest kettle.Measurement
}

// BeginDay starts the load of the UTC day that holds day, or returns nil
// when that day already has a partition (then seed it with SeedCopy).
// Devices not registered yet are registered at registeredAt.
func (s *Store) BeginDay(ctx context.Context, day, registeredAt time.Time) (*DayLoad, error) {
	p := dayPartition(dayOf(day))
	parts, err := listPartitions(ctx, s.pool)
	if err != nil {
		return nil, err
	}
	if covered(parts, p.from) {
		return nil, nil
	}
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, unavailable("begin day load", err)
	}
	l := &DayLoad{s: s, pc: pc, part: p, table: "kettle_load_" + p.name, reg: registeredAt.UTC(), devs: map[kettle.DeviceID]*dayDev{}}
	for i := range l.hours {
		l.hours[i].hour = int64(p.from)*24 + int64(i)
	}
	// statement_timeout off: the primary key of a day of a large fleet
	// takes its time.
	_, err = pc.Exec(ctx, fmt.Sprintf(`BEGIN; SET LOCAL statement_timeout = 0;
		CREATE TABLE %s (LIKE measurements INCLUDING DEFAULTS, CONSTRAINT kettle_load_day CHECK (t >= '%s' AND t < '%s'))`,
		l.table, dayStart(p.from).Format(time.RFC3339), dayStart(p.to).Format(time.RFC3339)))
	if err != nil {
		l.Rollback()
		return nil, fmt.Errorf("begin day load %s: %w", p.name, err)
	}
	return l, nil
}

// Copy adds rows to the day: grouped by device, in strictly increasing time
// within each device, all within the day. A device may come again in a
// later Copy with later readings.
func (l *DayLoad) Copy(ctx context.Context, rows []kettle.Measurement) error {
	if len(rows) == 0 {
		return nil
	}
	if err := checkRuns(rows); err != nil {
		return err
	}
	lo, hi := dayStart(l.part.from), dayStart(l.part.to)
	for i := range rows {
		if t := rows[i].Time; t.Before(lo) || !t.Before(hi) {
			return kettle.Errorf(kettle.EInvalid, "postgres day load %s: row %d at %s is outside the day", l.part.name, i, t.Format(time.RFC3339Nano))
		}
	}
	if _, err := l.pc.Conn().PgConn().CopyFrom(ctx, newCopyReader(rows), "COPY "+l.table+" "+copyColumns+" FROM STDIN (FORMAT binary, FREEZE)"); err != nil {
		return fmt.Errorf("copy into %s: %w", l.table, err)
	}
	l.add(rows)
	return nil
}

// add aggregates new rows of the day.
func (l *DayLoad) add(rows []kettle.Measurement) {
	var d *dayDev
	start := dayStart(l.part.from)
	for i := range rows {
		m := &rows[i]
		if d == nil || m.Device != rows[i-1].Device {
			if d = l.devs[m.Device]; d == nil {
				d = &dayDev{}
				l.devs[m.Device] = d
			}
		}
		d.n++
		d.capML = max(d.capML, m.LevelML)
		if d.n == 1 || m.Time.After(d.newest.Time) {
			d.newest = *m
		}
		h := &l.hours[int(m.Time.Sub(start)/time.Hour)]
		h.water.Add(m.WaterC)
		h.ambient.Add(m.AmbientC)
	}
	l.n += int64(len(rows))
}

// Commit builds the day's primary key, attaches it as the day's partition
// and updates the derived figures, then commits; it returns how many rows
// were new (all of them unless the partition appeared meanwhile).
func (l *DayLoad) Commit(ctx context.Context) (n int64, err error) {
	defer func() {
		if err != nil {
			l.Rollback()
		}
	}()
	if l.n == 0 {
		l.Rollback()
		return 0, nil
	}
	c := l.pc.Conn()
	p := l.part
	// The partition may have appeared while the rows went in; checked
	// without the lock first (so that the lock is not held while the key
	// is built), and again under it.
	parts, err := listPartitions(ctx, c)
	if err != nil {
		return 0, err
	}
	attach := !covered(parts, p.from)
	if attach {
		if _, err := c.Exec(ctx, fmt.Sprintf("ALTER TABLE %[1]s ADD PRIMARY KEY (device, t); ANALYZE %[1]s", l.table)); err != nil {
			if isUniqueViolation(err) {
				return 0, kettle.Errorf(kettle.EInvalid, "postgres day load %s: a reading twice: %v", p.name, err)
			}
			return 0, fmt.Errorf("day load %s: primary key: %w", p.name, err)
		}
		if _, err := c.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockPartition); err != nil {
			return 0, fmt.Errorf("day load %s: partition lock: %w", p.name, err)
		}
		if parts, err = listPartitions(ctx, c); err != nil {
			return 0, err
		}
		attach = !covered(parts, p.from)
	}
	if attach {
		_, err = c.Exec(ctx, fmt.Sprintf(`ALTER TABLE measurements ATTACH PARTITION %[1]s FOR VALUES FROM ('%[2]s') TO ('%[3]s');
			ALTER TABLE %[1]s DROP CONSTRAINT kettle_load_day;
			ALTER TABLE %[1]s RENAME TO %[4]s;
			ALTER INDEX %[1]s_pkey RENAME TO %[4]s_pkey`,
			l.table, dayStart(p.from).Format(time.RFC3339), dayStart(p.to).Format(time.RFC3339), p.name))
		if err != nil {
			return 0, fmt.Errorf("day load %s: attach: %w", p.name, err)
		}
	} else if err := l.insertInto(ctx); err != nil {
		return 0, err
	}
	if err := l.derive(ctx); err != nil {
		return 0, err
	}
	if _, err := c.Exec(ctx, "COMMIT"); err != nil {
		return 0, fmt.Errorf("day load %s: commit: %w", p.name, err)
	}
	if st := c.PgConn().TxStatus(); st != 'I' {
		return 0, fmt.Errorf("day load %s: transaction status %q after COMMIT", p.name, st)
	}
	l.pc.Release()
	l.pc = nil
	s := l.s
	s.partMu.Lock()
	if attach {
		s.cachePartitions([]partition{p})
		s.loadedDays[p.from] = true
	} else {
		s.cachePartitions(parts)
	}
	s.partMu.Unlock()
	s.markKnown(l.ids())
	return l.n, nil
}

// insertInto is Commit's way when the day's partition exists after all:
// the rows go from the load table into measurements, skipping those already
// stored, and the day's figures are aggregated again over the new rows.
func (l *DayLoad) insertInto(ctx context.Context) error {
	c := l.pc.Conn()
	cols := copyColumns[1 : len(copyColumns)-1]
	rows, _ := c.Query(ctx, fmt.Sprintf(`INSERT INTO measurements (%[1]s) SELECT %[1]s FROM %[2]s ORDER BY device, t
		ON CONFLICT DO NOTHING RETURNING %[1]s`, cols, l.table))
	clear(l.devs)
	for i := range l.hours {
		l.hours[i].water, l.hours[i].ambient = kettle.Moments{}, kettle.Moments{}
	}
	l.n = 0
	var batch []kettle.Measurement
	var m kettle.Measurement
	_, err := pgx.ForEachRow(rows, []any{&m.Device, &m.Time, &m.ChargeMWh, &m.FullMWh, &m.RateMW, &m.AmbientC, &m.WaterC, &m.LevelML}, func() error {
		m.Time = m.Time.UTC()
		if len(batch) >= 10_000 {
			l.add(batch)
			batch = batch[:0]
		}
		batch = append(batch, m)
		return nil
	})
	if err != nil {
		return fmt.Errorf("day load %s: insert into the existing partition: %w", l.part.name, err)
	}
	l.add(batch)
	if _, err := c.Exec(ctx, "DROP TABLE "+l.table); err != nil {
		return fmt.Errorf("day load %s: %w", l.part.name, err)
	}
	return nil
}

// ids are the day's devices, in id order.
func (l *DayLoad) ids() []kettle.DeviceID {
	ids := make([]kettle.DeviceID, 0, len(l.devs))
	for id := range l.devs {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b kettle.DeviceID) int { return bytesCompare(a, b) })
	return ids
}

// derive registers the day's devices (those not registered yet), locks
// them in id order and queues the derived figures (queueDerived), like the
// end of a write; a deadlock or serialization failure (another client of
// the database locking in another order) returns to a savepoint and tries
// again, keeping the loaded rows.
func (l *DayLoad) derive(ctx context.Context) error {
	ids := l.ids()
	idArr := uuidArray(ids)
	var hours []hourAgg
	var hods [24]hourAgg
	for i, h := range l.hours {
		if h.water.N > 0 {
			hours = append(hours, h)
			hods[i] = h
			hods[i].hour = int64(i)
		}
	}
	pg := l.pc.Conn().PgConn()
	var err error
	for attempt := 1; attempt <= writeAttempts; attempt++ {
		var b pgconn.Batch
		b.ExecParams("SAVEPOINT kettle_derive", nil, nil, nil, nil)
		b.ExecPrepared("kettle_register", [][]byte{idArr, timestamptzBin(l.reg)}, bin(2), nil)
		b.ExecPrepared("kettle_lock", [][]byte{idArr}, bin(1), bin(12))
		devs := make(map[kettle.DeviceID]*devState, len(ids))
		var newDevs int64
		err = execBatch(ctx, pg, &b, func(i int, rr *pgconn.ResultReader) error {
			switch i {
			case 1:
				tag, err := rr.Close()
				newDevs = tag.RowsAffected()
				return err
			case 2:
				return readLocked(rr, devs)
			}
			_, err := rr.Close()
			return err
		})
		if err == nil && len(devs) != len(ids) {
			return fmt.Errorf("day load %s: %d of %d devices gone after registering them (pruned meanwhile)", l.part.name, len(ids)-len(devs), len(ids))
		}
		if err == nil {
			for id, a := range l.devs {
				d := devs[id]
				d.touched = true
				d.n += a.n
				d.capML = max(d.capML, a.capML)
				d.seenMax = a.newest.Time
				d.newestRow = &a.newest
			}
			b = pgconn.Batch{}
			l.s.queueDerived(&b, pg, ids, devs, hours, hods, l.n, newDevs, l.reg, true)
			b.ExecParams("RELEASE SAVEPOINT kettle_derive", nil, nil, nil, nil)
			if err = execBatch(ctx, pg, &b, nil); err == nil {
				return nil
			}
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || (pgErr.Code != "40P01" && pgErr.Code != "40001") {
			break
		}
		l.s.conflictRetries.Add(1)
		if rerr := pg.Exec(ctx, "ROLLBACK TO SAVEPOINT kettle_derive").Close(); rerr != nil {
			return fmt.Errorf("day load %s: %w", l.part.name, rerr)
		}
	}
	return fmt.Errorf("day load %s: update devices, rollups and totals: %w", l.part.name, err)
}

// Rollback abandons the day: nothing of it stays (the load table was
// created in the transaction).
func (l *DayLoad) Rollback() {
	if l.pc == nil {
		return
	}
	pg := l.pc.Conn().PgConn()
	if !pg.IsClosed() && pg.TxStatus() != 'I' {
		pg.Exec(context.Background(), "ROLLBACK").Close()
	}
	l.pc.Release()
	l.pc = nil
}

// checkRuns checks that rows are grouped by device, each device's rows in
// strictly increasing time.
func checkRuns(rows []kettle.Measurement) error {
	seen := map[kettle.DeviceID]bool{}
	for i := range rows {
		rows[i].Normalize()
		if i > 0 && rows[i].Device == rows[i-1].Device {
			if !rows[i].Time.After(rows[i-1].Time) {
				return kettle.Errorf(kettle.EInvalid, "postgres seed: row %d of device %s is not after the one before it (%s ≤ %s); rows must be grouped by device in increasing time", i, rows[i].Device, rows[i].Time.Format(time.RFC3339Nano), rows[i-1].Time.Format(time.RFC3339Nano))
			}
			continue
		}
		if seen[rows[i].Device] {
			return kettle.Errorf(kettle.EInvalid, "postgres seed: device %s appears in two runs (again at row %d); rows must be grouped by device", rows[i].Device, i)
		}
		seen[rows[i].Device] = true
	}
	return nil
}
