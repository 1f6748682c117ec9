package fleet

import (
	"testing"
	"time"
)

// TestCommitWindowFollowsRate: no wait while fewer than one more reading is
// expected within the bound, a wait for shareRows readings as the rate
// rises, never past the bound, and a quiet spell forgotten within a few
// arrivals.
func TestCommitWindowFollowsRate(t *testing.T) {
	const bound = 10 * time.Millisecond
	at := time.Unix(1_800_000_000, 0)
	f := func(gap time.Duration, n int, want time.Duration) {
		t.Helper()
		w := commitWindow{max: bound}
		for i := 0; i < n; i++ {
			w.observe(at.Add(time.Duration(i) * gap))
		}
		// (the average is in whole nanoseconds: within 8 ns a gap of the rate)
		if got := w.wait(); got < want || got > want+want/100 {
			t.Errorf("%d arrivals %s apart: window %s, want %s", n, gap, got, want)
		}
	}
	f(time.Second, 100, 0)                              // a quiet fleet: answered at once
	f(bound, 100, 0)                                    // one expected within the bound: still at once
	f(3*time.Millisecond, 100, bound)                   // 333/s: 32 would take 96 ms, the bound wins
	f(100*time.Microsecond, 200, 3200*time.Microsecond) // 10,000/s: 32 take 3.2 ms
	f(time.Millisecond, 1, 0)                           // the first arrival assumes a quiet fleet
	if off := (&commitWindow{}); off.wait() != 0 {
		t.Error("BatchWait 0 waits")
	}

	// A minute's silence, then 333/s again: waiting again within 20 arrivals.
	w := commitWindow{max: bound}
	for i := 0; i < 100; i++ {
		w.observe(at.Add(time.Duration(i) * 3 * time.Millisecond))
	}
	at = at.Add(time.Minute)
	for i := 0; i < 20; i++ {
		w.observe(at.Add(time.Duration(i) * 3 * time.Millisecond))
	}
	if w.wait() < bound {
		t.Errorf("after a quiet minute and 20 arrivals at 333/s: window %s (gap %s), want %s", w.wait(), w.gap, bound)
	}
	// Senders racing to the queue: an earlier time after a later one is a gap of 0.
	w.observe(at.Add(-time.Second))
	if w.gap < 0 || w.last.Before(at) {
		t.Errorf("out-of-order arrival: gap %s, last %s", w.gap, w.last)
	}
}
