package server

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet"
)

func TestWindowQuantile(t *testing.T) {
	buckets := []float64{0, 0.001, 0.01, 0.1, 1} // 4 buckets
	f := func(prev, cur []uint64, want time.Duration) {
		t.Helper()
		if got := windowQuantile(prev, cur, buckets, 0.99); got != want {
			t.Errorf("windowQuantile(%v, %v) = %v, want %v", prev, cur, got, want)
		}
	}
	f(nil, []uint64{100, 0, 0, 0}, 0)                                    // all under 1 ms
	f(nil, []uint64{98, 0, 2, 0}, 10*time.Millisecond)                   // 2% in [10, 100) ms: p99 there
	f(nil, []uint64{99, 0, 1, 0}, 0)                                     // 1%: p99 is still the first bucket
	f([]uint64{1000, 0, 500, 0}, []uint64{1100, 0, 500, 0}, 0)           // old slow samples do not count
	f([]uint64{0, 0, 0, 0}, []uint64{10, 0, 0, 5}, 0)                    // fewer than 20 samples: no evidence
	f([]uint64{5, 0, 0, 0}, []uint64{5, 0, 0, 30}, 100*time.Millisecond) // only slow ones in the window
}

func TestAdmitSheds(t *testing.T) {
	rows, capacity := 0, 10
	a := newAdmission(prometheus.NewRegistry(), 0, 10*time.Second, time.Second, func() (int, int) { return rows, capacity })
	defer a.close()
	f := func(wantOK bool, wantText string) func() {
		t.Helper()
		release, err := a.admit(nil)
		if wantOK {
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			return release
		}
		var e *kettle.Error
		if !errors.As(err, &e) || e.Code != kettle.EUnavailable || e.RetryAfter <= 0 || !strings.Contains(e.Message, wantText) {
			t.Fatalf("admit → %v; want unavailable with Retry-After, naming %q", err, wantText)
		}
		return nil
	}
	f(true, "")()
	rows = 10
	f(false, "--ingest-queue")
	rows = 0

	a.shedding.Store(true)
	for range 50 {
		f(false, "overloaded")
	}
	_, err := a.admit(nil)
	var e *kettle.Error
	errors.As(err, &e)
	if e.RetryAfter < 5*time.Second || e.RetryAfter > 15*time.Second {
		t.Errorf("CPU shedding Retry-After %v, want 10 s ± 50%%", e.RetryAfter)
	}
	a.shedding.Store(false)
	f(true, "")()
}
