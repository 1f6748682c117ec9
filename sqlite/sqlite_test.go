package sqlite_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
	"github.com/kettlefleet/kettlefleet/storetest"
)

// open opens a store on a fresh file in t.TempDir(), in a subdirectory
// that does not exist yet (Open creates it).
func open(t testing.TB, path string, opts ...sqlite.Option) *sqlite.Store {
	t.Helper()
	s, err := sqlite.Open(context.Background(), path, opts...)
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	return s
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) (kettle.Store, func(t *testing.T) kettle.Store) {
		path := filepath.Join(t.TempDir(), "data", "kettle.db")
		cur := open(t, path)
		t.Cleanup(func() {
			if err := cur.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
		return cur, func(t *testing.T) kettle.Store {
			if err := cur.Close(); err != nil {
				t.Fatalf("Close before reopen: %v", err)
			}
			cur = open(t, path)
			return cur
		}
	})
}

// TestConformanceMerging runs the suite with a merge after every few rows,
// so that most reads see some rows merged into measurements and some still
// staged, and merges run concurrently with writes and reads.
func TestConformanceMerging(t *testing.T) {
	storetest.Run(t, func(t *testing.T) (kettle.Store, func(t *testing.T) kettle.Store) {
		path := filepath.Join(t.TempDir(), "data", "kettle.db")
		opt := sqlite.WithMerge(3, time.Hour)
		cur := open(t, path, opt)
		t.Cleanup(func() {
			if err := cur.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if err := cur.MergeErr(); err != nil {
				t.Errorf("a merge failed: %v", err)
			}
		})
		return cur, func(t *testing.T) kettle.Store {
			if err := cur.Close(); err != nil {
				t.Fatalf("Close before reopen: %v", err)
			}
			cur = open(t, path, opt)
			return cur
		}
	})
}

// TestMerge checks that moving staged rows into measurements changes
// nothing a reader sees, that a reading sent again after its merge is
// still a duplicate, and that a reopened store continues from both tables.
func TestMerge(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "kettle.db")
	s := open(t, path, sqlite.WithMerge(1<<30, time.Hour)) // merges only when told
	defer func() { s.Close() }()
	rng := rand.New(rand.NewPCG(7, 7))
	devs := make([]kettle.DeviceID, 5)
	for i := range devs {
		devs[i] = kettle.DeviceID{byte(i * 53), 0xaa} // several staged buckets
	}
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	var sent []kettle.Measurement
	write := func(n int) {
		t.Helper()
		batch := make([]kettle.Measurement, n)
		for i := range batch {
			batch[i] = kettle.Measurement{Device: devs[rng.IntN(len(devs))], Time: t0.Add(time.Duration(rng.IntN(100000)) * time.Second),
				ChargeMWh: rng.Float64() * 100, FullMWh: 100, RateMW: 1, AmbientC: 20, WaterC: 20 + rng.Float64()*60, LevelML: rng.Float64() * 1000}
		}
		dup, err := s.Write(ctx, batch, t0.Add(time.Duration(len(sent))*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for i := range batch {
			if !dup[i] {
				sent = append(sent, batch[i])
			}
		}
	}
	type view struct {
		devs  []kettle.DeviceState
		hist  [][]kettle.Measurement
		stats kettle.Statistics
	}
	look := func() view {
		t.Helper()
		var v view
		var err error
		if v.devs, err = s.Devices(ctx, kettle.DeviceID{}, 0); err != nil {
			t.Fatal(err)
		}
		for _, id := range devs {
			h, err := s.History(ctx, kettle.HistoryQuery{Device: id})
			if err != nil {
				t.Fatal(err)
			}
			v.hist = append(v.hist, h)
			d, err := s.Device(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			v.devs = append(v.devs, d)
		}
		if v.stats, err = s.Statistics(ctx, kettle.StatsQuery{}); err != nil {
			t.Fatal(err)
		}
		return v
	}
	same := func(what string, a, b view) {
		t.Helper()
		if !reflect.DeepEqual(a, b) {
			t.Errorf("%s: reads differ\nbefore %+v\nafter  %+v", what, a, b)
		}
	}
	write(300)
	v0 := look()
	if err := s.Merge(ctx); err != nil {
		t.Fatal(err)
	}
	if s.Merges() == 0 {
		t.Fatalf("Merges() = 0 after a merge")
	}
	same("merge", v0, look())

	// Everything sent again: all duplicates, whether merged or staged.
	write(200)
	again := slices.Clone(sent)
	dup, err := s.Write(ctx, again, t0.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range dup {
		if !d {
			t.Fatalf("row %d (%s at %s) sent again was stored again", i, again[i].Device, again[i].Time)
		}
	}
	v1 := look()
	var n int64
	for _, h := range v1.hist {
		n += int64(len(h))
	}
	if n != int64(len(sent)) || v1.stats.MeasurementCount != n {
		t.Errorf("history holds %d rows, statistics count %d, %d were stored", n, v1.stats.MeasurementCount, len(sent))
	}
	// Reopen with rows in both tables, then merge after the reopen.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = open(t, path, sqlite.WithMerge(1<<30, time.Hour))
	same("reopen", v1, look())
	write(50)
	v2 := look()
	if err := s.Merge(ctx); err != nil {
		t.Fatal(err)
	}
	same("merge after reopen", v2, look())

	// A dense batch (≥ 1024 rows, ≥ 8 a device: a seeder's) goes straight to
	// measurements after merging what is staged; the totals still add up
	// and everything sent again is a duplicate.
	write(40)
	m0 := s.Merges()
	write(2048)
	if s.Merges() == m0 {
		t.Errorf("dense batch on staged rows: no merge before it")
	}
	write(2048) // dense, nothing staged
	count := func() (n int64, st kettle.Statistics) {
		v := look()
		for _, h := range v.hist {
			n += int64(len(h))
		}
		return n, v.stats
	}
	if n, st := count(); n != int64(len(sent)) || st.MeasurementCount != n {
		t.Errorf("after dense batches: history holds %d rows, statistics count %d, %d were stored", n, st.MeasurementCount, len(sent))
	}
	var total int64
	for _, id := range devs {
		d, err := s.Device(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		total += d.Measurements
	}
	if total != int64(len(sent)) {
		t.Errorf("devices count %d measurements, %d were stored", total, len(sent))
	}
	dup, err = s.Write(ctx, slices.Clone(sent), t0.Add(2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.Index(dup, false); i >= 0 {
		t.Errorf("row %d sent again after the dense batches was stored again", i)
	}
}

// TestReopenMigrates checks that opening an existing database applies no
// migration twice and keeps the data.
func TestReopenMigrates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kettle.db")
	ctx := context.Background()
	for i := range 3 {
		s := open(t, path)
		if err := s.Register(ctx, []kettle.DeviceID{{byte(i + 1)}}, time.Unix(0, 0)); err != nil {
			t.Fatal(err)
		}
		st, err := s.Statistics(ctx, kettle.StatsQuery{})
		if err != nil {
			t.Fatal(err)
		}
		if st.DevicesRegistered != int64(i+1) {
			t.Errorf("open %d: %d devices, want %d", i, st.DevicesRegistered, i+1)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
}

// TestBusyRetry holds the write lock from another connection (as another
// process would) for longer than the busy timeout: Write must wait, retry,
// count the retries and then succeed.
func TestBusyRetry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kettle.db")
	s := open(t, path, sqlite.WithBusyTimeout(20*time.Millisecond))
	defer s.Close()
	other, err := sql.Open("sqlite3", "file:"+path+"?_txlock=immediate&_busy_timeout=0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	tx, err := other.Begin()
	if err != nil {
		t.Fatalf("other writer: %v", err)
	}
	released := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		tx.Rollback()
		close(released)
	}()
	m := kettle.Measurement{Device: kettle.DeviceID{1}, Time: time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC), LevelML: 1}
	dup, err := s.Write(context.Background(), []kettle.Measurement{m}, m.Time)
	<-released
	if err != nil || len(dup) != 1 || dup[0] {
		t.Fatalf("Write while locked = %v, %v; want it to retry and succeed", dup, err)
	}
	if s.BusyRetries() == 0 {
		t.Errorf("BusyRetries = 0 after waiting for another writer")
	}

	// Locked for longer than all retries: EUnavailable, not a hang.
	s2 := open(t, path, sqlite.WithBusyTimeout(5*time.Millisecond), sqlite.WithMaxBusyRetries(2))
	defer s2.Close()
	tx, err = other.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = s2.Write(context.Background(), []kettle.Measurement{m}, m.Time)
	if kettle.ErrorCode(err) != kettle.EUnavailable {
		t.Errorf("Write while locked for good: %v (code %q), want code %q", err, kettle.ErrorCode(err), kettle.EUnavailable)
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, size := range []int{1, 100, 1000} {
		b.Run("batch="+strconv.Itoa(size), func(b *testing.B) {
			s := open(b, filepath.Join(b.TempDir(), "kettle.db"))
			defer s.Close()
			storetest.WriteBenchmark(b, s, size)
		})
	}
}

// BenchmarkWriteFleet is ingest as a large fleet makes it: 20,000 devices
// each reporting every 30 s, committed in batches of 500–2000 readings in
// which a device appears at most once, on a store already holding a few
// rounds of history (so every device exists and has pages of its own).
func BenchmarkWriteFleet(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "kettle.db"))
	defer s.Close()
	writeFleet(b, s)
}

func writeFleet(b *testing.B, s kettle.Store) {
	const (
		devices = 20000
		every   = 30 * time.Second
		warm    = 3 // rounds written before the timer starts
	)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(20000, 30))
	fleet := make([]kettle.DeviceID, devices)
	for i := range fleet {
		for j := range fleet[i] {
			fleet[i][j] = byte(rng.UintN(256))
		}
	}
	t0 := time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC)
	// The fleet reports in one fixed order, so a batch that spans the end of
	// one round and the start of the next holds no device twice.
	pos := 0
	next := func(n int) []kettle.Measurement {
		batch := make([]kettle.Measurement, n)
		for j := range batch {
			round, d := pos/devices, pos%devices
			pos++
			batch[j] = kettle.Measurement{
				Device:    fleet[d],
				Time:      t0.Add(time.Duration(round)*every + time.Duration(d)*time.Millisecond),
				ChargeMWh: rng.Float64() * 5000, FullMWh: 5000, RateMW: rng.Float64()*1000 - 500,
				AmbientC: 15 + rng.Float64()*10, WaterC: 20 + rng.Float64()*80, LevelML: rng.Float64() * 1700,
			}
		}
		return batch
	}
	write := func(batch []kettle.Measurement) {
		recv := batch[len(batch)-1].Time.Add(time.Second)
		dup, err := s.Write(ctx, batch, recv)
		if err != nil {
			b.Fatal(err)
		}
		if dup[0] {
			b.Fatal("benchmark row reported duplicate")
		}
	}
	for pos < warm*devices {
		write(next(min(2000, warm*devices-pos)))
	}
	b.ReportAllocs()
	b.ResetTimer()
	rows := 0
	cpu0 := cpuTime()
	for b.Loop() {
		b.StopTimer()
		batch := next(500 + rng.IntN(1501))
		b.StartTimer()
		write(batch)
		rows += len(batch)
	}
	b.ReportMetric(float64(rows)/b.Elapsed().Seconds(), "rows/s")
	// CPU time (user + system, every thread of the process: SQLite and the
	// kernel's share of the WAL writes) is what ingest competes for with the
	// HTTP side on a small machine; unlike rows/s it hardly moves when other
	// work shares the machine.
	b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/float64(rows), "cpu-ns/row")
	if m, ok := s.(interface {
		MergeStats() (int64, uint64, uint64, float64)
	}); ok {
		// How long ingest waits while one bucket merges (it holds the writer).
		if _, n, _, secs := m.MergeStats(); n > 0 {
			b.ReportMetric(secs/float64(n)*1000, "ms/merge")
		}
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkPrune: stale registrations removed from a store of 100,000 of
// them beside 25,000 kettles that reported (storetest.PruneBenchmark).
func BenchmarkPrune(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "kettle.db"))
	defer s.Close()
	storetest.PruneBenchmark(b, s, 100_000)
}
