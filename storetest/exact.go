package storetest

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

type key struct {
	dev kettle.DeviceID
	t   int64 // unix µs
}

// model is what the test knows it stored: the first row written for each
// key, and (when the writes were sequential) when each device last stored
// a new row. Rows Expire removed move to expired: they no longer count, but
// a device's latest state and capacity still reflect them.
type model struct {
	rows     map[key]kettle.Measurement
	lastSeen map[kettle.DeviceID]time.Time // nil: not tracked
	devices  map[kettle.DeviceID]bool
	expired  map[kettle.DeviceID][]kettle.Measurement
}

// expire moves the rows before before to expired and returns how many.
func (m *model) expire(before time.Time) int64 {
	if m.expired == nil {
		m.expired = map[kettle.DeviceID][]kettle.Measurement{}
	}
	var n int64
	for k, x := range m.rows {
		if x.Time.Before(before) {
			m.expired[k.dev] = append(m.expired[k.dev], x)
			delete(m.rows, k)
			n++
		}
	}
	return n
}

func newModel(trackSeen bool) *model {
	m := &model{rows: map[key]kettle.Measurement{}, devices: map[kettle.DeviceID]bool{}}
	if trackSeen {
		m.lastSeen = map[kettle.DeviceID]time.Time{}
	}
	return m
}

// apply records a batch written sequentially and returns the dup flags the
// store must have returned.
func (m *model) apply(batch []kettle.Measurement, recv time.Time) []bool {
	dup := make([]bool, len(batch))
	for i, x := range batch {
		m.devices[x.Device] = true
		k := key{x.Device, x.Time.UnixMicro()}
		if _, ok := m.rows[k]; ok {
			dup[i] = true
			continue
		}
		m.rows[k] = x
		if m.lastSeen != nil {
			m.lastSeen[x.Device] = recv
		}
	}
	return dup
}

// testExactness is the acceptance test of the statistics: random batches
// over many devices and days, with duplicates (resent and inside a batch),
// out-of-order and back-dated rows, then a restart; every statistic must
// equal a full recompute from the rows read back, counts exactly and floats
// to 1e-9 relative.
func testExactness(t *testing.T, open Opener) {
	s, reopen := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(42, 1))
	const (
		nDev     = 40
		nBatches = 400
		days     = 30
	)
	span := time.Duration(days) * 24 * time.Hour
	devs := ids(42, nDev)
	m := newModel(true)
	// A quarter registered up front; the rest register by writing.
	if err := s.Register(ctx, devs[:nDev/4], t0.Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	for _, d := range devs[:nDev/4] {
		m.devices[d] = true
	}
	clock := make([]time.Duration, nDev) // each device's live position
	var sent []kettle.Measurement        // everything sent, for resends
	recv := t0
	var ranges []kettle.StatsQuery
	for b := 0; b < nBatches; b++ {
		recv = recv.Add(time.Duration(1+rng.IntN(120)) * time.Second)
		size := 1 + rng.IntN(150)
		batch := make([]kettle.Measurement, 0, size+10)
		for len(batch) < size {
			d := rng.IntN(nDev)
			switch k := rng.IntN(20); {
			case k < 12: // live: a little after the device's last reading
				clock[d] += time.Duration(1+rng.IntN(600)) * time.Second
				if clock[d] > span {
					clock[d] = time.Duration(rng.Int64N(int64(span)))
				}
				batch = append(batch, reading(rng, devs[d], at(clock[d]+time.Duration(rng.IntN(1e6))*time.Microsecond)))
			case k < 16: // back-dated: anywhere in the past
				batch = append(batch, reading(rng, devs[d], at(time.Duration(rng.Int64N(int64(span))))))
			case k < 18 && len(sent) > 0: // resent, other values: a duplicate
				old := sent[rng.IntN(len(sent))]
				x := reading(rng, old.Device, old.Time)
				batch = append(batch, x)
			case len(batch) > 0: // repeated inside the batch
				old := batch[rng.IntN(len(batch))]
				batch = append(batch, reading(rng, old.Device, old.Time))
			}
		}
		rng.Shuffle(len(batch), func(i, j int) { batch[i], batch[j] = batch[j], batch[i] })
		want := m.apply(batch, recv)
		got := write(t, s, batch, recv)
		if !slices.Equal(got, want) {
			t.Fatalf("batch %d: dup flags %v, want %v", b, got, want)
		}
		sent = append(sent, batch...)
		if b%97 == 0 {
			ranges = append(ranges, kettle.StatsQuery{ReportingSince: recv})
		}
	}
	// Ranges: open, aligned, unaligned, one-sided, empty, outside the data.
	ranges = append(ranges,
		kettle.StatsQuery{},
		kettle.StatsQuery{From: at(3 * 24 * time.Hour), To: at(10 * 24 * time.Hour)},
		kettle.StatsQuery{From: at(5*24*time.Hour + 30*time.Minute), To: at(5*24*time.Hour + 7*time.Hour + 59*time.Minute)},
		kettle.StatsQuery{From: at(12*24*time.Hour + 17*time.Minute + 3*time.Second)},
		kettle.StatsQuery{To: at(2*24*time.Hour + 5*time.Hour + time.Nanosecond)},
		kettle.StatsQuery{From: at(4 * time.Hour), To: at(4*time.Hour + 30*time.Minute)},
		kettle.StatsQuery{From: at(-48 * time.Hour), To: at(-24 * time.Hour)},
		kettle.StatsQuery{From: at(-48 * time.Hour), To: at(span + 48*time.Hour), ReportingSince: recv.Add(time.Second)},
	)
	check(t, s, m, ranges)
	s = reopen(t)
	check(t, s, m, ranges)
	// And the store keeps working after the restart.
	more := []kettle.Measurement{reading(rng, devs[0], at(span+time.Hour)), reading(rng, devs[1], at(time.Minute))}
	recv = recv.Add(time.Minute)
	if got, want := write(t, s, more, recv), m.apply(more, recv); !slices.Equal(got, want) {
		t.Fatalf("after restart: dup flags %v, want %v", got, want)
	}
	check(t, s, m, ranges)
}

// check reads every device and every row back, recomputes the statistics
// from them and compares them with Statistics for each query. When m is
// given, what was read back must also equal what the test wrote.
func check(t *testing.T, s kettle.Store, m *model, queries []kettle.StatsQuery) {
	t.Helper()
	devs := allDevices(t, s)
	if len(devs) != len(m.devices) {
		t.Errorf("%d devices stored, want %d", len(devs), len(m.devices))
	}
	var rows []kettle.Measurement
	latest := map[kettle.DeviceID]kettle.Measurement{}
	for _, d := range devs {
		if !m.devices[d.ID] {
			t.Errorf("device %s stored, never written", d.ID)
		}
		h := allHistory(t, s, d.ID)
		for i, x := range h {
			if x.Device != d.ID || (i > 0 && !h[i-1].Time.Before(x.Time)) {
				t.Fatalf("history of %s: row %d (%v of %s) out of order or of another device", d.ID, i, x.Time, x.Device)
			}
			if w, ok := m.rows[key{x.Device, x.Time.UnixMicro()}]; !ok || w != x {
				t.Fatalf("history of %s: row %+v, want %+v (stored %v)", d.ID, x, w, ok)
			}
		}
		rows = append(rows, h...)
		if d.Measurements != int64(len(h)) {
			t.Errorf("device %s: Measurements %d, %d rows stored", d.ID, d.Measurements, len(h))
		}
		// Latest state and capacity are over every row ever stored,
		// expired ones included (there are none unless the test expired).
		ever := h
		if m != nil && len(m.expired[d.ID]) > 0 {
			ever = append(slices.Clone(m.expired[d.ID]), h...)
			slices.SortStableFunc(ever, func(a, b kettle.Measurement) int { return a.Time.Compare(b.Time) })
		}
		capML := 0.0
		for _, x := range ever {
			capML = math.Max(capML, x.LevelML)
		}
		if d.CapacityML != capML {
			t.Errorf("device %s: CapacityML %v, want %v", d.ID, d.CapacityML, capML)
		}
		switch {
		case len(ever) == 0 && d.Latest != nil:
			t.Errorf("device %s: latest %+v without history", d.ID, *d.Latest)
		case len(ever) > 0 && (d.Latest == nil || *d.Latest != ever[len(ever)-1]):
			t.Errorf("device %s: latest %+v, want the newest row %+v", d.ID, d.Latest, ever[len(ever)-1])
		}
		if len(ever) > 0 {
			latest[d.ID] = ever[len(ever)-1]
		}
		if m.lastSeen != nil && !d.LastSeen.Equal(m.lastSeen[d.ID]) {
			t.Errorf("device %s: LastSeen %v, want %v", d.ID, d.LastSeen, m.lastSeen[d.ID])
		}
	}
	if len(rows) != len(m.rows) {
		t.Errorf("%d rows stored, want %d", len(rows), len(m.rows))
	}

	var charge, level, potential float64
	for _, x := range latest {
		charge += x.ChargeMWh
		level += x.LevelML
		potential += x.PotentialCmL()
	}
	for _, q := range queries {
		got := stats(t, s, q)
		var reporting int64
		for _, d := range devs {
			if !d.LastSeen.IsZero() && !d.LastSeen.Before(q.ReportingSince) {
				reporting++
			}
		}
		wantCounts := [4]int64{int64(len(rows)), 0, int64(len(devs)), reporting}
		lo, hi := hourFloor(q.From), hourFloor(q.To)
		var water, ambient [24][]float64
		for _, x := range rows {
			if (!q.From.IsZero() && x.Time.Before(lo)) || (!q.To.IsZero() && !x.Time.Before(hi)) {
				continue
			}
			wantCounts[1]++
			h := x.Time.Hour()
			water[h] = append(water[h], x.WaterC)
			ambient[h] = append(ambient[h], x.AmbientC)
		}
		gotCounts := [4]int64{got.MeasurementCount, got.RangeCount, got.DevicesRegistered, got.DevicesReporting}
		if gotCounts != wantCounts {
			t.Errorf("Statistics(%s): [measurements range registered reporting] = %v, want %v", fmtQuery(q), gotCounts, wantCounts)
		}
		if q.From.IsZero() && q.To.IsZero() && got.RangeCount != got.MeasurementCount {
			t.Errorf("Statistics(open): RangeCount %d != MeasurementCount %d", got.RangeCount, got.MeasurementCount)
		}
		f := func(name string, got, want, floor float64) {
			t.Helper()
			if !near(got, want, floor) {
				t.Errorf("Statistics(%s): %s = %.17g, want %.17g (rel. error %.2g)", fmtQuery(q), name, got, want, math.Abs(got-want)/math.Max(math.Abs(want), floor))
			}
		}
		f("TotalChargeMWh", got.TotalChargeMWh, charge, 1)
		f("TotalWaterML", got.TotalWaterML, level, 1)
		f("TotalPotentialCmL", got.TotalPotentialCmL, potential, 1)
		for h := range 24 {
			g := got.ByHour[h]
			if g.Hour != h {
				t.Errorf("Statistics(%s): ByHour[%d].Hour = %d", fmtQuery(q), h, g.Hour)
			}
			for _, v := range []struct {
				name string
				got  kettle.Moments
				xs   []float64
			}{{"water", g.Water, water[h]}, {"ambient", g.Ambient, ambient[h]}} {
				mean, sd := twoPass(v.xs)
				if v.got.N != int64(len(v.xs)) {
					t.Errorf("Statistics(%s): hour %d %s N = %d, want %d", fmtQuery(q), h, v.name, v.got.N, len(v.xs))
				}
				f(fmtHour(h, v.name, "mean"), v.got.Mean, mean, 1)
				f(fmtHour(h, v.name, "stddev"), v.got.Stddev(), sd, 1)
			}
		}
	}
}

// twoPass is the textbook mean and population standard deviation.
func twoPass(xs []float64) (mean, sd float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	var m2 float64
	for _, x := range xs {
		m2 += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(m2 / float64(len(xs)))
}

func hourFloor(t time.Time) time.Time { return t.UTC().Truncate(time.Hour) }

func fmtHour(h int, what, stat string) string {
	return what + " " + stat + " at hour " + string(rune('0'+h/10)) + string(rune('0'+h%10))
}

func fmtQuery(q kettle.StatsQuery) string {
	f := func(t time.Time) string {
		if t.IsZero() {
			return "open"
		}
		return t.Format(time.RFC3339Nano)
	}
	return "from " + f(q.From) + " to " + f(q.To) + " reporting since " + f(q.ReportingSince)
}

// testConcurrency writes from several goroutines at once, to the same and
// to different devices, with keys that collide across goroutines: each key
// must be stored (dup=false) exactly once, and everything derived must equal
// the recompute.
func testConcurrency(t *testing.T, open Opener) {
	s, _ := open(t)
	const (
		writers = 8
		batches = 15
		size    = 60
		nDev    = 12
		slots   = 400 // minute slots per device: collisions are frequent
	)
	devs := ids(9, nDev)
	recv := at(slots * time.Minute)
	before := conflictRetries(s)
	// The values of a row depend only on its key, so whichever writer stores
	// a key first, the stored row is the same.
	row := func(d, slot int) kettle.Measurement {
		return reading(rand.New(rand.NewPCG(uint64(d), uint64(slot))), devs[d], at(time.Duration(slot)*time.Minute))
	}
	results := make([][]concurrentWrite, writers)
	errs := make([]error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			for range batches {
				batch := make([]kettle.Measurement, size)
				for i := range batch {
					d := rng.IntN(nDev)
					if w%2 == 0 {
						d = w % nDev // half the writers mostly hammer one device
						if rng.IntN(3) == 0 {
							d = rng.IntN(nDev)
						}
					}
					batch[i] = row(d, rng.IntN(slots))
				}
				dup, err := s.Write(context.Background(), batch, recv)
				if err != nil {
					errs[w] = err
					return
				}
				results[w] = append(results[w], concurrentWrite{batch, dup})
			}
		})
	}
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", w, err)
		}
	}
	checkNoConflictRetries(t, s, before)
	var flat []concurrentWrite
	for _, rs := range results {
		flat = append(flat, rs...)
	}
	checkConcurrentWrites(t, s, flat, recv)
}

// concurrentWrite is one batch a concurrent writer wrote and what Write
// said of each row.
type concurrentWrite struct {
	batch []kettle.Measurement
	dup   []bool
}

// checkConcurrentWrites checks that every key was reported stored exactly
// once across all writers, and that the store equals the model of all rows.
func checkConcurrentWrites(t *testing.T, s kettle.Store, results []concurrentWrite, recv time.Time) {
	t.Helper()
	m := newModel(true)
	stored := map[key]int{}
	for _, r := range results {
		if len(r.dup) != len(r.batch) {
			t.Fatalf("Write returned %d dup flags for %d rows", len(r.dup), len(r.batch))
		}
		for i, x := range r.batch {
			m.apply([]kettle.Measurement{x}, recv)
			if !r.dup[i] {
				stored[key{x.Device, x.Time.UnixMicro()}]++
			}
		}
	}
	for k := range m.rows {
		if stored[k] != 1 {
			t.Errorf("key (%s, %v) reported stored %d times, want exactly once", k.dev, time.UnixMicro(k.t).UTC(), stored[k])
		}
	}
	check(t, s, m, []kettle.StatsQuery{{}, {From: at(time.Hour), To: at(3 * time.Hour), ReportingSince: recv}})
}

// WriteBenchmark measures Write with batches of batchSize rows, each of a
// different device (out of a fleet of 10 × batchSize), every row new. It
// reports rows/s. Every store's benchmark calls it, so figures compare.
func WriteBenchmark(b *testing.B, s kettle.Store, batchSize int) {
	ctx := context.Background()
	fleet := ids(10, 10*batchSize)
	rng := rand.New(rand.NewPCG(10, 10))
	batch := make([]kettle.Measurement, batchSize)
	for i := range batch {
		batch[i] = reading(rng, fleet[i], t0)
	}
	recv := t0
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for ; b.Loop(); i++ {
		// Next slice of the fleet, each reading a minute later than the
		// device's previous one: all rows new, latest always replaced.
		off := (i * batchSize) % len(fleet)
		tm := t0.Add(time.Duration(i+1) * time.Minute)
		for j := range batch {
			batch[j].Device = fleet[(off+j)%len(fleet)]
			batch[j].Time = tm
		}
		recv = tm
		dup, err := s.Write(ctx, batch, recv)
		if err != nil {
			b.Fatal(err)
		}
		if dup[0] {
			b.Fatal("benchmark row reported duplicate")
		}
	}
	b.ReportMetric(float64(i*batchSize)/b.Elapsed().Seconds(), "rows/s")
}

// ConflictRetrier is implemented by a store that retries a write transaction
// which lost a deadlock or a serialization conflict (postgres). The
// concurrency cases require that it never had to: writers that take their
// locks in one global order do not deadlock each other, and the retry is
// only a safety net against other clients of the database.
type ConflictRetrier interface{ ConflictRetries() uint64 }

func checkNoConflictRetries(t *testing.T, s kettle.Store, before uint64) {
	t.Helper()
	if r, ok := s.(ConflictRetrier); ok {
		if n := r.ConflictRetries() - before; n != 0 {
			t.Errorf("%d write transactions were retried after a deadlock or serialization failure; the writers must take their locks in one global order", n)
		}
	}
}

func conflictRetries(s kettle.Store) uint64 {
	if r, ok := s.(ConflictRetrier); ok {
		return r.ConflictRetries()
	}
	return 0
}

// testConcurrentRegistration is the stress case of the write path's lock
// order while devices are being registered: in every round, writers start
// together with batches that mix devices known to the store with devices
// it has never seen (some new to several writers at once), so each round
// races registrations of the same devices against writers that already find
// them registered. Each key must be stored exactly once, everything derived
// must equal the recompute, and no write may have lost a deadlock.
func testConcurrentRegistration(t *testing.T, open Opener) {
	s, _ := open(t)
	const (
		writers = 8
		rounds  = 30
		fresh   = 6 // devices first seen in each round
		known   = 6 // of the previous round's, written again
		perDev  = 3 // rows per device in a batch
		slots   = 8 // minute slots per device and round: collisions are frequent
	)
	all := ids(11, rounds*fresh)
	recv := at(time.Duration(rounds*slots) * time.Minute)
	row := func(d, slot int) kettle.Measurement {
		return reading(rand.New(rand.NewPCG(uint64(d), uint64(slot))), all[d], at(time.Duration(slot)*time.Minute))
	}
	var results []concurrentWrite
	before := conflictRetries(s)
	for r := range rounds {
		batches := make([][]kettle.Measurement, writers)
		rng := rand.New(rand.NewPCG(uint64(r), 11))
		for w := range batches {
			pool := make([]int, 0, fresh+known)
			for d := r * fresh; d < (r+1)*fresh; d++ {
				pool = append(pool, d)
			}
			for d := max(0, (r-1)*fresh); d < r*fresh && d < (r-1)*fresh+known; d++ {
				pool = append(pool, d)
			}
			rng.Shuffle(len(pool), func(i, j int) { pool[i], pool[j] = pool[j], pool[i] })
			for _, d := range pool[:1+rng.IntN(len(pool))] {
				for range perDev {
					batches[w] = append(batches[w], row(d, r*slots+rng.IntN(slots)))
				}
			}
		}
		dups := make([][]bool, writers)
		errs := make([]error, writers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for w := range writers {
			wg.Go(func() {
				<-start
				dups[w], errs[w] = s.Write(context.Background(), batches[w], recv)
			})
		}
		close(start)
		wg.Wait()
		for w, err := range errs {
			if err != nil {
				t.Fatalf("round %d, writer %d: %v", r, w, err)
			}
			results = append(results, concurrentWrite{batches[w], dups[w]})
		}
	}
	checkNoConflictRetries(t, s, before)
	checkConcurrentWrites(t, s, results, recv)
}
