package backoff_test

import (
	"context"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/backoff"
)

// TestNext: each wait lies in [bound/2, bound], the bound doubling from
// Initial to Max; a limit is the ceiling in its place; Reset starts again.
func TestNext(t *testing.T) {
	b := backoff.Backoff{Initial: 10 * time.Millisecond, Max: 80 * time.Millisecond}
	check := func(limit, bound time.Duration) {
		t.Helper()
		if d := b.Next(limit); d < bound/2 || d > bound {
			t.Errorf("Next(%v) = %v, want in [%v, %v]", limit, d, bound/2, bound)
		}
	}
	for _, bound := range []time.Duration{10, 20, 40, 80, 80, 80} {
		check(0, bound*time.Millisecond)
	}
	check(4*time.Millisecond, 4*time.Millisecond)
	check(time.Second, 8*time.Millisecond)
	b.Reset()
	check(0, 10*time.Millisecond)
	// Jittered: many waits at one bound are not all the same.
	seen := map[time.Duration]bool{}
	for range 20 {
		b.Reset()
		seen[b.Next(0)] = true
	}
	if len(seen) < 2 {
		t.Errorf("20 first waits took %d distinct values: not jittered", len(seen))
	}
}

// TestWaitStopsOnCancel: Wait returns false at once for a done context.
func TestWaitStopsOnCancel(t *testing.T) {
	b := backoff.Backoff{Initial: time.Hour, Max: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if b.Wait(ctx, 0) {
		t.Error("Wait on a cancelled context returned true")
	}
	b = backoff.Backoff{Initial: time.Millisecond, Max: time.Millisecond}
	if !b.Wait(context.Background(), 0) {
		t.Error("Wait(1ms) returned false")
	}
}
