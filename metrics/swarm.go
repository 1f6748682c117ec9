package metrics

import (
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// SwarmEndpoints are the values of the swarm metrics' endpoint label (the
// simulator's endpoint names); anything else is counted as "other".
var SwarmEndpoints = []string{"login", "measurement", "command", "statistics", "other"}

// SwarmErrorKinds are the fixed values of kettle_swarm_errors_total's kind
// label (the simulator's error classes). Besides these, "http_NNN" for a
// status NNN in 100–599 is kept as is; anything else is "other".
var SwarmErrorKinds = []string{"timeout", "pool_timeout", "refused", "fd_limit", "no_ports", "conn", "other"}

// Swarm is kettle swarm's client-side view, served on --metrics-addr so a
// dashboard can set what the fleet offered against what the server
// completed, as the case study did with its Locust exporter. All methods are
// safe for concurrent use and allocation-free for the known label values.
type Swarm struct {
	reg       *prometheus.Registry
	offered   [nEndpoints]prometheus.Counter
	completed [nEndpoints][6]prometheus.Counter // by status class: 0 other, 1 1xx … 5 5xx
	latency   [nEndpoints]prometheus.Observer
	errors    *prometheus.CounterVec
	fixedErrs [nEndpoints][]prometheus.Counter // by SwarmErrorKinds index
	active    prometheus.Gauge
	lag       prometheus.Gauge

	mu       sync.Mutex
	httpErrs map[[2]int]prometheus.Counter // [endpoint, status]
}

const nEndpoints = 5

// NewSwarm registers the swarm metrics and the Go runtime and process
// collectors on reg.
func NewSwarm(reg *prometheus.Registry) *Swarm {
	s := &Swarm{reg: reg, httpErrs: make(map[[2]int]prometheus.Counter)}
	offered := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kettle_swarm_requests_offered_total",
		Help: "Requests the simulated fleet was due to send (open model: on each kettle's own schedule, whether or not the server keeps up), by endpoint.",
	}, []string{"endpoint"})
	completed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kettle_swarm_requests_completed_total",
		Help: "Requests that got an HTTP response, by endpoint and status class. Offered minus completed is what the server did not keep up with.",
	}, []string{"endpoint", "status"})
	latency := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kettle_swarm_request_duration_seconds",
		Help:    "Latency measured from the intended send time (not the actual one, so a slow server cannot hide behind a late client: coordinated omission), by endpoint.",
		Buckets: LatencyBuckets,
	}, []string{"endpoint"})
	s.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kettle_swarm_errors_total",
		Help: "Failed requests by endpoint and kind: timeout, pool_timeout, refused, fd_limit, no_ports, conn, http_NNN (a non-2xx status), other.",
	}, []string{"endpoint", "kind"})
	s.active = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kettle_swarm_kettles_active",
		Help: "Simulated kettles started (hatched) and running.",
	})
	s.lag = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kettle_swarm_lag_seconds",
		Help: "How late the simulator's dispatcher fired its latest events (the worst in the last reporting interval). Above a few ms the simulator, not the server, is saturated: do not trust the run.",
	})
	for i, ep := range SwarmEndpoints {
		s.offered[i] = offered.WithLabelValues(ep)
		for c := range 6 {
			cl := "other"
			if c > 0 {
				cl = StatusClass(c * 100)
			}
			s.completed[i][c] = completed.WithLabelValues(ep, cl)
		}
		s.latency[i] = latency.WithLabelValues(ep)
		s.fixedErrs[i] = make([]prometheus.Counter, len(SwarmErrorKinds))
		for k, kind := range SwarmErrorKinds {
			s.fixedErrs[i][k] = s.errors.WithLabelValues(ep, kind)
		}
	}
	reg.MustRegister(offered, completed, latency, s.errors, s.active, s.lag)
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return s
}

func endpointIndex(ep string) int {
	for i, e := range SwarmEndpoints[:nEndpoints-1] {
		if e == ep {
			return i
		}
	}
	return nEndpoints - 1
}

// Offered counts one request due at its intended send time.
func (s *Swarm) Offered(endpoint string) { s.offered[endpointIndex(endpoint)].Inc() }

// Completed counts one request answered with status and records its latency
// from the intended send time.
func (s *Swarm) Completed(endpoint string, status int, latency time.Duration) {
	i := endpointIndex(endpoint)
	s.latency[i].Observe(latency.Seconds())
	c := status / 100
	if c < 1 || c > 5 {
		c = 0
	}
	s.completed[i][c].Inc()
}

// Error counts one failed request of an endpoint by kind (see
// SwarmErrorKinds; "http_NNN" for a non-2xx status NNN).
func (s *Swarm) Error(endpoint, kind string) {
	i := endpointIndex(endpoint)
	for k, fk := range SwarmErrorKinds {
		if kind == fk {
			s.fixedErrs[i][k].Inc()
			return
		}
	}
	if len(kind) == 8 && kind[:5] == "http_" {
		if st, err := strconv.Atoi(kind[5:]); err == nil && st >= 100 && st <= 599 {
			key := [2]int{i, st}
			s.mu.Lock()
			c := s.httpErrs[key]
			if c == nil {
				c = s.errors.WithLabelValues(SwarmEndpoints[i], kind)
				s.httpErrs[key] = c
			}
			s.mu.Unlock()
			c.Inc()
			return
		}
	}
	s.fixedErrs[i][len(SwarmErrorKinds)-1].Inc()
}

// SetActive sets the number of kettles running.
func (s *Swarm) SetActive(n int) { s.active.Set(float64(n)) }

// SetLag sets the simulator's dispatch lag.
func (s *Swarm) SetLag(d time.Duration) { s.lag.Set(d.Seconds()) }

// Registry is the registry the metrics are registered on.
func (s *Swarm) Registry() *prometheus.Registry { return s.reg }

// Handler serves the registry in the Prometheus exposition format.
func (s *Swarm) Handler() http.Handler {
	return promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg, ErrorHandling: promhttp.ContinueOnError})
}
