package postgres

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	kettle "github.com/kettlefleet/kettlefleet"
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
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return unavailable(fmt.Sprintf("postgres register %d devices", len(ids)), err)
	}
	defer pc.Release()
	shard := s.shard(pc.Conn().PgConn())
	var newDevs int64
	err = pgx.BeginFunc(ctx, pc.Conn(), func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sqlRegister, sorted, at.UTC())
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		newDevs = tag.RowsAffected()
		_, err = tx.Exec(ctx, sqlAddTotals, 0, newDevs, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, shard)
		return err
	})
	if err != nil {
		return unavailable(fmt.Sprintf("postgres register %d devices", len(ids)), err)
	}
	s.registered.Add(newDevs)
	s.markKnown(sorted)
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
	// Rows are inserted in id order (the caller sorts; ORDER BY keeps it
	// whatever join the planner picks), like every lock we take. The NOT
	// EXISTS pre-check makes the common case (all known) a read: an index
	// probe is much cheaper than a speculative insertion.
	sqlRegister = `INSERT INTO devices (id, registered_at)
		SELECT u, $2::timestamptz FROM unnest($1::uuid[]) u WHERE NOT EXISTS (SELECT 1 FROM devices d WHERE d.id = u)
		ORDER BY u
		ON CONFLICT DO NOTHING`
	// The ctid of a row we hold locked cannot change until we update it:
	// the update finds the row by ctid (a TID scan), no second index probe.
	sqlLock = `SELECT ctid, id, measurements, capacity_ml, last_seen, latest_t,
		charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml
		FROM devices WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE`
	sqlInsertArrays = `INSERT INTO measurements (device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml)
		SELECT * FROM unnest($1::uuid[], $2::timestamptz[], $3::float8[], $4::float8[], $5::float8[], $6::float8[], $7::float8[], $8::float8[])`
	// sqlInsertNew inserts what is not stored yet and returns it. From
	// arrays, not a per-connection temporary table: a session that created
	// one drops it when it ends, and that drop is a commit, which under
	// synchronous_mode_strict with no synchronous standby waits for one
	// forever (a backend that never exits, holding its connection slot and
	// the server's stop).
	sqlInsertNew  = sqlInsertArrays + ` ON CONFLICT DO NOTHING RETURNING device, t`
	sqlUpdateDevs = `UPDATE devices d SET measurements = u.n, capacity_ml = u.cap, last_seen = u.seen,
		latest_t = u.t, charge_mwh = u.c, full_mwh = u.f, rate_mw = u.r, ambient_c = u.a, water_c = u.w, level_ml = u.l
		FROM unnest($1::tid[], $2::int8[], $3::float8[], $4::timestamptz[], $5::timestamptz[],
			$6::float8[], $7::float8[], $8::float8[], $9::float8[], $10::float8[], $11::float8[])
			AS u(tid, n, cap, seen, t, c, f, r, a, w, l)
		WHERE d.ctid = u.tid`
	// sqlMoveSeen appends a batch's changes in how many devices have each
	// last_seen value (−1 at a device's old value, +1 at its new one, summed
	// per value; no value twice) to last_seen_moves (migrations 4 and 9): one
	// plain insert of one row, no row another writer could hold.
	// compactSeen folds them into last_seen_counts.
	sqlMoveSeen = `INSERT INTO last_seen_moves (at, n) VALUES ($1::timestamptz[], $2::int8[])`
	// The merge is kettle.Moments.Merge, operation for operation, so every
	// store computes bit-identical moments from the same partial aggregates.
	mergeMoments = `n = r.n + excluded.n,
		water_mean = r.water_mean + (excluded.water_mean - r.water_mean) * excluded.n::float8 / (r.n + excluded.n)::float8,
		water_m2 = r.water_m2 + excluded.water_m2 + (excluded.water_mean - r.water_mean) * (excluded.water_mean - r.water_mean) * r.n::float8 * excluded.n::float8 / (r.n + excluded.n)::float8,
		ambient_mean = r.ambient_mean + (excluded.ambient_mean - r.ambient_mean) * excluded.n::float8 / (r.n + excluded.n)::float8,
		ambient_m2 = r.ambient_m2 + excluded.ambient_m2 + (excluded.ambient_mean - r.ambient_mean) * (excluded.ambient_mean - r.ambient_mean) * r.n::float8 * excluded.n::float8 / (r.n + excluded.n)::float8`
	// sqlAddTotals adds a batch's counts and its three compensated sums
	// (sum, compensation: see ksum) to the connection's totals row (its
	// shard, $9): one Neumaier step for
	// the sum, plus the batch's own compensation. One plain UPDATE, so the
	// hot row is locked only from here to commit. (The PL/pgSQL
	// kettle_add_totals of migration 1 looped over every term on the server.)
	sqlAddTotals = `UPDATE totals SET measurements = measurements + $1::int8, devices = devices + $2::int8,
		charge = charge + $3::float8,
		charge_c = charge_c + CASE WHEN abs(charge) >= abs($3::float8) THEN (charge - (charge + $3::float8)) + $3::float8
			ELSE ($3::float8 - (charge + $3::float8)) + charge END + $4::float8,
		level = level + $5::float8,
		level_c = level_c + CASE WHEN abs(level) >= abs($5::float8) THEN (level - (level + $5::float8)) + $5::float8
			ELSE ($5::float8 - (level + $5::float8)) + level END + $6::float8,
		potential = potential + $7::float8,
		potential_c = potential_c + CASE WHEN abs(potential) >= abs($7::float8) THEN (potential - (potential + $7::float8)) + $7::float8
			ELSE ($7::float8 - (potential + $7::float8)) + potential END + $8::float8
		WHERE id = $9::int2`
)

// The rollups and hours of day go into the connection's shard ($7,
// migration 4): concurrent writers of the same hour touch different rows.
var (
	sqlMergeRollups = mergeInto("rollups", "hour", "timestamptz")
	sqlMergeHods    = mergeInto("hours_of_day", "hod", "int2")
)

// mergeInto is the statement that merges moments ($2–$6, by key $1 of
// type typ) into table's rows of shard $7. The rows a batch merges into
// nearly always exist (the hour's first batch of a shard makes them), so it
// updates those that exist in the statement's snapshot with a plain UPDATE
// and inserts the rest with INSERT … ON CONFLICT DO UPDATE (a row another
// writer of the shard inserted meanwhile: merged into). The upsert alone
// logs a row lock before every update, a third of these tables' WAL in
// bench/sizing.sh's WAL profile.
func mergeInto(table, key, typ string) string {
	return `WITH b AS (SELECT * FROM unnest($1::` + typ + `[], $2::int8[], $3::float8[], $4::float8[], $5::float8[], $6::float8[])
			AS x(` + key + `, n, water_mean, water_m2, ambient_mean, ambient_m2)),
		merged AS (UPDATE ` + table + ` AS r SET ` + mergeMoments + ` FROM b AS excluded
			WHERE r.` + key + ` = excluded.` + key + ` AND r.shard = $7::int2 RETURNING r.` + key + `)
		INSERT INTO ` + table + ` AS r (` + key + `, n, water_mean, water_m2, ambient_mean, ambient_m2, shard)
		SELECT *, $7::int2 FROM b WHERE ` + key + ` NOT IN (SELECT ` + key + ` FROM merged)
		ON CONFLICT (` + key + `, shard) DO UPDATE SET ` + mergeMoments
}

// Write stores batch in one transaction and returns per row whether it was a
// duplicate. See kettle.Store.
//
// The transaction, two round trips for a batch of up to Store.plainBatchRows
// readings (three above): first, pipelined, BEGIN, the registration of
// devices this store has not seen exist, the lock of the batch's devices in
// id order, reading their state (so that two nodes writing overlapping
// devices queue instead of deadlocking), a savepoint and the optimistic
// plain INSERT of the rows from arrays (a larger batch goes by binary COPY
// straight into the day's partition, in a round trip of its own); only if
// a row is already stored does the batch return to the savepoint and insert
// again from arrays with INSERT … ON CONFLICT DO NOTHING RETURNING the keys
// that were new. Last, aggregated in Go over the new rows, the
// devices' new state, the changes in the counts of devices per last_seen
// value (appended to last_seen_moves), the hourly and hour-of-day rollups
// and the totals row (those three in the connection's shard), and COMMIT.
func (s *Store) Write(ctx context.Context, batch []kettle.Measurement, receivedAt time.Time) ([]bool, error) {
	dup := make([]bool, len(batch))
	if len(batch) == 0 {
		return dup, nil
	}
	rows := make([]kettle.Measurement, len(batch))
	for i := range batch {
		rows[i] = batch[i]
		rows[i].Normalize()
	}
	if distinctRuns(rows) {
		// No key twice (the usual batch: uploads of different devices,
		// each in time order): no need to index the keys.
		res, err := s.write(ctx, rows, nil, receivedAt.UTC(), false)
		if err != nil {
			return nil, fmt.Errorf("postgres write batch of %d: %w", len(batch), err)
		}
		for i, ins := range res.inserted {
			dup[i] = !ins
		}
		return dup, nil
	}
	first := make(map[key]int, len(batch)) // key → index in rows
	pos := make([]int, len(batch))         // batch index → index in rows, or -1
	uniq := rows[:0]
	for i := range rows {
		m := rows[i]
		k := key{m.Device, m.Time.UnixMicro()}
		if _, ok := first[k]; ok {
			dup[i], pos[i] = true, -1
			continue
		}
		first[k] = len(uniq)
		pos[i] = len(uniq)
		uniq = append(uniq, m)
	}
	res, err := s.write(ctx, uniq, first, receivedAt.UTC(), false)
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

// distinctRuns reports whether rows come in runs of one device in strictly
// increasing time, no device in two runs: then no key appears twice. It
// looks at each row once and remembers one entry per run.
func distinctRuns(rows []kettle.Measurement) bool {
	var devs map[kettle.DeviceID]struct{}
	for i := range rows {
		if i > 0 && rows[i].Device == rows[i-1].Device {
			if !rows[i].Time.After(rows[i-1].Time) {
				return false
			}
			continue
		}
		if i > 0 && devs == nil {
			devs = make(map[kettle.DeviceID]struct{}, 8)
			devs[rows[0].Device] = struct{}{}
		}
		if devs != nil {
			if _, ok := devs[rows[i].Device]; ok {
				return false
			}
			devs[rows[i].Device] = struct{}{}
		}
	}
	return true
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
	for attempt := 0; attempt < writeAttempts; attempt++ {
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
			s.partitionRetries.Add(1)
			s.forgetPartitions()
			if err := s.loadPartitions(ctx); err != nil {
				return writeResult{}, err
			}
		case errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001"):
			s.conflictRetries.Add(1)
			// Deadlock or serialization failure: run it again after a
			// jittered pause, so writers that collided do not collide again
			// in lockstep.
			pause := time.Duration(1+rand.IntN(5*(attempt+1))) * time.Millisecond
			select {
			case <-ctx.Done():
				return writeResult{}, unavailable("write", ctx.Err())
			case <-time.After(pause):
			}
		default:
			return writeResult{}, unavailable("write", err)
		}
	}
	return writeResult{}, unavailable(fmt.Sprintf("write (%d attempts)", writeAttempts), lastErr)
}

// byKey returns rows sorted by (device, time), copied if not sorted already.
func byKey(rows []kettle.Measurement) []kettle.Measurement {
	cmp := func(a, b kettle.Measurement) int {
		if c := bytes.Compare(a.Device[:], b.Device[:]); c != 0 {
			return c
		}
		return a.Time.Compare(b.Time)
	}
	if slices.IsSortedFunc(rows, cmp) {
		return rows
	}
	sorted := slices.Clone(rows)
	slices.SortFunc(sorted, cmp)
	return sorted
}

// writeAttempts bounds the retries of a batch that lost a deadlock or a
// serialization conflict.
const writeAttempts = 10

// devState is a device row as locked by the write transaction.
type devState struct {
	tid      [6]byte // ctid, binary (block, offset)
	n        int64
	capML    float64
	lastSeen *time.Time
	latest   *kettle.Measurement
	// changed by this batch
	touched bool
	newest  int // index in rows of the newest inserted row
	// newestRow is the newest inserted row, for queueDerived
	newestRow *kettle.Measurement
	last      int // index in rows of the last inserted row seen
	seenMax   time.Time
}

// writeOnce runs the write transaction once, in two round trips or three:
// lock the batch's devices (registering them first when needed), insert
// the rows that are new, then update what they change and commit.
func (s *Store) writeOnce(ctx context.Context, rows []kettle.Measurement, idx map[key]int, at time.Time, bulk bool, lo, hi time.Time) (res writeResult, err error) {
	ids := batchDevices(rows)
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return res, err
	}
	defer pc.Release() // a connection left in a transaction is closed, not reused
	conn := pc.Conn()
	pg := conn.PgConn()
	defer func() {
		if err != nil && !pg.IsClosed() && pg.TxStatus() != 'I' {
			pg.Exec(context.WithoutCancel(ctx), "ROLLBACK").Close()
		}
	}()

	plain := !bulk && len(rows) <= s.plainBatchRows
	idArr := uuidArray(ids)
	devs, newDevs, stored, err := s.lockDevices(ctx, pg, rows, ids, idArr, at, bulk, plain)
	if err != nil {
		return res, err
	}
	res.inserted = make([]bool, len(rows))
	if err := s.insertRows(ctx, conn, rows, idArr, idx, lo, hi, bulk, plain, stored, res.inserted); err != nil {
		return res, err
	}
	var hours []hourAgg
	var hods [24]hourAgg
	res.n, hours, hods = aggregateNew(rows, res.inserted, devs)

	// Last round trip: the derived figures (queueDerived) and COMMIT.
	var b pgconn.Batch
	if !bulk {
		// The devices were locked (FOR UPDATE) by the transaction, before
		// the savepoint; updated inside it, each row's lock and update
		// belong to two transaction ids, which PostgreSQL records as a
		// MultiXact per row (its WAL, and GetMultiXactIdMembers in every
		// later visibility check of the row: half of the primary's CPU in
		// bench/sizing.sh's profile). Released, the updates are the
		// transaction's own.
		b.ExecParams("RELEASE SAVEPOINT kettle_insert", nil, nil, nil, nil)
	}
	if res.n > 0 || newDevs > 0 {
		for _, d := range devs {
			if d.touched {
				d.newestRow = &rows[d.newest]
			}
		}
		s.queueDerived(&b, pg, ids, devs, hours, hods, res.n, newDevs, at, bulk)
	}
	b.ExecParams("COMMIT", nil, nil, nil, nil)
	s.syncCut.Delete(pg)
	if err := execBatch(ctx, pg, &b, nil); err != nil {
		return res, fmt.Errorf("update devices, rollups and totals, commit: %w", err)
	}
	if st := pg.TxStatus(); st != 'I' {
		return res, fmt.Errorf("commit: transaction status %q after COMMIT", st)
	}
	if _, cut := s.syncCut.LoadAndDelete(pg); cut {
		return res, errSyncCut
	}
	s.registered.Add(newDevs)
	s.markKnown(ids)
	return res, nil
}

// batchDevices returns the devices of rows, sorted, each once.
func batchDevices(rows []kettle.Measurement) []kettle.DeviceID {
	ids := make([]kettle.DeviceID, 0, 16)
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
	return sortedUnique(ids)
}

// lockDevices is round trip 1 of writeOnce: begin, lock the batch's
// devices ids (idArr) and read their state into devs; it returns how many
// devices it registered and, for a plain insert, whether that failed on a
// row already stored. Live writes also set the savepoint the optimistic insert returns to
// when a row is already stored, and a live batch of up to Store.plainBatchRows
// rows is inserted right there (see defaultPlainBatchRows).
//
// The lock order. Every write transaction takes its locks in one global
// order: first the registration of the batch's unknown devices (an
// uncommitted INSERT holds the new row: whoever inserts the same id
// waits for our commit), in id order; then the batch's devices FOR
// UPDATE, in id order; then measurements of those devices only; then
// rollups and hours_of_day rows of the connection's shard in key order;
// last the shard's totals row (last_seen_moves is only appended to).
// Registering after the lock breaks that order: a writer
// that holds device b and then inserts device a waits for the writer
// that inserted a first, which may itself wait for b (seen as
// "deadlock detected" between kettle_lock and kettle_register in the
// server log). So a batch whose devices are not all registered rolls
// back, releasing its locks, and starts again registering first.
//
// The first attempt skips the registration when this store has seen
// every device of the batch exist (the common case: registering costs a
// statement and an index probe per device), and registers first
// otherwise, so that a device's first batch does not lock, roll back
// and start again.
func (s *Store) lockDevices(ctx context.Context, pg *pgconn.PgConn, rows []kettle.Measurement, ids []kettle.DeviceID, idArr []byte, at time.Time, bulk, plain bool) (devs map[kettle.DeviceID]*devState, newDevs int64, stored bool, err error) {
	devs = make(map[kettle.DeviceID]*devState, len(ids))
	for register, attempt := !s.allKnown(ids), 1; ; register, attempt = true, attempt+1 {
		var b pgconn.Batch
		b.ExecParams("BEGIN", nil, nil, nil, nil)
		iReg, iLock, iIns := -1, 1, -1
		stored = false
		if register {
			b.ExecPrepared("kettle_register", [][]byte{idArr, timestamptzBin(at)}, bin(2), nil)
			iReg, iLock = 1, 2
		}
		b.ExecPrepared("kettle_lock", [][]byte{idArr}, bin(1), bin(12))
		if !bulk {
			b.ExecParams("SAVEPOINT kettle_insert", nil, nil, nil, nil)
		}
		if plain {
			// In key order: this insert runs before the batch knows that
			// all its devices are locked (a device not registered yet is
			// not), so two writers may insert rows of the same new device
			// at once; in one key order, one waits for the other instead
			// of each waiting for a key the other holds ("deadlock
			// detected … while inserting index tuple", seen in
			// ConcurrentRegistration). A row already stored fails it
			// (and, it being the last statement, nothing after it).
			b.ExecPrepared("kettle_insert", insertParams(byKey(rows)), bin(8), nil)
			iIns = iLock + 2
		}
		got := 0 // results read
		err := execBatch(ctx, pg, &b, func(i int, rr *pgconn.ResultReader) error {
			got = i + 1
			switch i {
			case iReg:
				tag, err := rr.Close()
				newDevs = tag.RowsAffected()
				return err
			case iLock:
				return readLocked(rr, devs)
			}
			_, err := rr.Close()
			return err
		})
		if plain && got == iIns && isUniqueViolation(err) {
			// Everything before the insert succeeded and the insert
			// failed on a row already stored (pgconn hands a statement
			// that fails no result of its own).
			stored, err = true, nil
		}
		if err != nil {
			what := "lock devices"
			if register {
				what = "register and lock devices"
			}
			if plain {
				what += ", insert"
			}
			return nil, 0, false, fmt.Errorf("%s: %w", what, err)
		}
		if len(devs) == len(ids) {
			break
		}
		// Registered and still not found: Prune (of this process or
		// another) deleted the device between the registration, which
		// found it there and did nothing, and the lock. The next attempt
		// registers it again.
		if register && attempt >= maxRegisterAttempts {
			return nil, 0, false, fmt.Errorf("lock devices: %d of %d registered devices not found in %d attempts", len(ids)-len(devs), len(ids), attempt)
		}
		if err := pg.Exec(ctx, "ROLLBACK").Close(); err != nil {
			return nil, 0, false, fmt.Errorf("roll back to register devices: %w", err)
		}
		clear(devs)
	}

	return devs, newDevs, stored, nil
}

// insertRows inserts what the first round trip did not, and sets
// inserted[i] for each row that is new: every row after a plain insert that
// succeeded; else row by row after one that failed on a row already stored,
// by COPY for a bulk write, or insertNew (liveInsert).
func (s *Store) insertRows(ctx context.Context, conn *pgx.Conn, rows []kettle.Measurement, idArr []byte, idx map[key]int, lo, hi time.Time, bulk, plain, stored bool, inserted []bool) error {
	switch {
	case plain && !stored:
		for i := range inserted {
			inserted[i] = true
		}
	case plain:
		if err := insertCareful(ctx, conn, rows, idx, inserted); err != nil {
			return err
		}
	case bulk:
		if err := s.bulkInsert(ctx, conn, rows, idArr, idx, lo, hi, inserted); err != nil {
			return err
		}
	default:
		if err := s.liveInsert(ctx, conn, rows, idx, lo, hi, inserted); err != nil {
			return err
		}
	}

	return nil
}

// aggregateNew sums the inserted rows per device (into devs) and per hour
// and hour of day, in row order so that float results do not depend on map
// iteration order; n is how many were inserted.
func aggregateNew(rows []kettle.Measurement, inserted []bool, devs map[kettle.DeviceID]*devState) (n int64, hours []hourAgg, hods [24]hourAgg) {
	hourIdx := map[int64]int{}
	var d *devState
	lastHour, j := int64(math.MinInt64), -1
	for i := range rows {
		if !inserted[i] {
			continue
		}
		n++
		m := &rows[i]
		if d == nil || m.Device != rows[d.last].Device { // rows of a device usually come together
			d = devs[m.Device]
		}
		d.last = i
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
		if h != lastHour {
			var ok bool
			if j, ok = hourIdx[h]; !ok {
				j = len(hours)
				hourIdx[h] = j
				hours = append(hours, hourAgg{hour: h})
			}
			lastHour = h
		}
		hours[j].water.Add(m.WaterC)
		hours[j].ambient.Add(m.AmbientC)
		hod := &hods[h%24]
		hod.hour = h % 24
		hod.water.Add(m.WaterC)
		hod.ambient.Add(m.AmbientC)
	}

	return n, hours, hods
}

// queueDerived queues in b the statements that keep the derived figures
// exact after a write that stored n new rows (hours and hods: their
// moments) and registered newDevs devices, for the devices ids locked in
// devs (each touched one with its new count, capacity, greatest time and
// newest new row): the devices' new state, the moves of their last_seen
// (appended to last_seen_moves), the hourly and hour-of-day rollups, the
// totals row (hot rows last, so they stay locked only until the commit that
// follows in the same round trip; and in the connection's shard, so that
// other writers do not wait for that commit). Rows of each table are locked
// in key order, tables in this order, by every writer. A live write's
// devices count as seen at at, a bulk (seeding) write's at their newest
// reading.
func (s *Store) queueDerived(b *pgconn.Batch, pg *pgconn.PgConn, ids []kettle.DeviceID, devs map[kettle.DeviceID]*devState, hours []hourAgg, hods [24]hourAgg, n, newDevs int64, at time.Time, bulk bool) {
	shardBin := binary.BigEndian.AppendUint16(nil, uint16(s.shard(pg)))
	var u devUpdate
	u.grow(len(ids))
	var sums [3]ksum                      // charge, level, potential: −old, +new per changed latest
	seenDelta := make(map[int64]int64, 4) // last_seen (unix µs) → change in its device count
	for _, id := range ids {
		d := devs[id]
		if !d.touched {
			continue
		}
		latest := d.latest
		if newest := d.newestRow; latest == nil || newest.Time.After(latest.Time) {
			if latest != nil {
				sums[0].add(-latest.ChargeMWh)
				sums[1].add(-latest.LevelML)
				sums[2].add(-latest.PotentialCmL())
			}
			sums[0].add(newest.ChargeMWh)
			sums[1].add(newest.LevelML)
			sums[2].add(newest.PotentialCmL())
			latest = newest
		}
		seen := at
		if bulk {
			seen = d.seenMax
			if d.lastSeen != nil && d.lastSeen.After(seen) {
				seen = *d.lastSeen
			}
		}
		u.add(d.tid, d.n, d.capML, seen, latest)
		// last_seen_counts + last_seen_moves follow the devices'
		// last_seen exactly: the same µs values that go into (and came from) the devices rows.
		if d.lastSeen == nil || d.lastSeen.UnixMicro() != seen.UnixMicro() {
			if d.lastSeen != nil {
				seenDelta[d.lastSeen.UnixMicro()]--
			}
			seenDelta[seen.UnixMicro()]++
		}
	}
	if len(u.tid) > 0 {
		b.ExecPrepared("kettle_devs", [][]byte{tidArray(u.tid), int8Array(u.n), float8Array(u.capML),
			timestamptzArray(u.seen), timestamptzArray(u.t), float8Array(u.c), float8Array(u.f),
			float8Array(u.r), float8Array(u.a), float8Array(u.w), float8Array(u.l)}, bin(11), nil)
	}
	if len(seenDelta) > 0 {
		if ats, ns := seenChanges(seenDelta); len(ats) > 0 {
			b.ExecPrepared("kettle_seen", [][]byte{timestampsMicroArray(ats), int8Array(ns)}, bin(2), nil)
		}
	}
	if len(hours) > 0 {
		slices.SortFunc(hours, func(a, b hourAgg) int { return int(a.hour - b.hour) })
		hourTimes := make([]time.Time, len(hours))
		for i, h := range hours {
			hourTimes[i] = time.UnixMicro(h.hour * int64(time.Hour/time.Microsecond)).UTC()
		}
		b.ExecPrepared("kettle_rollups", append(momentParams(timestamptzArray(hourTimes), hours), shardBin), bin(7), nil)
	}
	var hodList []hourAgg
	for _, h := range hods {
		if h.water.N > 0 {
			hodList = append(hodList, h)
		}
	}
	if len(hodList) > 0 {
		hodNums := make([]int16, len(hodList))
		for i, h := range hodList {
			hodNums[i] = int16(h.hour)
		}
		b.ExecPrepared("kettle_hods", append(momentParams(int2Array(hodNums), hodList), shardBin), bin(7), nil)
	}
	b.ExecPrepared("kettle_totals", [][]byte{int8Bin(n), int8Bin(newDevs),
		float8Bin(sums[0].s), float8Bin(sums[0].c), float8Bin(sums[1].s), float8Bin(sums[1].c),
		float8Bin(sums[2].s), float8Bin(sums[2].c), shardBin}, bin(9), nil)
}

// maxKnown caps the devices Store remembers as registered (16 bytes and
// map overhead each); beyond it, batches of devices it does not remember
// register them first, which is correct, just a statement more.
const maxKnown = 1 << 20

// maxRegisterAttempts bounds how many times a write registers and locks its
// devices when some are deleted in between (see Prune).
const maxRegisterAttempts = 5

// allKnown reports whether every id is known to exist in the devices table.
// Only Prune deletes devices, and forgets them here; one pruned by another
// process makes a write's first attempt find it missing, roll back and
// register it (the path of an unknown device).
func (s *Store) allKnown(ids []kettle.DeviceID) bool {
	s.knownMu.RLock()
	defer s.knownMu.RUnlock()
	for _, id := range ids {
		if _, ok := s.known[id]; !ok {
			return false
		}
	}
	return true
}

// markKnown remembers ids as registered, once that is committed.
func (s *Store) markKnown(ids []kettle.DeviceID) {
	if s.allKnown(ids) {
		return
	}
	s.knownMu.Lock()
	defer s.knownMu.Unlock()
	for _, id := range ids {
		if len(s.known) >= maxKnown {
			return
		}
		s.known[id] = struct{}{}
	}
}

// execBatch sends b in one round trip and hands each statement's result to
// fn (nil: discard), in order, then returns the first error.
func execBatch(ctx context.Context, pg *pgconn.PgConn, b *pgconn.Batch, fn func(i int, rr *pgconn.ResultReader) error) error {
	mrr := pg.ExecBatch(ctx, b)
	var ferr error
	for i := 0; mrr.NextResult(); i++ {
		rr := mrr.ResultReader()
		var err error
		if fn != nil && ferr == nil {
			err = fn(i, rr)
		} else {
			_, err = rr.Close()
		}
		if err != nil && ferr == nil {
			ferr = err
		}
	}
	if err := mrr.Close(); err != nil {
		return err
	}
	return ferr
}

// momentParams returns the parameters of a moments merge: key, then the columns.
func momentParams(keys []byte, aggs []hourAgg) [][]byte {
	n := make([]int64, len(aggs))
	wm, wm2, am, am2 := make([]float64, len(aggs)), make([]float64, len(aggs)), make([]float64, len(aggs)), make([]float64, len(aggs))
	for i, a := range aggs {
		n[i], wm[i], wm2[i], am[i], am2[i] = a.water.N, a.water.Mean, a.water.M2, a.ambient.Mean, a.ambient.M2
	}
	return [][]byte{keys, int8Array(n), float8Array(wm), float8Array(wm2), float8Array(am), float8Array(am2)}
}

// hourAgg is what one batch adds to one hour (or hour of day).
type hourAgg struct {
	hour           int64 // hours since the unix epoch, or hour of day
	water, ambient kettle.Moments
}

// devUpdate holds the columns of sqlUpdateDevs.
type devUpdate struct {
	tid              [][6]byte
	n                []int64
	capML            []float64
	seen, t          []time.Time
	c, f, r, a, w, l []float64
}

func (u *devUpdate) grow(n int) {
	u.tid = make([][6]byte, 0, n)
	u.n = make([]int64, 0, n)
	u.capML = make([]float64, 0, n)
	u.seen, u.t = make([]time.Time, 0, n), make([]time.Time, 0, n)
	u.c, u.f, u.r = make([]float64, 0, n), make([]float64, 0, n), make([]float64, 0, n)
	u.a, u.w, u.l = make([]float64, 0, n), make([]float64, 0, n), make([]float64, 0, n)
}

func (u *devUpdate) add(tid [6]byte, n int64, capML float64, seen time.Time, m *kettle.Measurement) {
	u.tid = append(u.tid, tid)
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

// defaultPlainBatchRows is the largest live batch inserted in the first
// round trip, by a plain INSERT from arrays (optimistic, like the COPY: under
// the savepoint, falling back to insertNew if a row is already
// stored); larger ones go by COPY (see liveInsert), a round trip more but
// less per row, in CPU and in WAL: COPY logs the rows it puts on a page in
// one record (Heap2/MULTI_INSERT), where an INSERT logs a record per row,
// header and all (about a third of a row's WAL, bench/sizing.sh WAL_PROFILE).
// At the commit window's batches of a few readings the COPY's round trip
// measured no CPU more; a batch of one reading (a quiet fleet, answered at
// once) is a record either way, and saves the round trip.
// Store.plainBatchRows holds it; tests set 0 to send every batch down the
// COPY path.
const defaultPlainBatchRows = 1

// ksum is a Neumaier-compensated running sum: the total is s + c.
type ksum struct{ s, c float64 }

func (k *ksum) add(x float64) {
	t := k.s + x
	if math.Abs(k.s) >= math.Abs(x) {
		k.c += (k.s - t) + x
	} else {
		k.c += (x - t) + k.s
	}
	k.s = t
}

// liveInsert is the insert step of Write for batches over Store.plainBatchRows,
// run with the devices locked and the savepoint kettle_insert set. Duplicates of stored rows are rare (a
// kettle re-sending a reading it got no answer for), so it first tries the
// fastest path: binary COPY straight into the measurements (into the
// partition when the batch falls in one, skipping tuple routing).
// If a row is already stored, the COPY fails on the primary key; then it
// goes the careful way (insertCareful).
func (s *Store) liveInsert(ctx context.Context, c *pgx.Conn, rows []kettle.Measurement, idx map[key]int, lo, hi time.Time, inserted []bool) error {
	conn := c.PgConn()
	table := "measurements"
	if p, ok := s.partitionOf(lo, hi); ok {
		table = p
	}
	_, err := conn.CopyFrom(ctx, newCopyReader(rows), "COPY "+table+" "+copyColumns+" FROM STDIN (FORMAT binary)")
	if err == nil {
		for i := range inserted {
			inserted[i] = true
		}
		return nil
	}
	if !isUniqueViolation(err) {
		return fmt.Errorf("copy into %s: %w", table, err)
	}
	return insertCareful(ctx, c, rows, idx, inserted)
}

// insertCareful is the way of a live batch whose optimistic insert (plain
// INSERT or COPY) failed on a row already stored: back to the savepoint
// kettle_insert, then insertNew.
func insertCareful(ctx context.Context, c *pgx.Conn, rows []kettle.Measurement, idx map[key]int, inserted []bool) error {
	if _, err := c.Exec(ctx, "ROLLBACK TO SAVEPOINT kettle_insert"); err != nil {
		return err
	}
	return insertNew(ctx, c.PgConn(), rows, idx, inserted)
}

// insertNew inserts rows into measurements, skipping keys already stored,
// in key order (the order of every writer's locks), and marks in inserted
// those that were new (idx maps keys to rows; nil: built here).
func insertNew(ctx context.Context, pg *pgconn.PgConn, rows []kettle.Measurement, idx map[key]int, inserted []bool) error {
	if idx == nil {
		idx = indexRows(rows)
	}
	rr := pg.ExecPrepared(ctx, "kettle_insert_new", insertParams(byKey(rows)), bin(8), bin(2))
	for rr.NextRow() {
		v := rr.Values()
		var id kettle.DeviceID
		copy(id[:], v[0])
		t := decTime(v[1])
		i, ok := idx[key{id, t.UnixMicro()}]
		if !ok {
			rr.Close()
			return fmt.Errorf("insert measurements: returned a row (%s, %s) that is not in the batch", id, t.UTC().Format(time.RFC3339Nano))
		}
		inserted[i] = true
	}
	if _, err := rr.Close(); err != nil {
		return fmt.Errorf("insert measurements: %w", err)
	}
	return nil
}

// isUniqueViolation reports whether err is PostgreSQL's unique_violation.
func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// isLockNotAvailable reports whether err is PostgreSQL's lock_not_available
// (lock_timeout passed).
func isLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// seenChanges returns the nonzero changes of delta (last_seen in unix µs →
// change in its device count) in increasing order of last_seen.
func seenChanges(delta map[int64]int64) (ats, ns []int64) {
	ats = make([]int64, 0, len(delta))
	for at, n := range delta {
		if n != 0 {
			ats = append(ats, at)
		}
	}
	slices.Sort(ats)
	ns = make([]int64, len(ats))
	for i, at := range ats {
		ns[i] = delta[at]
	}
	return ats, ns
}
