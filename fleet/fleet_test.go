package fleet_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
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
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	svc, err := fleet.New(context.Background(), st, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, fleet.Hooks{})
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
