package server

import (
	"errors"
	"net/http"
	"net/http/httptest"
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

// admitErr is what admit answers, as the reason's word: "" admitted,
// "cpu" shed for CPU, "queue" refused for a full queue.
func admitErr(t *testing.T, a *admission) string {
	t.Helper()
	err := a.admit(nil)
	a.ingest.Add(-1) // a look, not an upload of the window
	if err == nil {
		return ""
	}
	var e *kettle.Error
	switch {
	case !errors.As(err, &e) || e.Code != kettle.EUnavailable || e.RetryAfter <= 0:
		t.Fatalf("admit → %v; want unavailable with Retry-After", err)
	case strings.Contains(e.Message, "overloaded") && strings.Contains(e.Message, "20ms"):
		if e.RetryAfter < 5*time.Second || e.RetryAfter > 15*time.Second {
			t.Errorf("CPU shedding Retry-After %v, want 10 s ± 50%%", e.RetryAfter)
		}
		return "cpu"
	case strings.Contains(e.Message, "--ingest-queue") && e.RetryAfter == time.Second:
		return "queue"
	}
	t.Fatalf("admit → %v (Retry-After %v): neither CPU shedding nor a full queue", e, e.RetryAfter)
	return ""
}

// shedTotal reads kettle_http_requests_shed_total{reason}.
func shedTotal(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	t.Helper()
	return counterTotal(t, reg, "kettle_http_requests_shed_total", "reason", reason)
}

// counterTotal reads the counter name{label="value"}, or name itself when
// no label is given.
func counterTotal(t *testing.T, reg *prometheus.Registry, name string, labelValue ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if len(labelValue) == 0 {
				return m.GetCounter().GetValue()
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == labelValue[0] && l.GetValue() == labelValue[1] {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestShedDecision drives the admission's windows with made-up scheduling
// latencies, runnable goroutines and request mixes — the requests and
// uploads counted by the same middleware and admit call the server uses —
// and checks when ingest is shed, one window a line.
func TestShedDecision(t *testing.T) {
	rows, capacity := 0, 100
	policy := ShedPolicy{Latency: 20 * time.Millisecond, Window: 100 * time.Millisecond, Windows: 3, MinRunnable: 64, MinIngestShare: 0.1}
	reg := prometheus.NewRegistry()
	a := newAdmission(reg, policy, 10*time.Second, time.Second, func() (int, int) { return rows, capacity })
	defer a.close() // never started: the test is the clock
	count := a.count(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	req := httptest.NewRequest("GET", "/v1/command", nil)

	// f is one window: requests arrive (uploads of them go through admit
	// too), then the window ends with the given p99 and runnable count;
	// want is what the next upload gets.
	f := func(p99 time.Duration, runnable, requests, uploads int, want string) {
		t.Helper()
		for i := range requests {
			count.ServeHTTP(nil, req)
			if i < uploads {
				a.admit(nil)
			}
		}
		a.observe(p99, int64(runnable))
		if got := admitErr(t, a); got != want {
			t.Errorf("after a window p99 %v, %d runnable, %d of %d requests uploads: admit %q, want %q", p99, runnable, uploads, requests, got, want)
		}
		// Polls are asked to wait (max-age) exactly while uploads are shed
		// for CPU.
		switch ma := a.pollMaxAge(); {
		case a.shedding.Load() && (ma < 5*time.Second || ma > 15*time.Second):
			t.Errorf("poll max-age %v while shedding, want 10 s ± 50%%", ma)
		case !a.shedding.Load() && ma != 0:
			t.Errorf("poll max-age %v while not shedding, want 0 (no-cache)", ma)
		}
	}
	const (
		slow = 30 * time.Millisecond // above --shed-latency
		fast = 5 * time.Millisecond
	)
	f(fast, 500, 1000, 500, "")
	f(slow, 500, 1000, 500, "")    // 1st saturated window
	f(slow, 500, 1000, 500, "")    // 2nd
	f(slow, 500, 1000, 500, "cpu") // 3rd in a row: shedding starts
	f(slow, 500, 1000, 0, "cpu")   // while shedding the mix does not matter
	f(slow, 70, 1000, 500, "cpu")
	f(fast, 500, 1000, 500, "") // the first window that is not saturated stops it
	f(slow, 500, 1000, 500, "")
	f(slow, 500, 1000, 500, "")
	f(slow, 63, 1000, 500, "") // too few runnable: not saturated, the count restarts
	f(slow, 500, 1000, 500, "")
	f(slow, 500, 1000, 500, "")
	f(slow, 500, 1000, 500, "cpu")
	f(slow, 63, 1000, 500, "") // stops on too few runnable too
	f(20*time.Millisecond, 500, 1000, 500, "")
	f(20*time.Millisecond, 500, 1000, 500, "")
	f(20*time.Millisecond, 500, 1000, 500, "") // at the threshold is not above it
	f(slow, 500, 1000, 99, "")                 // uploads < 10% of requests: refusing them would not help
	f(slow, 500, 1000, 99, "")
	f(slow, 500, 1000, 99, "")
	f(slow, 500, 1000, 99, "")
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 1000, 99, "") // one window with too few uploads restarts the count
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 0, 0, "") // no requests at all: nothing to shed
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 1000, 100, "")
	f(slow, 500, 1000, 100, "cpu") // exactly 10%, 3 windows
	if n := shedTotal(t, reg, shedSchedLatency); n == 0 {
		t.Errorf("kettle_http_requests_shed_total{reason=sched_latency} = 0 after shedding")
	}
	if n := counterTotal(t, reg, "kettle_http_polls_slowed_total"); n != 5 {
		t.Errorf("kettle_http_polls_slowed_total = %v, want 5 (the windows shed so far)", n)
	}

	// The queue: full refuses whatever the CPU, but CPU shedding is said
	// first (its Retry-After is the one that lowers the load).
	rows = capacity
	f(slow, 500, 1000, 100, "cpu")
	f(fast, 500, 1000, 100, "queue")
	rows = capacity - 1
	f(fast, 500, 1000, 100, "")
	rows = capacity + 5
	f(fast, 10, 10, 10, "queue")
	q := shedTotal(t, reg, shedQueueFull)
	rows = 0
	f(fast, 10, 10, 10, "")
	if got := shedTotal(t, reg, shedQueueFull); got != q || q == 0 {
		t.Errorf("kettle_http_requests_shed_total{reason=ingest_queue_full}: %v then %v; want > 0 and no more once the queue has room", q, got)
	}

	// Latency 0: never shed on CPU, however saturated.
	off := newAdmission(prometheus.NewRegistry(), ShedPolicy{}, 10*time.Second, time.Second, func() (int, int) { return 0, 1 })
	defer off.close()
	for range 10 {
		off.ingest.Add(1000)
		off.observe(time.Second, 10000)
		if off.shedding.Load() {
			t.Fatal("shedding with --shed-latency 0")
		}
	}
}

// TestShedHold: with --shed-hold, shedding stops only after that long
// without a saturated window; a saturated window meanwhile restarts the
// wait.
func TestShedHold(t *testing.T) {
	p := ShedPolicy{Latency: 20 * time.Millisecond, Window: 100 * time.Millisecond, Windows: 2, MinRunnable: 64, MinIngestShare: 0.1, Hold: 250 * time.Millisecond}.withDefaults()
	const slow, fast = 30 * time.Millisecond, 5 * time.Millisecond
	var d shedDecision
	steps := []struct {
		p99  time.Duration
		want bool
	}{
		{slow, false}, {slow, true}, // starts after 2 saturated windows
		{fast, true}, {fast, true}, // 100, 200 ms calm: held
		{slow, true},               // saturated again: the wait restarts
		{fast, true}, {fast, true}, // 100, 200 ms
		{fast, false},                              // 300 ms ≥ 250 ms calm: stops
		{fast, false}, {slow, false}, {slow, true}, // and starts again only after Windows
	}
	for i, s := range steps {
		if got := d.next(p, s.p99, 500, 1000, 500); got != s.want {
			t.Fatalf("window %d (p99 %v): shedding %v, want %v", i, s.p99, got, s.want)
		}
	}
	// Hold 0 stops at the first calm window.
	p.Hold = 0
	d = shedDecision{}
	for i, want := range []bool{false, true, false} {
		p99 := slow
		if i == 2 {
			p99 = fast
		}
		if got := d.next(p, p99, 500, 1000, 500); got != want {
			t.Fatalf("hold 0, window %d: shedding %v, want %v", i, got, want)
		}
	}
}
