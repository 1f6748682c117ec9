package fleet_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func newService(t testing.TB, cfg fleet.Config) (*fleet.Service, kettle.Store) {
	t.Helper()
	return newServiceWith(t, cfg, nil, io.Discard)
}

// newServiceWith is newService with a clock (nil: time.Now) and the log
// written to log.
func newServiceWith(t testing.TB, cfg fleet.Config, now func() time.Time, log io.Writer) (*fleet.Service, kettle.Store) {
	t.Helper()
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	svc, err := fleet.New(context.Background(), st, cfg, slog.New(slog.NewTextHandler(log, nil)), now, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Close(); st.Close() })
	return svc, st
}

func reading(dev kettle.DeviceID, t time.Time, level float64) kettle.Measurement {
	m := kettle.Measurement{Device: dev, Time: t, ChargeMWh: 50, FullMWh: 100, AmbientC: 20, WaterC: 60, LevelML: level}
	m.Normalize()
	return m
}

// TestIngestCommitsAndCaches: many concurrent writers, each acknowledged
// after commit with the right duplicate counts; the cache (what command
// polls read) follows the store's rules; watchers hear of every change.
func TestIngestCommitsAndCaches(t *testing.T) {
	svc, st := newService(t, fleet.Config{})
	var heard atomic.Int64
	svc.OnChange(func(ids []kettle.DeviceID) { heard.Add(int64(len(ids))) })
	devs := make([]kettle.DeviceID, 20)
	for i := range devs {
		devs[i] = uuid.New()
	}
	base := time.Now().Add(-time.Hour).UTC()
	var wg sync.WaitGroup
	var stored, dups atomic.Int64
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				d := devs[(w+i)%len(devs)]
				// Every reading is sent by two writers: one of them is a duplicate.
				m := reading(d, base.Add(time.Duration(i)*time.Second), float64(100+i))
				s, dd, err := svc.Ingest(context.Background(), []kettle.Measurement{m})
				if err != nil {
					t.Error(err)
					return
				}
				stored.Add(int64(s))
				dups.Add(int64(dd))
			}
		}(w)
	}
	wg.Wait()
	if stored.Load()+dups.Load() != 400 {
		t.Fatalf("stored %d + duplicates %d != 400", stored.Load(), dups.Load())
	}
	s, err := st.Statistics(context.Background(), kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	if s.MeasurementCount != stored.Load() {
		t.Errorf("store holds %d, acknowledged as stored %d", s.MeasurementCount, stored.Load())
	}
	for _, d := range devs {
		ds, err := st.Device(context.Background(), d)
		if err != nil {
			t.Fatal(err)
		}
		// The cache's command equals the policy applied to the store's state.
		want := kettle.Decide(kettle.PolicyInput{Latest: ds.Latest, CapacityML: ds.CapacityML, Now: svc.Now()})
		got, _ := svc.Command(d)
		if got.Charge != want.Charge || got.Fill != want.Fill || got.FlushMLPerS != want.FlushMLPerS {
			t.Errorf("cached command %+v, store-derived %+v", got, want)
		}
	}
	if heard.Load() == 0 {
		t.Error("watchers heard no change")
	}
}

// TestCloseDrains: Close commits everything queued before returning, and
// refuses what comes after.
func TestCloseDrains(t *testing.T) {
	for _, writers := range []int{1, 3} {
		t.Run(fmt.Sprintf("writers=%d", writers), func(t *testing.T) {
			svc, st := newService(t, fleet.Config{Writers: writers})
			devs := make([]kettle.DeviceID, 10) // spread over every writer's queue
			for i := range devs {
				devs[i] = uuid.New()
			}
			base := time.Now().Add(-time.Hour).UTC()
			var wg sync.WaitGroup
			var acked atomic.Int64
			for i := 0; i < 200; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					m := reading(devs[i%len(devs)], base.Add(time.Duration(i)*time.Millisecond), 1)
					if s, _, err := svc.Ingest(context.Background(), []kettle.Measurement{m}); err == nil {
						acked.Add(int64(s))
					}
				}(i)
			}
			time.Sleep(5 * time.Millisecond)
			svc.Close()
			wg.Wait()
			if _, _, err := svc.Ingest(context.Background(), []kettle.Measurement{reading(devs[0], base, 1)}); kettle.ErrorCode(err) != kettle.EUnavailable {
				t.Errorf("ingest after Close: %v, want unavailable", err)
			}
			s, _ := st.Statistics(context.Background(), kettle.StatsQuery{})
			if s.MeasurementCount != acked.Load() {
				t.Errorf("stored %d, acked %d", s.MeasurementCount, acked.Load())
			}
		})
	}
}

// BenchmarkIngest: acknowledged readings/s through the queue and batcher
// into SQLite, from 256 concurrent single-reading callers (as HTTP handlers
// are), 2000 devices.
func BenchmarkIngest(b *testing.B) {
	svc, _ := newService(b, fleet.Config{})
	devs := make([]kettle.DeviceID, 2000)
	for i := range devs {
		devs[i] = uuid.New()
	}
	base := time.Now().Add(-24 * time.Hour).UTC()
	var seq atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(128)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := seq.Add(1)
			m := reading(devs[n%int64(len(devs))], base.Add(time.Duration(n)*time.Microsecond), 500)
			if _, _, err := svc.Ingest(context.Background(), []kettle.Measurement{m}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "acked/s")
}

// spyStore records which devices are inside a Write at once (a real store
// underneath; each Write is held a moment so that writers overlap).
type spyStore struct {
	kettle.Store
	mu       sync.Mutex
	inFlight map[kettle.DeviceID]int
	clashes  int // a device in two concurrent Writes
	overlaps int // Writes that began while another was running
	running  int
}

func (s *spyStore) Write(ctx context.Context, ms []kettle.Measurement, received time.Time) ([]bool, error) {
	s.mu.Lock()
	if s.running > 0 {
		s.overlaps++
	}
	s.running++
	mine := map[kettle.DeviceID]bool{}
	for _, m := range ms {
		if !mine[m.Device] {
			mine[m.Device] = true
			if s.inFlight[m.Device] > 0 {
				s.clashes++
			}
			s.inFlight[m.Device]++
		}
	}
	s.mu.Unlock()
	time.Sleep(2 * time.Millisecond)
	dup, err := s.Store.Write(ctx, ms, received)
	s.mu.Lock()
	for d := range mine {
		s.inFlight[d]--
	}
	s.running--
	s.mu.Unlock()
	return dup, err
}

// TestWritersOwnDevices: with several writers, each device belongs to one
// of them, so two concurrent transactions never hold the same device (on
// PostgreSQL they would wait on each other's row locks) — while the writers
// do run at the same time.
func TestWritersOwnDevices(t *testing.T) {
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	spy := &spyStore{Store: st, inFlight: map[kettle.DeviceID]int{}}
	svc, err := fleet.New(context.Background(), spy, fleet.Config{Writers: 3}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	devs := make([]kettle.DeviceID, 30)
	for i := range devs {
		devs[i] = uuid.New()
	}
	base := time.Now().Add(-time.Hour).UTC()
	var wg sync.WaitGroup
	for w := range 30 {
		wg.Go(func() {
			for i := range 40 {
				m := reading(devs[(w+i)%len(devs)], base.Add(time.Duration(w*40+i)*time.Second), 100)
				if _, _, err := svc.Ingest(context.Background(), []kettle.Measurement{m}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	svc.Close()
	if spy.clashes != 0 {
		t.Errorf("%d times a device was in two concurrent writes", spy.clashes)
	}
	if spy.overlaps == 0 {
		t.Error("the three writers never wrote at the same time")
	}
	s, err := st.Statistics(context.Background(), kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	if s.MeasurementCount != 1200 {
		t.Errorf("stored %d readings, sent 1200", s.MeasurementCount)
	}
}

// TestCommandFromCacheAndAfterRestart: over more devices than one cache
// chunk holds, every device's command is the policy applied to its newest
// committed reading and greatest level — answered from the cache that
// ingest filled, and again from the one a restart loads from the store;
// overrides and revocations come back with it, and reporting counts follow
// the commit times.
func TestCommandFromCacheAndAfterRestart(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "k.db")
	st, err := sqlite.Open(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	clock := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	now := func() time.Time { return clock }
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	svc, err := fleet.New(ctx, st, fleet.Config{}, log, now, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	const n = 2500 // > 2 chunks
	ids, err := svc.Register(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]kettle.PolicyInput, n)
	batch := make([]kettle.Measurement, 0, 3*n)
	for i, id := range ids {
		if i%5 == 4 {
			continue // never reports
		}
		t0 := clock.Add(-time.Duration(i%50+1) * time.Minute)
		newest := reading(id, t0, float64(100+i%900))
		newest.WaterC = float64(20 + i%80)
		older := reading(id, t0.Add(-30*time.Second), float64(1500+i%200)) // the greatest level, not the newest
		batch = append(batch, older, newest)
		want[i] = kettle.PolicyInput{Latest: &newest, CapacityML: older.LevelML}
	}
	for lo := 0; lo < len(batch); lo += 500 {
		if _, _, err := svc.Ingest(ctx, batch[lo:min(lo+500, len(batch))]); err != nil {
			t.Fatal(err)
		}
	}
	yes := true
	over := kettle.Override{Charge: &yes, ExpiresAt: clock.Add(time.Hour), SetAt: clock}
	if err := svc.SetOverride(ctx, ids[7], over); err != nil {
		t.Fatal(err)
	}
	want[7].Override = &over
	if err := svc.Revoke(ctx, ids[11]); err != nil {
		t.Fatal(err)
	}
	check := func(when string, svc *fleet.Service) {
		t.Helper()
		for i, id := range ids {
			in := want[i]
			in.Now = clock
			if got, exp := mustCommand(svc, id), kettle.Decide(in); got != exp {
				t.Fatalf("%s: device %d: command %+v, want %+v", when, i, got, exp)
			}
			if svc.Registered(id) == (i == 11) {
				t.Fatalf("%s: device %d: registered %v", when, i, svc.Registered(id))
			}
		}
		if got := svc.DeviceCount(); got != n {
			t.Fatalf("%s: %d devices cached, registered %d", when, got, n)
		}
		if got := svc.ReportingSince(clock); got != n-n/5 {
			t.Fatalf("%s: %d devices reporting since the commit, %d reported", when, got, n-n/5)
		}
		if got := svc.ReportingSince(clock.Add(time.Microsecond)); got != 0 {
			t.Fatalf("%s: %d devices reporting after the last commit", when, got)
		}
	}
	check("live", svc)
	svc.Close()
	svc, err = fleet.New(ctx, st, fleet.Config{}, log, now, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()
	check("after restart", svc)
	if err := svc.ClearOverride(ctx, ids[7]); err != nil {
		t.Fatal(err)
	}
	want[7].Override = nil
	check("override cleared", svc)
	st.Close()
}

func mustCommand(svc *fleet.Service, id kettle.DeviceID) kettle.Command {
	c, _ := svc.Command(id)
	return c
}

// scanStore hands fleet.New a fleet of n devices, each with a reading and a
// last-seen time, 1 in 100 with an override; nothing else is called.
type scanStore struct {
	kettle.Store
	n int
}

func (s scanStore) Scan(ctx context.Context, fn func(kettle.DeviceState) error) error {
	base := time.Now().UTC().Truncate(time.Second)
	yes := true
	for i := range s.n {
		id := uuid.New()
		m := reading(id, base.Add(-time.Duration(i%30)*time.Second), 800)
		d := kettle.DeviceState{ID: id, RegisteredAt: base.Add(-time.Hour), LastSeen: base, Latest: &m, CapacityML: 1500}
		if i%100 == 0 {
			d.Override = &kettle.Override{Fill: &yes, ExpiresAt: base.Add(time.Hour), SetAt: base}
		}
		if err := fn(d); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkGCWithFleetCache: what a full garbage collection costs with a
// fleet's device cache in memory (ns/op is one runtime.GC), and the live
// heap a device. The collector's mark work grows with what it must scan,
// so this is the cache's share of every collection in a server holding
// that fleet. go test -run '^$' -bench GCWithFleetCache ./fleet
func BenchmarkGCWithFleetCache(b *testing.B) {
	for _, n := range []int{20_000, 300_000} {
		b.Run(fmt.Sprintf("devices=%d", n), func(b *testing.B) {
			runtime.GC()
			var before runtime.MemStats
			runtime.ReadMemStats(&before)
			svc, err := fleet.New(context.Background(), scanStore{n: n}, fleet.Config{}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, fleet.Hooks{})
			if err != nil {
				b.Fatal(err)
			}
			defer svc.Close()
			runtime.GC()
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			b.ResetTimer()
			for b.Loop() {
				runtime.GC()
			}
			b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n), "live-B/device")
			if svc.DeviceCount() != n {
				b.Fatalf("%d devices cached, scanned %d", svc.DeviceCount(), n)
			}
		})
	}
}
