package storetest

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// prune runs Prune to the end of the devices, limit devices a call, and
// returns every id removed (or that would be, dryRun) in id order.
func prune(t *testing.T, s kettle.Store, before time.Time, limit int, dryRun bool) []kettle.DeviceID {
	t.Helper()
	var all []kettle.DeviceID
	after := uuid.Nil
	for calls := 0; ; calls++ {
		removed, next, err := s.Prune(context.Background(), before, after, limit, dryRun)
		if err != nil {
			t.Fatalf("Prune(%s, after %s, %d, dry run %v): %v", before.Format(time.RFC3339), after, limit, dryRun, err)
		}
		if len(removed) > limit {
			t.Fatalf("Prune(limit %d) removed %d", limit, len(removed))
		}
		all = append(all, removed...)
		if next == uuid.Nil {
			return sortIDs(all)
		}
		if calls > 10_000 {
			t.Fatal("Prune's cursor does not reach the end")
		}
		after = next
	}
}

// registered checks that the store holds exactly want (in any order) and
// counts them in statistic 2a.
func registered(t *testing.T, s kettle.Store, want []kettle.DeviceID) {
	t.Helper()
	var got []kettle.DeviceID
	for _, d := range allDevices(t, s) {
		got = append(got, d.ID)
	}
	if want = sortIDs(want); !slices.Equal(got, want) {
		t.Errorf("devices listed: %d, want %d (%v, want %v)", len(got), len(want), got, want)
	}
	var scanned int
	if err := s.Scan(context.Background(), func(kettle.DeviceState) error { scanned++; return nil }); err != nil {
		t.Fatal(err)
	}
	if st := stats(t, s, kettle.StatsQuery{}); st.DevicesRegistered != int64(len(want)) || scanned != len(want) {
		t.Errorf("DevicesRegistered %d, Scan %d, want %d", st.DevicesRegistered, scanned, len(want))
	}
}

func testPrune(t *testing.T, open Opener) {
	s, reopen := open(t)
	ctx := context.Background()
	v := ids(23, 7)
	reported, staged, revoked, overridden, idle1, idle2, late := v[0], v[1], v[2], v[3], v[4], v[5], v[6]
	if err := s.Register(ctx, v[:6], t0); err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx, []kettle.DeviceID{late}, at(2*time.Hour)); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(23, 1))
	write(t, s, []kettle.Measurement{reading(rng, reported, at(time.Minute))}, at(time.Minute))
	if err := s.Revoke(ctx, revoked, at(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := s.SetOverride(ctx, overridden, kettle.Override{ExpiresAt: at(time.Hour), SetAt: at(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	// The most recent reading last: on the embedded store it is still
	// staged, and the devices row does not show it yet.
	write(t, s, []kettle.Measurement{reading(rng, staged, at(3*time.Hour))}, at(3*time.Hour))

	if _, _, err := s.Prune(ctx, at(time.Hour), uuid.Nil, 0, false); kettle.ErrorCode(err) != kettle.EInvalid {
		t.Errorf("Prune(limit 0) = %v, want EInvalid", err)
	}
	idle := sortIDs([]kettle.DeviceID{idle1, idle2})
	for _, limit := range []int{1, 2, 1000} {
		if got := prune(t, s, at(time.Hour), limit, true); !slices.Equal(got, idle) {
			t.Errorf("dry run, limit %d: %v, want %v", limit, got, idle)
		}
	}
	registered(t, s, v[:7])
	if got := prune(t, s, at(time.Hour), 1, false); !slices.Equal(got, idle) {
		t.Errorf("prune, limit 1: %v, want %v", got, idle)
	}
	left := []kettle.DeviceID{reported, staged, revoked, overridden, late}
	registered(t, s, left)
	if _, err := s.Device(ctx, idle1); kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("Device(pruned) = %v, want ENotFound", err)
	}
	if got := prune(t, s, at(time.Hour), 1000, false); len(got) != 0 {
		t.Errorf("prune again removed %v", got)
	}
	s = reopen(t)
	registered(t, s, left)

	// A pruned kettle that uploads after all is registered again by the write.
	write(t, s, []kettle.Measurement{reading(rng, idle1, at(4*time.Hour))}, at(4*time.Hour))
	left = append(left, idle1)
	registered(t, s, left)
	if d := device(t, s, idle1); d.Measurements != 1 || d.Latest == nil {
		t.Errorf("pruned kettle's first reading: %d measurements, latest %v", d.Measurements, d.Latest)
	}
	// Later, the late registration is old enough too; nothing that reported
	// or is revoked or overridden ever goes.
	if got := prune(t, s, at(5*time.Hour), 3, false); !slices.Equal(got, []kettle.DeviceID{late}) {
		t.Errorf("prune at +5h: %v, want %v", got, []kettle.DeviceID{late})
	}
	left = slices.DeleteFunc(left, func(id kettle.DeviceID) bool { return id == late })
	registered(t, s, left)
	if st := stats(t, s, kettle.StatsQuery{}); st.MeasurementCount != 3 {
		t.Errorf("MeasurementCount %d after pruning, want 3", st.MeasurementCount)
	}
}

// testPruneConcurrent prunes while half of the idle devices store their
// first reading: each of those is either kept or registered again by its
// write, never lost with its reading; the other half all go; the count of
// registered devices equals the devices left.
func testPruneConcurrent(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	all := ids(29, 400)
	if err := s.Register(ctx, all, t0); err != nil {
		t.Fatal(err)
	}
	var writers []kettle.DeviceID
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		var mine []kettle.DeviceID
		for i := w * 2; i < len(all); i += 16 {
			mine = append(mine, all[i])
		}
		writers = append(writers, mine...)
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(29, uint64(w)))
			for i := 0; i < len(mine); i += 5 {
				var batch []kettle.Measurement
				for _, d := range mine[i:min(i+5, len(mine))] {
					batch = append(batch, reading(rng, d, at(time.Duration(w+1)*time.Hour)))
				}
				if _, err := s.Write(ctx, batch, at(2*time.Hour)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	for range 3 {
		prune(t, s, at(time.Hour), 7, false)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("write during prune: %v", err)
	}
	prune(t, s, at(time.Hour), 50, false) // whatever was skipped while locked
	registered(t, s, writers)
	for _, d := range writers {
		if st := device(t, s, d); st.Measurements != 1 {
			t.Fatalf("device %s: %d measurements after a concurrent prune, want 1", d, st.Measurements)
		}
	}
	if st := stats(t, s, kettle.StatsQuery{}); st.MeasurementCount != int64(len(writers)) {
		t.Errorf("MeasurementCount %d, want %d", st.MeasurementCount, len(writers))
	}
}

// testPruneRace: four prunes at once (several nodes, or kettle prune beside
// a server's --prune-unreported) remove each stale device once between
// them, and the registered count stays exact.
func testPruneRace(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	stale, live := ids(37, 600), ids(38, 100)
	if err := s.Register(ctx, append(slices.Clone(stale), live...), t0); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(37, 1))
	var batch []kettle.Measurement
	for _, d := range live {
		batch = append(batch, reading(rng, d, at(time.Minute)))
	}
	if _, err := s.Write(ctx, batch, at(time.Minute)); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var removed []kettle.DeviceID
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for p := range 4 {
		wg.Go(func() {
			after := uuid.Nil
			for {
				got, next, err := s.Prune(ctx, at(time.Hour), after, 13+p, false)
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				removed = append(removed, got...)
				mu.Unlock()
				if next == uuid.Nil {
					return
				}
				after = next
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent prune: %v", err)
	}
	if got := sortIDs(removed); !slices.Equal(got, sortIDs(stale)) {
		t.Errorf("four prunes at once removed %d devices (%d distinct), want each of the %d stale ones once", len(removed), len(slices.Compact(got)), len(stale))
	}
	registered(t, s, live)
}

// PruneBenchmark measures Prune of stale registrations: each iteration
// registers n devices an hour before a fleet of n/4 that reported, then
// prunes the stale ones in transactions of 1,000. It reports devices
// removed a second and the longest transaction (what a writer waits for at
// most). Every store's benchmark calls it, so figures compare.
func PruneBenchmark(b *testing.B, s kettle.Store, n int) {
	ctx := context.Background()
	live := ids(31, n/4)
	if err := s.Register(ctx, live, t0); err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(31, 1))
	for i := 0; i < len(live); i += 1000 {
		var batch []kettle.Measurement
		for _, d := range live[i:min(i+1000, len(live))] {
			batch = append(batch, reading(rng, d, at(time.Minute)))
		}
		if _, err := s.Write(ctx, batch, at(time.Minute)); err != nil {
			b.Fatal(err)
		}
	}
	var removed int
	var longest, took time.Duration
	for it := uint64(0); b.Loop(); it++ {
		b.StopTimer()
		stale := ids(32+it, n)
		for i := 0; i < n; i += 1000 {
			if err := s.Register(ctx, stale[i:min(i+1000, n)], t0); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		after := uuid.Nil
		start := time.Now()
		for {
			t := time.Now()
			got, next, err := s.Prune(ctx, at(time.Hour), after, 1000, false)
			if err != nil {
				b.Fatal(err)
			}
			longest = max(longest, time.Since(t))
			removed += len(got)
			if next == uuid.Nil {
				break
			}
			after = next
		}
		took += time.Since(start)
	}
	if want := n * int(b.N); removed != want {
		b.Fatalf("removed %d, want %d", removed, want)
	}
	b.ReportMetric(float64(removed)/took.Seconds(), "devices/s")
	b.ReportMetric(float64(longest.Microseconds())/1000, "max-tx-ms")
}
