package fleet_test

import (
	"context"
	"io"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
)

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
