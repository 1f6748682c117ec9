// Package storetest is the conformance suite that every kettle.Store runs
// unchanged: sqlite from sqlite/sqlite_test.go, postgres from
// postgres/postgres_test.go. It knows only the kettle.Store interface, and
// it runs against the real database (no fakes but the random numbers, which
// are seeded so that a failure reproduces).
//
// The suite pins the semantics that kettle.Store's comments leave open:
//   - Devices and History with a limit ≤ 0 return everything;
//   - ClearOverride of an unknown device is not an error;
//   - History of an unknown device is empty, not an error;
//   - times round-trip at microsecond precision, in UTC;
//   - DevicesReporting with a zero ReportingSince counts every device that
//     ever stored a measurement.
package storetest

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// Opener returns a fresh, empty store and a function that restarts it:
// reopen closes the store and opens the same database again, as a server
// restart does, and returns the new store. Opener arranges (t.Cleanup) that
// whichever store is current at the end of the test gets closed.
type Opener func(t *testing.T) (s kettle.Store, reopen func(t *testing.T) kettle.Store)

// Run runs the whole suite, each part in its own subtest on its own store.
func Run(t *testing.T, open Opener) {
	for _, c := range []struct {
		name string
		fn   func(*testing.T, Opener)
	}{
		{"Empty", testEmpty},
		{"Register", testRegister},
		{"DevicesPaging", testDevicesPaging},
		{"Scan", testScan},
		{"Write", testWrite},
		{"History", testHistory},
		{"HistoryAcrossDays", testHistoryAcrossDays},
		{"Overrides", testOverrides},
		{"Revoke", testRevoke},
		{"Prune", testPrune},
		{"PruneConcurrent", testPruneConcurrent},
		{"PruneRace", testPruneRace},
		{"Statistics", testStatistics},
		{"Exactness", testExactness},
		{"Concurrency", testConcurrency},
		{"ConcurrentRegistration", testConcurrentRegistration},
		{"Lookup", testLookup},
		{"Expire", testExpire},
		{"ExpireConcurrent", testExpireConcurrent},
	} {
		t.Run(c.name, func(t *testing.T) { c.fn(t, open) })
	}
}

// t0 is the start of the suite's device time; all times are whole µs.
var t0 = time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

// ids returns n random device ids from a seeded generator.
func ids(seed uint64, n int) []kettle.DeviceID {
	rng := rand.New(rand.NewPCG(seed, 0x6b6574746c65))
	out := make([]kettle.DeviceID, n)
	for i := range out {
		for j := range out[i] {
			out[i][j] = byte(rng.UintN(256))
		}
	}
	return out
}

func sortIDs(v []kettle.DeviceID) []kettle.DeviceID {
	v = slices.Clone(v)
	sort.Slice(v, func(i, j int) bool { return bytes.Compare(v[i][:], v[j][:]) < 0 })
	return v
}

// reading returns a plausible measurement of dev at t.
func reading(rng *rand.Rand, dev kettle.DeviceID, t time.Time) kettle.Measurement {
	return kettle.Measurement{
		Device:    dev,
		Time:      t.UTC().Truncate(time.Microsecond),
		ChargeMWh: rng.Float64() * 5000,
		FullMWh:   5000,
		RateMW:    rng.Float64()*1000 - 500,
		AmbientC:  -10 + rng.Float64()*45,
		WaterC:    5 + rng.Float64()*95,
		LevelML:   rng.Float64() * 1700,
	}
}

func write(t *testing.T, s kettle.Store, batch []kettle.Measurement, recv time.Time) []bool {
	t.Helper()
	dup, err := s.Write(context.Background(), batch, recv)
	if err != nil {
		t.Fatalf("Write(%d rows): %v", len(batch), err)
	}
	if len(dup) != len(batch) {
		t.Fatalf("Write(%d rows) returned %d dup flags", len(batch), len(dup))
	}
	return dup
}

func device(t *testing.T, s kettle.Store, id kettle.DeviceID) kettle.DeviceState {
	t.Helper()
	d, err := s.Device(context.Background(), id)
	if err != nil {
		t.Fatalf("Device(%s): %v", id, err)
	}
	return d
}

func stats(t *testing.T, s kettle.Store, q kettle.StatsQuery) kettle.Statistics {
	t.Helper()
	st, err := s.Statistics(context.Background(), q)
	if err != nil {
		t.Fatalf("Statistics(%+v): %v", q, err)
	}
	return st
}

// allDevices pages through Devices with a small page to exercise the cursor.
func allDevices(t *testing.T, s kettle.Store) []kettle.DeviceState {
	t.Helper()
	var out []kettle.DeviceState
	after := uuid.Nil
	for {
		page, err := s.Devices(context.Background(), after, 7)
		if err != nil {
			t.Fatalf("Devices(%s, 7): %v", after, err)
		}
		if len(page) > 7 {
			t.Fatalf("Devices(%s, 7) returned %d devices", after, len(page))
		}
		out = append(out, page...)
		if len(page) < 7 {
			return out
		}
		after = page[len(page)-1].ID
	}
}

// allHistory pages through one device's history with an odd page size.
func allHistory(t *testing.T, s kettle.Store, id kettle.DeviceID) []kettle.Measurement {
	t.Helper()
	var out []kettle.Measurement
	q := kettle.HistoryQuery{Device: id, Limit: 333}
	for {
		page, err := s.History(context.Background(), q)
		if err != nil {
			t.Fatalf("History(%+v): %v", q, err)
		}
		out = append(out, page...)
		if len(page) < q.Limit {
			return out
		}
		q.After = page[len(page)-1].Time
	}
}

func testEmpty(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	st := stats(t, s, kettle.StatsQuery{})
	want := kettle.Statistics{}
	for h := range want.ByHour {
		want.ByHour[h].Hour = h
	}
	if st != want {
		t.Errorf("Statistics of an empty store = %+v, want zero with ByHour[h].Hour = h", st)
	}
	if d, err := s.Devices(ctx, uuid.Nil, 10); err != nil || len(d) != 0 {
		t.Errorf("Devices of an empty store = %v, %v; want none", d, err)
	}
	if dup, err := s.Write(ctx, nil, t0); err != nil || len(dup) != 0 {
		t.Errorf("Write(nil) = %v, %v; want empty, nil", dup, err)
	}
	if err := s.Register(ctx, nil, t0); err != nil {
		t.Errorf("Register(nil): %v", err)
	}
	h, err := s.History(ctx, kettle.HistoryQuery{Device: ids(1, 1)[0], Limit: 10})
	if err != nil || len(h) != 0 {
		t.Errorf("History of an unknown device = %v, %v; want none", h, err)
	}
	_, err = s.Device(ctx, ids(1, 1)[0])
	if kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("Device(unknown) error = %v (code %q), want code %q", err, kettle.ErrorCode(err), kettle.ENotFound)
	}
}

func testRegister(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	v := ids(2, 3)
	a, b, c := v[0], v[1], v[2]
	r0, r1 := at(-time.Hour), at(-time.Minute)
	if err := s.Register(ctx, []kettle.DeviceID{a, b}, r0); err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx, []kettle.DeviceID{b, c, c}, r1); err != nil {
		t.Fatalf("Register of known and repeated ids: %v", err)
	}
	f := func(id kettle.DeviceID, wantReg time.Time) {
		t.Helper()
		d := device(t, s, id)
		if d.ID != id || !d.RegisteredAt.Equal(wantReg) || d.RegisteredAt.Location() != time.UTC {
			t.Errorf("device %s: ID %s RegisteredAt %v, want %v in UTC", id, d.ID, d.RegisteredAt, wantReg)
		}
		if d.Latest != nil || !d.LastSeen.IsZero() || d.Measurements != 0 || d.CapacityML != 0 || d.Override != nil {
			t.Errorf("device %s never reported, got %+v", id, d)
		}
	}
	f(a, r0)
	f(b, r0) // registering again leaves it as it was
	f(c, r1)
	st := stats(t, s, kettle.StatsQuery{})
	if st.DevicesRegistered != 3 || st.DevicesReporting != 0 || st.MeasurementCount != 0 {
		t.Errorf("after registering 3: registered %d reporting %d measurements %d, want 3 0 0",
			st.DevicesRegistered, st.DevicesReporting, st.MeasurementCount)
	}
}

func testDevicesPaging(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	all := ids(3, 25)
	if err := s.Register(ctx, all, t0); err != nil {
		t.Fatal(err)
	}
	sorted := sortIDs(all)
	f := func(after kettle.DeviceID, limit int, want []kettle.DeviceID) {
		t.Helper()
		got, err := s.Devices(ctx, after, limit)
		if err != nil {
			t.Fatalf("Devices(%s, %d): %v", after, limit, err)
		}
		gotIDs := make([]kettle.DeviceID, len(got))
		for i, d := range got {
			gotIDs[i] = d.ID
		}
		if !slices.Equal(gotIDs, want) {
			t.Errorf("Devices(%s, %d) = %v, want %v", after, limit, gotIDs, want)
		}
	}
	f(uuid.Nil, 10, sorted[:10])
	f(sorted[9], 10, sorted[10:20])
	f(sorted[19], 10, sorted[20:])
	f(sorted[24], 10, nil)
	f(uuid.Nil, 0, sorted)  // limit ≤ 0: all
	f(uuid.Nil, -1, sorted) // limit ≤ 0: all
	f(sorted[0], 1, sorted[1:2])
	// A cursor that is not a stored id still works: it is a position.
	between := sorted[5]
	between[15]++
	f(between, 2, sorted[6:8])
	f(uuid.Max, 5, nil)
}

func testScan(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	all := ids(4, 2500) // more than one page of any sensible scan
	if err := s.Register(ctx, all, t0); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(4, 4))
	// Readings from every 5th kettle, some twice, spread over every page:
	// each page's states must fold in its own kettles' readings, all of
	// them, and no other's (as one device's read does).
	want := map[kettle.DeviceID]int64{}
	var batch []kettle.Measurement
	for i := 0; i < len(all); i += 5 {
		for k := range 1 + i%2 {
			batch = append(batch, reading(rng, all[i], at(time.Duration(k+1)*time.Minute)))
			want[all[i]]++
		}
	}
	write(t, s, batch, at(3*time.Minute))
	seen := map[kettle.DeviceID]int{}
	err := s.Scan(ctx, func(d kettle.DeviceState) error {
		seen[d.ID]++
		if d.Measurements != want[d.ID] || (d.Latest == nil) != (want[d.ID] == 0) {
			t.Errorf("Scan: device %s: %d measurements (latest %v), want %d", d.ID, d.Measurements, d.Latest, want[d.ID])
		}
		if one := device(t, s, d.ID); !reflect.DeepEqual(one, d) {
			t.Errorf("Scan: device %s: %+v, read alone %+v", d.ID, d, one)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	for _, id := range all {
		if seen[id] != 1 {
			t.Errorf("Scan saw device %s %d times, want 1", id, seen[id])
		}
	}
	if len(seen) != len(all) {
		t.Errorf("Scan saw %d devices, want %d", len(seen), len(all))
	}
	stop := fmt.Errorf("stop")
	n := 0
	err = s.Scan(ctx, func(kettle.DeviceState) error { n++; return stop })
	if err != stop || n != 1 {
		t.Errorf("Scan with fn failing: err %v after %d calls, want fn's error after 1", err, n)
	}
}

func testWrite(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 5))
	v := ids(5, 2)
	a, b := v[0], v[1]
	r0 := at(-time.Hour)
	if err := s.Register(ctx, []kettle.DeviceID{a}, r0); err != nil {
		t.Fatal(err)
	}
	m := func(dev kettle.DeviceID, mins int, level float64) kettle.Measurement {
		x := reading(rng, dev, at(time.Duration(mins)*time.Minute))
		x.LevelML = level
		return x
	}
	check := func(id kettle.DeviceID, latestMin int, capML float64, n int64, lastSeen, reg time.Time) {
		t.Helper()
		d := device(t, s, id)
		if d.Latest == nil || !d.Latest.Time.Equal(at(time.Duration(latestMin)*time.Minute)) || d.Latest.Device != id {
			t.Errorf("device %s latest = %+v, want the reading at minute %d", id, d.Latest, latestMin)
		}
		if d.CapacityML != capML || d.Measurements != n || !d.LastSeen.Equal(lastSeen) || !d.RegisteredAt.Equal(reg) {
			t.Errorf("device %s: capacity %v measurements %d last seen %v registered %v; want %v %d %v %v",
				id, d.CapacityML, d.Measurements, d.LastSeen, d.RegisteredAt, capML, n, lastSeen, reg)
		}
	}
	wantDup := func(batch []kettle.Measurement, recv time.Time, want ...bool) {
		t.Helper()
		if got := write(t, s, batch, recv); !slices.Equal(got, want) {
			t.Errorf("Write dup flags = %v, want %v", got, want)
		}
	}

	// A repeat inside the batch is a duplicate, even with other values;
	// b was never registered and is registered at receivedAt.
	a10 := m(a, 10, 500)
	a10again := m(a, 10, 900)
	r1 := at(11 * time.Minute)
	wantDup([]kettle.Measurement{a10, a10again, m(b, 3, 100)}, r1, false, true, false)
	check(a, 10, 500, 1, r1, r0)
	check(b, 3, 100, 1, r1, r1)
	if got := device(t, s, a).Latest; *got != a10 {
		t.Errorf("latest of a = %+v, want the first of the duplicates %+v", *got, a10)
	}

	// A repeat of a stored row: duplicate, changes nothing, not even last seen.
	wantDup([]kettle.Measurement{a10again}, at(12*time.Minute), true)
	check(a, 10, 500, 1, r1, r0)

	// Back-dated: stored and counted, raises capacity, latest stays.
	r2 := at(13 * time.Minute)
	wantDup([]kettle.Measurement{m(a, 5, 1200)}, r2, false)
	check(a, 10, 1200, 2, r2, r0)

	// Newer rows out of order inside one batch: the newest wins.
	r3 := at(30 * time.Minute)
	a20, a25 := m(a, 20, 300), m(a, 25, 200)
	wantDup([]kettle.Measurement{a25, a20, a25}, r3, false, false, true)
	check(a, 25, 1200, 4, r3, r0)
	if got := device(t, s, a).Latest; *got != a25 {
		t.Errorf("latest of a = %+v, want %+v", *got, a25)
	}

	st := stats(t, s, kettle.StatsQuery{})
	latestB := device(t, s, b).Latest
	wantCharge := a25.ChargeMWh + latestB.ChargeMWh
	wantLevel := a25.LevelML + latestB.LevelML
	wantPot := a25.PotentialCmL() + latestB.PotentialCmL()
	if st.MeasurementCount != 5 || st.RangeCount != 5 || st.DevicesRegistered != 2 || st.DevicesReporting != 2 {
		t.Errorf("counts: measurements %d range %d registered %d reporting %d, want 5 5 2 2",
			st.MeasurementCount, st.RangeCount, st.DevicesRegistered, st.DevicesReporting)
	}
	if !near(st.TotalChargeMWh, wantCharge, 1) || !near(st.TotalWaterML, wantLevel, 1) || !near(st.TotalPotentialCmL, wantPot, 1) {
		t.Errorf("totals: charge %v water %v potential %v, want %v %v %v",
			st.TotalChargeMWh, st.TotalWaterML, st.TotalPotentialCmL, wantCharge, wantLevel, wantPot)
	}
	if !near(st.TotalPotentialJ(), wantPot*kettle.JoulesPerCmL, 1) {
		t.Errorf("TotalPotentialJ = %v, want %v", st.TotalPotentialJ(), wantPot*kettle.JoulesPerCmL)
	}
	f := func(since time.Time, want int64) {
		t.Helper()
		if got := stats(t, s, kettle.StatsQuery{ReportingSince: since}).DevicesReporting; got != want {
			t.Errorf("DevicesReporting since %v = %d, want %d", since, got, want)
		}
	}
	f(time.Time{}, 2)
	f(r1, 2) // inclusive
	f(r1.Add(time.Microsecond), 1)
	f(r3, 1)
	f(r3.Add(time.Microsecond), 0)

	// Sub-microsecond device times are kept to the microsecond.
	fine := m(b, 40, 10)
	fine.Time = fine.Time.Add(1500 * time.Nanosecond)
	wantDup([]kettle.Measurement{fine}, at(41*time.Minute), false)
	if got := device(t, s, b).Latest.Time; !got.Equal(at(40*time.Minute + time.Microsecond)) {
		t.Errorf("latest time of b = %v, want it truncated to the microsecond", got)
	}
}

func testHistory(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(6, 6))
	v := ids(6, 2)
	dev, other := v[0], v[1]
	const n = 100
	want := make([]kettle.Measurement, n)
	for i := range want {
		want[i] = reading(rng, dev, at(time.Duration(i)*time.Minute))
	}
	// Store them shuffled, in several batches, with another device's rows
	// interleaved at the same times.
	shuffled := slices.Clone(want)
	rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	for i := 0; i < n; i += 30 {
		batch := slices.Clone(shuffled[i:min(i+30, n)])
		for _, x := range batch {
			batch = append(batch, reading(rng, other, x.Time))
		}
		write(t, s, batch, at(time.Duration(n+i)*time.Minute))
	}
	minute := func(i int) time.Time { // minute i; -1 is the zero time (open)
		if i < 0 {
			return time.Time{}
		}
		return at(time.Duration(i) * time.Minute)
	}
	f := func(from, to, after, limit int, wantFrom, wantTo int) {
		t.Helper()
		q := kettle.HistoryQuery{Device: dev, From: minute(from), To: minute(to), After: minute(after), Limit: limit}
		got, err := s.History(ctx, q)
		if err != nil {
			t.Fatalf("History(%+v): %v", q, err)
		}
		if w := want[wantFrom:wantTo]; !slices.Equal(got, w) {
			t.Errorf("History(from %d, to %d, after %d, limit %d): got %d rows %v, want minutes [%d, %d)",
				from, to, after, limit, len(got), minutes(got), wantFrom, wantTo)
		}
	}
	f(-1, -1, -1, 0, 0, n)      // everything, in order
	f(-1, -1, -1, 10, 0, 10)    // limit
	f(-1, -1, 9, 10, 10, 20)    // cursor
	f(-1, -1, 99, 10, n, n)     // cursor at the end
	f(20, 30, -1, 0, 20, 30)    // From inclusive, To exclusive
	f(20, 30, 25, 0, 26, 30)    // cursor inside the range
	f(20, 30, 10, 3, 20, 23)    // cursor before the range
	f(20, -1, -1, 5, 20, 25)    // From only
	f(-1, 5, -1, 100, 0, 5)     // To only
	f(50, 50, -1, 0, 50, 50)    // empty range
	f(200, 300, -1, 0, n, n)    // after all data
	f(-1, -1, -1, 1000, 0, n)   // limit above the count
	f(-1, 1000, -1, 1000, 0, n) // To after all data

	// Bounds between stored microseconds.
	half := func(i int) time.Time { return minute(i).Add(500 * time.Nanosecond) }
	got, err := s.History(ctx, kettle.HistoryQuery{Device: dev, From: half(10), To: half(12), Limit: 0})
	if err != nil || !slices.Equal(got, want[11:13]) {
		t.Errorf("History(from 10m+0.5µs, to 12m+0.5µs) = minutes %v, %v; want [11 12]", minutes(got), err)
	}
	got, err = s.History(ctx, kettle.HistoryQuery{Device: dev, After: half(10), Limit: 1})
	if err != nil || !slices.Equal(got, want[11:12]) {
		t.Errorf("History(after 10m+0.5µs) = minutes %v, %v; want [11]", minutes(got), err)
	}
}

// testHistoryAcrossDays: a history spread over four months with gaps of
// days between readings, read with bounds and limits drawn at random (a
// PostgreSQL store reads it in windows of its day partitions, which must
// not show): every answer is the stored rows in the bounds, in order, up
// to the limit.
func testHistoryAcrossDays(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(8, 8))
	v := ids(8, 2)
	dev, other := v[0], v[1]
	var want []kettle.Measurement
	for d := 0; d < 120; d++ {
		if rng.IntN(3) > 0 {
			continue // a day without readings
		}
		day := at(time.Duration(d) * 24 * time.Hour)
		times := []time.Time{day.Add(time.Duration(rng.Int64N(int64(24 * time.Hour))))}
		switch rng.IntN(4) {
		case 0:
			times = append(times, day) // midnight: a partition's first instant
		case 1:
			times = append(times, day.Add(24*time.Hour-time.Microsecond)) // its last
		}
		for _, tm := range times {
			want = append(want, reading(rng, dev, tm))
		}
	}
	slices.SortFunc(want, func(a, b kettle.Measurement) int { return a.Time.Compare(b.Time) })
	want = slices.CompactFunc(want, func(a, b kettle.Measurement) bool { return a.Time.Equal(b.Time) })
	shuffled := slices.Clone(want)
	rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	for i := 0; i < len(shuffled); i += 10 {
		batch := slices.Clone(shuffled[i:min(i+10, len(shuffled))])
		for _, x := range batch {
			batch = append(batch, reading(rng, other, x.Time))
		}
		write(t, s, batch, at(200*24*time.Hour))
	}
	if got := allHistory(t, s, dev); !slices.Equal(got, want) {
		t.Fatalf("paged history: %d rows, want %d", len(got), len(want))
	}
	// bound returns no bound, a stored time (or a µs either side), a
	// midnight, or any µs from two days before the first day to two after
	// the last.
	bound := func() time.Time {
		switch rng.IntN(5) {
		case 0:
			return time.Time{}
		case 1:
			return want[rng.IntN(len(want))].Time.Add(time.Duration(rng.IntN(3)-1) * time.Microsecond)
		case 2:
			return at(time.Duration(rng.IntN(124)-2) * 24 * time.Hour)
		}
		return at(time.Duration(rng.Int64N(int64(124*24*time.Hour))) - 2*24*time.Hour).Truncate(time.Microsecond)
	}
	for range 300 {
		q := kettle.HistoryQuery{Device: dev, From: bound(), To: bound(), After: bound(), Limit: []int{0, 1, 2, 3, 7, 40, 1000}[rng.IntN(7)]}
		var exp []kettle.Measurement
		for _, m := range want {
			if (q.From.IsZero() || !m.Time.Before(q.From)) && (q.To.IsZero() || m.Time.Before(q.To)) &&
				(q.After.IsZero() || m.Time.After(q.After)) && (q.Limit <= 0 || len(exp) < q.Limit) {
				exp = append(exp, m)
			}
		}
		got, err := s.History(ctx, q)
		if err != nil {
			t.Fatalf("History(%+v): %v", q, err)
		}
		if !slices.Equal(got, exp) {
			t.Fatalf("History(from %v, to %v, after %v, limit %d): %d rows %v, want %d %v",
				q.From, q.To, q.After, q.Limit, len(got), times(got), len(exp), times(exp))
		}
	}
}

func times(v []kettle.Measurement) []string {
	out := make([]string, len(v))
	for i, m := range v {
		out[i] = m.Time.Format(time.RFC3339Nano)
	}
	return out
}

func minutes(v []kettle.Measurement) []int {
	out := make([]int, len(v))
	for i, m := range v {
		out[i] = int(m.Time.Sub(t0) / time.Minute)
	}
	return out
}

func testOverrides(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	v := ids(7, 2)
	dev, unknown := v[0], v[1]
	if err := s.Register(ctx, []kettle.DeviceID{dev}, t0); err != nil {
		t.Fatal(err)
	}
	yes, no, flush0, flush := true, false, 0.0, 12.5
	exp, set := at(time.Hour), at(time.Minute)
	f := func(o kettle.Override) {
		t.Helper()
		if err := s.SetOverride(ctx, dev, o); err != nil {
			t.Fatalf("SetOverride(%+v): %v", o, err)
		}
		got := device(t, s, dev).Override
		if got == nil {
			t.Fatalf("override %+v read back as nil", o)
		}
		if !eqBool(got.Charge, o.Charge) || !eqBool(got.Fill, o.Fill) || !eqFloat(got.FlushMLPerS, o.FlushMLPerS) ||
			!got.ExpiresAt.Equal(o.ExpiresAt) || !got.SetAt.Equal(o.SetAt) {
			t.Errorf("override %s read back as %s", fmtOverride(&o), fmtOverride(got))
		}
	}
	f(kettle.Override{ExpiresAt: exp, SetAt: set}) // all fields left to the policy
	f(kettle.Override{Charge: &no, Fill: &yes, FlushMLPerS: &flush0, ExpiresAt: exp, SetAt: set})
	f(kettle.Override{Charge: &yes, Fill: &no, FlushMLPerS: &flush, ExpiresAt: exp, SetAt: set})
	f(kettle.Override{Fill: &yes, ExpiresAt: at(2 * time.Hour), SetAt: at(2 * time.Minute)}) // replaces, not merges
	f(kettle.Override{Charge: &yes, ExpiresAt: at(-time.Hour), SetAt: at(-2 * time.Hour)})   // expired is still stored

	if err := s.ClearOverride(ctx, dev); err != nil {
		t.Fatalf("ClearOverride: %v", err)
	}
	if got := device(t, s, dev).Override; got != nil {
		t.Errorf("after ClearOverride override = %s, want nil", fmtOverride(got))
	}
	if err := s.ClearOverride(ctx, dev); err != nil {
		t.Errorf("ClearOverride without an override: %v, want nil", err)
	}
	if err := s.ClearOverride(ctx, unknown); err != nil {
		t.Errorf("ClearOverride(unknown device): %v, want nil", err)
	}
	err := s.SetOverride(ctx, unknown, kettle.Override{Charge: &yes, ExpiresAt: exp})
	if kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("SetOverride(unknown device) error = %v (code %q), want code %q", err, kettle.ErrorCode(err), kettle.ENotFound)
	}
	if _, err := s.Device(ctx, unknown); kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("SetOverride(unknown device) registered it: Device error = %v", err)
	}
	// An override survives writes.
	f(kettle.Override{Charge: &yes, ExpiresAt: exp, SetAt: set})
	write(t, s, []kettle.Measurement{reading(rand.New(rand.NewPCG(7, 7)), dev, at(time.Minute))}, at(2*time.Minute))
	if got := device(t, s, dev).Override; got == nil || !eqBool(got.Charge, &yes) {
		t.Errorf("override after a write = %s, want charge=true", fmtOverride(got))
	}
}

func eqBool(a, b *bool) bool     { return (a == nil) == (b == nil) && (a == nil || *a == *b) }
func eqFloat(a, b *float64) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }

func fmtOverride(o *kettle.Override) string {
	if o == nil {
		return "<nil>"
	}
	p := func(v any) string {
		switch v := v.(type) {
		case *bool:
			if v != nil {
				return fmt.Sprint(*v)
			}
		case *float64:
			if v != nil {
				return fmt.Sprint(*v)
			}
		}
		return "nil"
	}
	return fmt.Sprintf("{charge %s fill %s flush %s expires %v set %v}", p(o.Charge), p(o.Fill), p(o.FlushMLPerS), o.ExpiresAt, o.SetAt)
}

// testStatistics checks the by-hour statistics on a case small enough to
// check by hand, including the rounding of bounds down to whole hours.
func testStatistics(t *testing.T, open Opener) {
	s, _ := open(t)
	dev := ids(8, 1)[0]
	r := func(day, hour, min int, water, ambient float64) kettle.Measurement {
		return kettle.Measurement{Device: dev, Time: at(time.Duration(day*24+hour)*time.Hour + time.Duration(min)*time.Minute),
			WaterC: water, AmbientC: ambient, LevelML: 100, ChargeMWh: 1, FullMWh: 2}
	}
	write(t, s, []kettle.Measurement{
		r(0, 7, 0, 90, 20), r(0, 7, 30, 100, 22), // day 0, 07:00: water mean 95 sd 5
		r(1, 7, 59, 80, 18), // day 1, 07:00
		r(1, 23, 10, 10, -5),
	}, at(50*time.Hour))
	hod := func(st kettle.Statistics, h int, n int64, wMean, wSD, aMean, aSD float64) {
		t.Helper()
		got := st.ByHour[h]
		if got.Hour != h || got.Water.N != n || got.Ambient.N != n ||
			!near(got.Water.Mean, wMean, 1) || !near(got.Water.Stddev(), wSD, 1) ||
			!near(got.Ambient.Mean, aMean, 1) || !near(got.Ambient.Stddev(), aSD, 1) {
			t.Errorf("ByHour[%d] = {N %d water %v±%v ambient %v±%v}, want {N %d water %v±%v ambient %v±%v}",
				h, got.Water.N, got.Water.Mean, got.Water.Stddev(), got.Ambient.Mean, got.Ambient.Stddev(),
				n, wMean, wSD, aMean, aSD)
		}
	}
	st := stats(t, s, kettle.StatsQuery{})
	hod(st, 7, 3, 90, math.Sqrt(200.0/3), 20, math.Sqrt(8.0/3))
	hod(st, 23, 1, 10, 0, -5, 0)
	hod(st, 0, 0, 0, 0, 0, 0)
	if st.RangeCount != 4 || st.MeasurementCount != 4 {
		t.Errorf("open range: RangeCount %d MeasurementCount %d, want 4 4", st.RangeCount, st.MeasurementCount)
	}
	// [day 0 07:45, day 1 07:15) rounds to [day 0 07:00, day 1 07:00).
	st = stats(t, s, kettle.StatsQuery{From: at(7*time.Hour + 45*time.Minute), To: at(31*time.Hour + 15*time.Minute)})
	hod(st, 7, 2, 95, 5, 21, 1)
	hod(st, 23, 0, 0, 0, 0, 0)
	if st.RangeCount != 2 || st.MeasurementCount != 4 {
		t.Errorf("bounded range: RangeCount %d MeasurementCount %d, want 2 4", st.RangeCount, st.MeasurementCount)
	}
	st = stats(t, s, kettle.StatsQuery{From: at(24 * time.Hour)}) // day 1 on
	hod(st, 7, 1, 80, 0, 18, 0)
	hod(st, 23, 1, 10, 0, -5, 0)
	st = stats(t, s, kettle.StatsQuery{To: at(24 * time.Hour)}) // up to day 1
	hod(st, 7, 2, 95, 5, 21, 1)
	if st.RangeCount != 2 {
		t.Errorf("To-only range: RangeCount %d, want 2", st.RangeCount)
	}
}

// near reports whether got is within 1e-9 of want, relative to |want| or
// to floor when |want| is smaller (values near zero).
func near(got, want, floor float64) bool {
	return math.Abs(got-want) <= 1e-9*math.Max(math.Abs(want), floor)
}

// testRevoke: a revoked device keeps its history and statistics, reads back
// revoked (also after a restart and through Scan), and keeps its first
// revocation time; unknown devices are ENotFound; later writes still count.
func testRevoke(t *testing.T, open Opener) {
	s, reopen := open(t)
	ctx := context.Background()
	v := ids(11, 3)
	dev, other, unknown := v[0], v[1], v[2]
	if err := s.Register(ctx, []kettle.DeviceID{dev, other}, t0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write(ctx, []kettle.Measurement{{Device: dev, Time: at(time.Minute), ChargeMWh: 1, FullMWh: 2, AmbientC: 20, WaterC: 60, LevelML: 300}}, at(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := s.Revoke(ctx, dev, at(time.Hour)); err != nil {
		t.Fatalf("Revoke: %v", err)
	}
	if err := s.Revoke(ctx, dev, at(2*time.Hour)); err != nil {
		t.Fatalf("Revoke again: %v", err)
	}
	if err := s.Revoke(ctx, unknown, at(time.Hour)); kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("Revoke(unknown) = %v, want ENotFound", err)
	}
	check := func(s kettle.Store) {
		t.Helper()
		d := device(t, s, dev)
		if !d.RevokedAt.Equal(at(time.Hour)) || d.Measurements != 1 || d.Latest == nil {
			t.Errorf("revoked device reads back as revoked %v, %d measurements", d.RevokedAt, d.Measurements)
		}
		if o := device(t, s, other); !o.RevokedAt.IsZero() {
			t.Errorf("another device reads back revoked")
		}
		seen := false
		s.Scan(ctx, func(d kettle.DeviceState) error {
			if d.ID == dev {
				seen = !d.RevokedAt.IsZero()
			}
			return nil
		})
		if !seen {
			t.Error("Scan does not show the revocation")
		}
		st, err := s.Statistics(ctx, kettle.StatsQuery{})
		if err != nil || st.MeasurementCount != 1 || st.DevicesRegistered != 2 {
			t.Errorf("statistics after revoke: %+v %v", st, err)
		}
	}
	check(s)
	check(reopen(t))
}
