package sqlite_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"path/filepath"
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
	// CPU time (user + system, every thread of the process: SQLite, the
	// kernel's share of the WAL writes, the checkpointer) is what ingest
	// competes for with the HTTP side on a small machine; unlike rows/s it
	// hardly moves when other work shares the machine.
	b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/float64(rows), "cpu-ns/row")
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
