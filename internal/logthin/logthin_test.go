package logthin

import (
	"testing"
	"time"
)

// TestLimiter: Burst lines a window, the rest counted and reported by the
// first line let through after them (fake clock).
func TestLimiter(t *testing.T) {
	l := Limiter{Burst: 3}
	now := time.Unix(1_800_000_000, 0)
	f := func(want bool, wantSkipped int64) {
		t.Helper()
		ok, skipped := l.Allow(now)
		if ok != want || skipped != wantSkipped {
			t.Errorf("Allow at +%s = %v, %d; want %v, %d", now.Sub(time.Unix(1_800_000_000, 0)), ok, skipped, want, wantSkipped)
		}
	}
	f(true, 0)
	f(true, 0)
	f(true, 0)
	for range 10 {
		f(false, 0)
	}
	now = now.Add(999 * time.Millisecond)
	f(false, 0) // same window
	now = now.Add(time.Millisecond)
	f(true, 11) // the next: the 11 left out are told
	f(true, 0)
	var one Limiter // zero value: one line a second
	if ok, _ := one.Allow(now); !ok {
		t.Error("zero Limiter: first line refused")
	}
	if ok, _ := one.Allow(now); ok {
		t.Error("zero Limiter: second line in the same second let through")
	}
}
