package server

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet"
)

// Admission control for ingest. Under overload every request costs CPU before
// any handler runs (read, parse, a goroutine to schedule), and a request that
// waits for the CPU waits behind every other connection's request: with
// thousands of connections that is hundreds of milliseconds for everyone,
// command polls included. The ingest queue bounds the store, not the CPU.
// So ingest is admitted here, before its body is read, decoded or its token
// checked, and refused with 503 + Retry-After when
//
//   - the Go scheduler is saturated (ShedPolicy): for a few windows in a
//     row, goroutines waited longer than its Latency (p99 of
//     /sched/latencies) to run and many of them were waiting — the CPU
//     cannot serve more within the latency budget — and uploads were a
//     real share of the requests (else refusing them would not relieve it).
//     Shedding stops once no window has been saturated for --shed-hold
//     (1 s). The refusal
//     carries a long, jittered Retry-After, so compliant kettles keep their
//     readings and send them later in one request instead of retrying each
//     second: that, not the cheap 503 alone, is what lowers the load;
//   - the ingest queue is full (what the fleet service would answer anyway,
//     minus reading and decoding the body).
//
// There is deliberately no cap on uploads whose body is being read: a few
// hundred clients sending a body a byte a second would hold every slot of
// such a cap and lock out the fleet (they are bounded by --read-timeout and
// --max-conns instead); uploads waiting for their commit are bounded by the
// queue.
//
// Command polls are never refused here: they are answered from memory. But
// when kettles poll faster than the CPU answers (10× the fleet: the polls
// alone exceed it), shedding uploads relieves nothing and every poll waits
// behind the others. So while shedding, a v1 poll's answer carries
// Cache-Control max-age of about the shed Retry-After (pollMaxAge): the
// kettle keeps obeying that command and polls again after it, and the
// fleet's poll rate falls to what the CPU holds. An override reaches a
// kettle told so at most that much later.
type admission struct {
	policy     ShedPolicy
	shedRetry  time.Duration
	queueRetry time.Duration
	queue      func() (rows, capacity int)

	requests atomic.Int64 // HTTP requests arrived in this window (count)
	ingest   atomic.Int64 // of which uploads (admit calls)
	shedding atomic.Bool
	p99      atomic.Int64 // ns, the last window's scheduling latency p99
	runnable atomic.Int64 // goroutines runnable at the end of the last window

	mu  sync.Mutex // serialises observe (the watcher; tests)
	dec shedDecision

	shedCPU, shedQueue prometheus.Counter
	pollsSlowed        prometheus.Counter
	shedStarts         prometheus.Counter // off → on
	shedSeconds        prometheus.Counter // windows shed × window

	stop chan struct{}
	wg   sync.WaitGroup
}

// Shed reasons (the bounded values of kettle_http_requests_shed_total's
// reason label).
const (
	shedSchedLatency = "sched_latency"
	shedQueueFull    = "ingest_queue_full"
)

// ShedPolicy says when ingest is shed because the CPU is saturated. A
// window is saturated when its p99 scheduling latency is above Latency and
// at least MinRunnable goroutines are runnable at its end. Shedding starts
// after Windows saturated windows in a row in which uploads were at least
// MinIngestShare of the requests, and stops at the first window that is not
// saturated.
type ShedPolicy struct {
	// Latency: a window whose goroutines waited longer than this (p99 of
	// /sched/latencies) to run is saturated. 0: never shed on CPU.
	Latency time.Duration
	// Window is how often the scheduling latency is evaluated.
	Window time.Duration
	// Windows: shedding starts after this many saturated windows in a row
	// (a stall of the whole machine for a moment is not overload).
	Windows int
	// MinRunnable: fewer runnable goroutines than this (sampled at the end
	// of a window) never saturate a window, however long they waited: then
	// other processes take the CPU from a lightly loaded server, and
	// refusing its uploads would relieve nothing.
	MinRunnable int
	// Hold: once shedding, it stops only after this long without a
	// saturated window (0: at the first window that is not saturated).
	// Shedding relieves the CPU at once, so the first window after it
	// starts is almost never saturated; stopping there lets the crowd that
	// was refused a moment ago straight back in, and the next burst builds
	// for Windows windows before shedding starts again. Measured at 10×
	// load (50 ms windows, no hold): 194 starts in 170 s, most lasting one
	// window, and the probes' slowest answers were the bursts between them.
	Hold time.Duration
	// MinIngestShare: shedding starts only when uploads are at least this
	// share of the requests arriving. Refusing them relieves the CPU only
	// if they are a real part of its load; when something else saturates
	// it (thousands of connections set up at once, clients pipelining
	// reads), refusing the few kettles' uploads would buy nothing and lose
	// their readings' freshness.
	MinIngestShare float64
}

// DefaultShedPolicy is kettle serve's policy once --shed-latency is set.
var DefaultShedPolicy = ShedPolicy{Window: 100 * time.Millisecond, Windows: 3, MinRunnable: 64, MinIngestShare: 0.1, Hold: time.Second}

// withDefaults fills the zero fields from DefaultShedPolicy (Latency and
// Hold stay: 0 is off).
func (p ShedPolicy) withDefaults() ShedPolicy {
	d := DefaultShedPolicy
	if p.Window <= 0 {
		p.Window = d.Window
	}
	if p.Windows <= 0 {
		p.Windows = d.Windows
	}
	if p.MinRunnable <= 0 {
		p.MinRunnable = d.MinRunnable
	}
	p.Hold = max(p.Hold, 0)
	if p.MinIngestShare <= 0 {
		p.MinIngestShare = d.MinIngestShare
	}
	p.Latency = max(p.Latency, 0)
	return p
}

// shedDecision is the shedding decision, fed one window at a time. It reads
// no clock and no runtime metric, so a test can drive it with made-up
// windows.
type shedDecision struct {
	bad  int // consecutive saturated windows with enough uploads
	calm int // consecutive windows not saturated while shedding
	on   bool
}

// next takes one window's evidence — p99 scheduling latency, goroutines
// runnable at its end, HTTP requests and uploads that arrived in it — and
// says whether to shed during the next window.
func (d *shedDecision) next(p ShedPolicy, p99 time.Duration, runnable, requests, uploads int64) bool {
	// Both: waiting is the symptom, a crowd of runnable goroutines says it
	// is this process's own load (shedding can help), not only other
	// processes taking the CPU from a lightly loaded server.
	saturated := p.Latency > 0 && p99 > p.Latency && runnable >= int64(p.MinRunnable)
	switch {
	case d.on:
		switch {
		case saturated:
			d.calm = 0
		case time.Duration(d.calm+1)*p.Window > p.Hold:
			d.on, d.bad, d.calm = false, 0, 0
		default:
			d.calm++
		}
	case saturated && requests > 0 && float64(uploads) >= p.MinIngestShare*float64(requests):
		if d.bad++; d.bad >= p.Windows {
			d.on = true
		}
	default:
		d.bad = 0
	}
	return d.on
}

func newAdmission(reg prometheus.Registerer, policy ShedPolicy, shedRetry, queueRetry time.Duration, queue func() (int, int)) *admission {
	a := &admission{
		policy: policy.withDefaults(), shedRetry: shedRetry, queueRetry: queueRetry,
		queue: queue, stop: make(chan struct{}),
	}
	shed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kettle_http_requests_shed_total",
		Help: "Ingest requests refused with 503 + Retry-After before their body was read, by reason: sched_latency (goroutines waited longer than --shed-latency to run: CPU saturated), ingest_queue_full (--ingest-queue). They never reach kettle_ingest_rejected_total.",
	}, []string{"reason"})
	a.shedCPU = shed.WithLabelValues(shedSchedLatency)
	a.shedQueue = shed.WithLabelValues(shedQueueFull)
	a.pollsSlowed = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kettle_http_polls_slowed_total",
		Help: "v1 command polls answered with Cache-Control max-age (about --shed-retry-after) instead of no-cache because the CPU was saturated: the kettle is asked to keep the command and poll again after it.",
	})
	a.shedStarts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kettle_http_shedding_starts_total",
		Help: "Times CPU shedding started (kettle_http_shedding went from 0 to 1). Many starts, each short, mean it flaps: raise --shed-hold.",
	})
	a.shedSeconds = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kettle_http_shedding_seconds_total",
		Help: "Time spent shedding ingest for CPU (windows shed × --shed-window).",
	})
	reg.MustRegister(shed, a.pollsSlowed, a.shedStarts, a.shedSeconds,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_sched_latency_p99_seconds",
			Help: "p99 of the time runnable goroutines waited for a CPU over the last --shed-window (from /sched/latencies:seconds); above --shed-latency, ingest is shed.",
		}, func() float64 { return time.Duration(a.p99.Load()).Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_sched_goroutines_runnable",
			Help: "Goroutines waiting for a CPU, sampled every --shed-window; ingest is shed only when there are at least --shed-runnable and they wait longer than --shed-latency.",
		}, func() float64 { return float64(a.runnable.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_http_shedding",
			Help: "1 while ingest is being shed because the scheduling latency is above --shed-latency, else 0.",
		}, func() float64 {
			if a.shedding.Load() {
				return 1
			}
			return 0
		}),
	)
	return a
}

// start starts the watcher when CPU shedding is on.
func (a *admission) start() {
	if a.policy.Latency > 0 {
		a.wg.Add(1)
		go a.watch()
	}
}

// close stops the watcher.
func (a *admission) close() {
	close(a.stop)
	a.wg.Wait()
}

// watch reads the scheduling latency every window and decides.
func (a *admission) watch() {
	defer a.wg.Done()
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}, {Name: "/sched/goroutines/runnable:goroutines"}}
	var prev []uint64
	t := time.NewTicker(a.policy.Window)
	defer t.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-t.C:
		}
		metrics.Read(s)
		if s[0].Value.Kind() != metrics.KindFloat64Histogram {
			return // not this runtime: no CPU shedding
		}
		h := s[0].Value.Float64Histogram()
		p := windowQuantile(prev, h.Counts, h.Buckets, 0.99)
		prev = append(prev[:0], h.Counts...)
		var runnable uint64
		if s[1].Value.Kind() == metrics.KindUint64 {
			runnable = s[1].Value.Uint64()
		}
		a.observe(p, int64(runnable))
	}
}

// observe ends a window: it records its evidence, takes the window's
// request counts and sets whether ingest is shed until the next.
func (a *admission) observe(p99 time.Duration, runnable int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.p99.Store(int64(p99))
	a.runnable.Store(runnable)
	all, ingest := a.requests.Swap(0), a.ingest.Swap(0)
	on := a.dec.next(a.policy, p99, runnable, all, ingest)
	if on && !a.shedding.Load() {
		a.shedStarts.Inc()
	}
	if on {
		a.shedSeconds.Add(a.policy.Window.Seconds())
	}
	a.shedding.Store(on)
}

// windowQuantile is the q-quantile of the observations counted in cur but
// not in prev (cumulative histograms with the same buckets), as the lower
// bound of its bucket: an underestimate, so shedding starts only on
// evidence. Fewer than 20 observations say nothing: 0.
func windowQuantile(prev, cur []uint64, buckets []float64, q float64) time.Duration {
	var n uint64
	for i := range cur {
		n += cur[i] - at(prev, i)
	}
	if n < 20 {
		return 0
	}
	want := uint64(q*float64(n) + 0.999999)
	var cum uint64
	for i := range cur {
		cum += cur[i] - at(prev, i)
		if cum >= want {
			lo := buckets[i]
			if lo < 0 {
				lo = 0
			}
			return time.Duration(lo * 1e9)
		}
	}
	return 0
}

func at(s []uint64, i int) uint64 {
	if i < len(s) {
		return s[i]
	}
	return 0
}

// admit decides on one ingest request before its body is read: nil admits
// it, else the refusal (503 + Retry-After) to answer.
func (a *admission) admit(*http.Request) error {
	a.ingest.Add(1)
	if a.shedding.Load() {
		a.shedCPU.Inc()
		ra := a.jitter(a.shedRetry)
		return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: ra,
			Message: fmt.Sprintf("server overloaded: requests wait more than %s for a CPU; keep the readings and send them together after %s (Retry-After), or add a node", a.policy.Latency, ra)}
	}
	if rows, capacity := a.queue(); rows >= capacity {
		a.shedQueue.Inc()
		return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: a.queueRetry,
			Message: fmt.Sprintf("ingest queue full (%d readings); retry after %s or raise --ingest-queue", capacity, a.queueRetry)}
	}
	return nil
}

// pollMaxAge is the max-age of a v1 command poll's answer: about the shed
// Retry-After while ingest is shed for CPU, else 0 (no-cache).
func (a *admission) pollMaxAge() time.Duration {
	if !a.shedding.Load() {
		return 0
	}
	a.pollsSlowed.Inc()
	return a.jitter(a.shedRetry)
}

// count counts every HTTP request (the denominator of the uploads' share).
func (a *admission) count(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.requests.Add(1)
		next.ServeHTTP(w, r)
	})
}

// jitter spreads d over [d/2, 3d/2) in whole seconds (at least 1 s), so a
// fleet refused in the same second does not come back in the same second.
func (a *admission) jitter(d time.Duration) time.Duration {
	j := time.Duration(float64(d) * (0.5 + rand.Float64()))
	return max(time.Second, j.Round(time.Second))
}
