package fleet_test

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// TestPruneUnreported: with Config.PruneUnreported the housekeeping loop
// prunes by itself, every ExpireEvery: of three kettles registered two
// hours ago (by the service's clock) the one that reported and the one
// registered since stay; the two that never reported go, counted; a
// registration younger than the age is left for a later round. A bound
// under MinPruneAge is refused at start.
func TestPruneUnreported(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	// A retention far longer than the test's two days expires nothing; it
	// makes each round of the loop countable (ExpiryStats.Runs, and a
	// round expires before it prunes).
	svc, _ := newServiceWith(t, fleet.Config{PruneUnreported: time.Hour, Retention: 365 * 24 * time.Hour, ExpireEvery: 20 * time.Millisecond}, clk.now, io.Discard)
	// rounds waits until the loop has finished n more rounds' prunes.
	rounds := func(n uint64) {
		t.Helper()
		until := svc.ExpiryStats().Runs + n + 1
		for deadline := time.Now().Add(10 * time.Second); svc.ExpiryStats().Runs < until; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the housekeeping loop is at round %d after 10 s, want round %d", svc.ExpiryStats().Runs, until)
			}
		}
	}
	ctx := context.Background()
	old, err := svc.Register(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := svc.Ingest(ctx, []kettle.Measurement{reading(old[0], clk.now(), 500)}); err != nil {
		t.Fatal(err)
	}
	clk.add(2 * time.Hour)
	young, err := svc.Register(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for svc.Pruned() < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	rounds(3) // nothing else may go
	if svc.Pruned() != 2 || svc.DeviceCount() != 2 || !svc.Registered(old[0]) || !svc.Registered(young[0]) || svc.Registered(old[1]) || svc.Registered(old[2]) || svc.PruneErrors() != 0 {
		t.Errorf("after rounds of the loop: %d pruned, %d registered (the reporter %v, the young one %v, the two silent ones %v %v), %d errors; want 2 pruned, the reporter and the young one left",
			svc.Pruned(), svc.DeviceCount(), svc.Registered(old[0]), svc.Registered(young[0]), svc.Registered(old[1]), svc.Registered(old[2]), svc.PruneErrors())
	}
	clk.add(2 * time.Hour)
	deadline = time.Now().Add(5 * time.Second)
	for svc.Pruned() < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if svc.Pruned() != 3 || svc.DeviceCount() != 1 || !svc.Registered(old[0]) {
		t.Errorf("two hours later: %d pruned, %d registered; want the young one pruned too, the reporter left", svc.Pruned(), svc.DeviceCount())
	}

	st, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := fleet.New(ctx, st, fleet.Config{PruneUnreported: 5 * time.Minute}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, fleet.Hooks{}); err == nil || !strings.Contains(err.Error(), "at least 10m") {
		t.Errorf("PruneUnreported 5m: %v, want refused naming the 10m floor", err)
	}
}

// pausedScan is a real store whose Scan, once armed, reads every device
// first and hands them over only when released: a refresh whose snapshot
// was taken before a prune and is delivered after it (PostgreSQL's scan is
// one query on one snapshot).
type pausedScan struct {
	kettle.Store
	armed         atomic.Bool
	read, release chan struct{}
}

func (s *pausedScan) Scan(ctx context.Context, fn func(kettle.DeviceState) error) error {
	if !s.armed.Load() {
		return s.Store.Scan(ctx, fn)
	}
	var all []kettle.DeviceState
	if err := s.Store.Scan(ctx, func(d kettle.DeviceState) error { all = append(all, d); return nil }); err != nil {
		return err
	}
	close(s.read)
	<-s.release
	for _, d := range all {
		if err := fn(d); err != nil {
			return err
		}
	}
	return nil
}

// TestPruneDuringRefresh: devices this node prunes while a cache refresh
// is scanning the store (which read them before the delete) are not back
// in the registry when the refresh ends, and are counted pruned once; the
// kettle that reported stays.
func TestPruneDuringRefresh(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	ctx := context.Background()
	st, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	ps := &pausedScan{Store: st, read: make(chan struct{}), release: make(chan struct{})}
	svc, err := fleet.New(ctx, ps, fleet.Config{}, slog.New(slog.NewTextHandler(io.Discard, nil)), clk.now, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Close(); st.Close() })
	ids, err := svc.Register(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := svc.Ingest(ctx, []kettle.Measurement{reading(ids[0], clk.now(), 500)}); err != nil {
		t.Fatal(err)
	}
	clk.add(time.Hour)
	ps.armed.Store(true)
	refreshed := make(chan error, 1)
	go func() { refreshed <- svc.Refresh(ctx) }()
	<-ps.read
	res, err := svc.Prune(ctx, 30*time.Minute, false)
	if err != nil || res.Removed != 4 || svc.DeviceCount() != 1 {
		t.Fatalf("prune during the scan: %+v %v, %d registered; want 4 removed, 1 left", res, err, svc.DeviceCount())
	}
	close(ps.release)
	if err := <-refreshed; err != nil {
		t.Fatal(err)
	}
	if svc.DeviceCount() != 1 || !svc.Registered(ids[0]) || svc.Registered(ids[1]) || svc.Pruned() != 4 {
		t.Errorf("after the refresh that read them before the prune: %d registered (the reporter %v, a pruned one %v), %d pruned; want 1 (the reporter) and 4",
			svc.DeviceCount(), svc.Registered(ids[0]), svc.Registered(ids[1]), svc.Pruned())
	}
}

// BenchmarkPruneMemory registers 100,000 devices on the embedded store
// beside 2,000 that report, prunes the 100,000 an hour later (by the
// service's clock) and reports the process's live heap (after a full
// collection) with only the 2,000, after the registrations and after the
// prune: what a prune gives back of a flood of POST /login.
func BenchmarkPruneMemory(b *testing.B) {
	var skew atomic.Int64
	now := func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	live := func() float64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc) / (1 << 20)
	}
	ctx := context.Background()
	var before, flooded, after float64
	for b.Loop() {
		svc, _ := newServiceWith(b, fleet.Config{}, now, io.Discard)
		fleetIDs, err := svc.Register(ctx, 2000)
		if err != nil {
			b.Fatal(err)
		}
		for i, id := range fleetIDs {
			if _, _, err := svc.Ingest(ctx, []kettle.Measurement{reading(id, now().Add(-time.Duration(i)*time.Millisecond), 500)}); err != nil {
				b.Fatal(err)
			}
		}
		before = live()
		for range 100 {
			if _, err := svc.Register(ctx, 1000); err != nil {
				b.Fatal(err)
			}
		}
		flooded = live()
		skew.Add(int64(time.Hour))
		res, err := svc.Prune(ctx, 30*time.Minute, false)
		if err != nil || res.Removed != 100_000 || svc.DeviceCount() != 2000 {
			b.Fatalf("prune: %+v %v, %d left", res, err, svc.DeviceCount())
		}
		after = live()
	}
	b.ReportMetric(before, "heap-MiB-2000-devices")
	b.ReportMetric(flooded, "heap-MiB-102000-devices")
	b.ReportMetric(after, "heap-MiB-pruned")
}
