// Package metrics is kettlefleet's Prometheus instrumentation: RED metrics
// per route for kettle serve, the ingest pipeline's saturation (the S of the
// USE method), store and fleet gauges, Go runtime and process collectors, and
// the simulator's client-side view (see Swarm).
//
// Everything registers on a *prometheus.Registry that the caller passes in,
// never on the global one, so two servers in one process (tests, kettle demo)
// do not collide. Every label has a bounded set of values: routes are
// ServeMux pattern templates, never raw paths; device ids never appear.
package metrics

import (
	"context"
	"errors"
	"net/http"
	"regexp"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
)

// ReportingWindow is the window of kettle_devices_reporting (the same five
// minutes the statistics endpoints use).
const ReportingWindow = 5 * time.Minute

// LatencyBuckets are the request and commit duration buckets in seconds. The
// SLO (100 ms) is a bucket boundary so the p99 alert is exact at the SLO.
var LatencyBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// BatchBuckets are the ingest batch size buckets in readings.
var BatchBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}

// Rejection reasons of kettle_ingest_rejected_total. Reasons the fleet
// service reports that are not in this list are counted as "other", so the
// label stays bounded whatever a future caller passes.
var RejectReasons = []string{"queue_full", "shutting_down", "store_error", "log", "clock_skew", "other"}

// StoreErrorKinds are the values of kettle_store_errors_total's kind label
// (see ErrorKind).
var StoreErrorKinds = []string{"timeout", "canceled", "unavailable", "internal", "other"}

// Server holds kettle serve's metrics. Build it with New before the fleet
// service (its hooks go into fleet.New), then register the service, the
// listener and the store once they exist.
type Server struct {
	reg *prometheus.Registry

	duration *prometheus.HistogramVec
	inFlight prometheus.Gauge

	mu        sync.RWMutex
	observers map[routeKey]prometheus.Observer

	batchRows   prometheus.Histogram
	commit      prometheus.Histogram
	stored      prometheus.Counter
	duplicates  prometheus.Counter
	storeErrors *prometheus.CounterVec
	rejected    *prometheus.CounterVec
}

type routeKey struct {
	route, method string
	class         int
}

// New registers the HTTP and ingest metrics and the Go runtime and process
// collectors on reg.
func New(reg *prometheus.Registry) *Server {
	m := &Server{
		reg:       reg,
		observers: make(map[routeKey]prometheus.Observer),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kettle_http_request_duration_seconds",
			Help:    "Time from request headers read to handler return, by route template (ServeMux pattern, \"unmatched\" when none), method and status class (2xx, 4xx, 5xx…). Its _count is the request rate and error rate (RED).",
			Buckets: LatencyBuckets,
		}, []string{"route", "method", "status"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kettle_http_requests_in_flight",
			Help: "HTTP requests being served now, ingest requests waiting for their commit included.",
		}),
		batchRows: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kettle_ingest_batch_rows",
			Help:    "Readings per ingest transaction. Batches grow under load; a batch size stuck at --batch-rows means the store is the bottleneck.",
			Buckets: BatchBuckets,
		}),
		commit: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kettle_ingest_commit_seconds",
			Help:    "Duration of one ingest batch transaction (write, latest state, rollups, commit), failed ones included.",
			Buckets: LatencyBuckets,
		}),
		stored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_ingest_rows_stored_total",
			Help: "Readings stored (committed and acknowledged), duplicates excluded.",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_ingest_duplicates_total",
			Help: "Readings acknowledged as duplicates (same device and device time already stored); stored once, counted once.",
		}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kettle_store_errors_total",
			Help: "Failed ingest transactions by kind (timeout, canceled, unavailable, internal, other). Every reading in a failed batch is refused with 503.",
		}, []string{"kind"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kettle_ingest_rejected_total",
			Help: "Readings refused with 503 + Retry-After, by reason: queue_full (the bounded ingest queue), shutting_down, store_error (their transaction failed), log (the readings log refused), clock_skew (this node's clock is past --max-clock-skew from the database's).",
		}, []string{"reason"}),
	}
	// Pre-create every bounded label value so rates and alerts see a zero
	// series before the first failure instead of no series at all.
	for _, k := range StoreErrorKinds {
		m.storeErrors.WithLabelValues(k)
	}
	for _, r := range RejectReasons {
		m.rejected.WithLabelValues(r)
	}
	reg.MustRegister(m.duration, m.inFlight, m.batchRows, m.commit, m.stored, m.duplicates, m.storeErrors, m.rejected)
	reg.MustRegister(
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/sched/latencies:seconds$`)},
			// go_gc_heap_live_bytes: what the last collection kept. Under
			// --gc-percent 400 RSS may reach 5× it between collections, so
			// kettle report judges "memory kept growing" on this instead.
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)},
		)),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return m
}

// Registry is the registry the metrics are registered on.
func (m *Server) Registry() *prometheus.Registry { return m.reg }

// maxScrapes is how many /metrics requests are answered at once; more get
// 503. /metrics needs no credentials (Prometheus scrapes it), and a scrape
// reads every kettle's slot of the device cache (kettle_devices_reporting;
// under the cache's lock, which the batcher waits for): Prometheus scrapes
// one at a time, and a loop of anonymous requests must not multiply that.
const maxScrapes = 4

// Handler serves the registry in the Prometheus exposition format (mount it
// at GET /metrics).
func (m *Server) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg, ErrorHandling: promhttp.ContinueOnError, MaxRequestsInFlight: maxScrapes})
}

// everySecond returns f memoised for a second: a gauge that walks the
// device cache costs that walk at most once a second however often
// /metrics is asked.
func everySecond(f func() float64) func() float64 {
	var (
		mu   sync.Mutex
		at   time.Time
		last float64
	)
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		if now := time.Now(); now.Sub(at) >= time.Second {
			last, at = f(), now
		}
		return last
	}
}

// ---- HTTP (RED) ----

// Middleware records kettle_http_request_duration_seconds and
// kettle_http_requests_in_flight around next.
//
// The route label is r.Pattern read after next returned: http.ServeMux sets
// Pattern on the very *http.Request it is given before calling the matched
// handler, so it is visible here as long as every layer between this
// middleware and the mux passes the request on unchanged (no r.WithContext or
// r.Clone in between — wrap those inside the mux's routes instead). A request
// no pattern matched is labelled "unmatched"; the label is therefore one of
// the patterns registered in code, never a raw path or a device id.
func (m *Server) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		m.inFlight.Inc()
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			m.inFlight.Dec()
			m.observer(r.Pattern, r.Method, sw.status).Observe(time.Since(start).Seconds())
		}()
		next.ServeHTTP(sw, r)
	})
}

// observer returns the cached histogram child for a route, method and status:
// a map lookup with no allocation on the hot path.
func (m *Server) observer(pattern, method string, status int) prometheus.Observer {
	k := routeKey{route: pattern, method: Method(method), class: status / 100}
	if status == 0 {
		k.class = 2 // nothing written: net/http sends 200
	}
	m.mu.RLock()
	o := m.observers[k]
	m.mu.RUnlock()
	if o != nil {
		return o
	}
	route := k.route
	if route == "" {
		route = "unmatched"
	}
	o = m.duration.WithLabelValues(route, k.method, StatusClass(k.class*100))
	m.mu.Lock()
	m.observers[k] = o
	m.mu.Unlock()
	return o
}

// Method bounds the method label: standard methods as they are, anything a
// client invents as "OTHER".
func Method(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return method
	}
	return "OTHER"
}

// StatusClass is the status label: "2xx" for 200–299 and so on, "other"
// outside 100–599.
func StatusClass(status int) string {
	switch status / 100 {
	case 1:
		return "1xx"
	case 2:
		return "2xx"
	case 3:
		return "3xx"
	case 4:
		return "4xx"
	case 5:
		return "5xx"
	}
	return "other"
}

// statusWriter records the status written.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection (Flush, deadlines).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// ---- ingest ----

// FleetHooks returns the hooks to pass to fleet.New: batch size, commit
// duration, stored and duplicate readings, store errors and refusals.
func (m *Server) FleetHooks() fleet.Hooks {
	return fleet.Hooks{Batch: m.batch, Rejected: m.reject}
}

func (m *Server) batch(rows, dups int, commit time.Duration, err error) {
	m.batchRows.Observe(float64(rows))
	m.commit.Observe(commit.Seconds())
	if err != nil {
		m.storeErrors.WithLabelValues(ErrorKind(err)).Inc()
		m.rejected.WithLabelValues("store_error").Add(float64(rows))
		return
	}
	m.stored.Add(float64(rows - dups))
	m.duplicates.Add(float64(dups))
}

func (m *Server) reject(reason string, rows int) {
	m.rejected.WithLabelValues(bounded(reason, RejectReasons)).Add(float64(rows))
}

// ErrorKind classifies a store error for kettle_store_errors_total: timeout
// (a deadline, e.g. statement_timeout), canceled, else the kettle error code
// (unavailable, internal); anything else is "other".
func ErrorKind(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return bounded(string(kettle.ErrorCode(err)), StoreErrorKinds)
}

func bounded(v string, allowed []string) string {
	for _, a := range allowed {
		if v == a {
			return v
		}
	}
	return "other"
}

// ---- gauges read at scrape time ----

// Fleet is what the fleet gauges read; *fleet.Service implements it.
type Fleet interface {
	QueueLen() int
	Config() fleet.Config
	DeviceCount() int
	ReportingSince(time.Time) int
	Now() time.Time
	RefreshStats() (peers int64, refreshes, beatsFailed uint64)
	ExpiryStats() fleet.ExpiryStats
	Limits() fleet.LimitStats
	Pruned() int64
	PruneErrors() int64
	Lookups() fleet.LookupStats
	ClockSkew() (time.Duration, bool)
}

var _ Fleet = (*fleet.Service)(nil)

const registrationsRefusedHelp = "Device registrations refused: login_rate, a POST /login over --login-rate (429); login_rate_source, a POST /login over --login-rate-per-source (429); registry_full, a POST /login or POST /v1/devices past --max-devices (403)."

var lookupsHelp = "Case-study credentials (servant-auth-cookie) this node did not have in memory, looked up in the store (the primary): found, registered by another node since this node's last cache refresh (answered as usual); unknown, not in the store (401, and remembered for " + fleet.LookupMissTTL.String() + "); error, the store could not say within --store-timeout (503 + Retry-After)."

const rateLimitedHelp = "Requests of kettles over --device-rate: refused (HTTP, answered 429 + Retry-After), or paced (MQTT publishes held until the kettle is within its rate, its connection not read meanwhile)."

// RegisterFleet registers the ingest queue's length and capacity and the
// fleet gauges (devices registered, reporting in the last ReportingWindow),
// read from f at each scrape. Call it once.
func (m *Server) RegisterFleet(f Fleet) {
	m.reg.MustRegister(fleetRegistry(f)...)
	m.reg.MustRegister(fleetLimits(f)...)
	m.reg.MustRegister(fleetUpkeep(f)...)
}

// fleetRegistry: the ingest queue, the registry and its cache.
func fleetRegistry(f Fleet) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_ingest_queue_rows",
			Help: "Readings waiting in the bounded ingest queue for a transaction. Compare with kettle_ingest_queue_capacity_rows: when full, ingest answers 503.",
		}, func() float64 { return float64(f.QueueLen()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_ingest_queue_capacity_rows",
			Help: "Capacity of the ingest queue in readings (--ingest-queue).",
		}, func() float64 { return float64(f.Config().QueueRows) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_devices_registered",
			Help: "Devices registered (statistic 2, from memory).",
		}, func() float64 { return float64(f.DeviceCount()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_devices_reporting",
			Help: "Devices with a reading stored in the last 5 minutes (statistic 2, from memory).",
		}, everySecond(func() float64 { return float64(f.ReportingSince(f.Now().Add(-ReportingWindow))) })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_cache_refresh_peers",
			Help: "Other processes writing the store (kettle serve nodes, kettle seed) at this node's last beat; while there are none the device cache is not refreshed from the store (--cache-refresh). -1: not known (the store is not shared, or the beat failed).",
		}, func() float64 { p, _, _ := f.RefreshStats(); return float64(p) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_cache_refreshes_total",
			Help: "Full reloads of the device cache from the store (--cache-refresh; on PostgreSQL only while another process writes it).",
		}, func() float64 { _, n, _ := f.RefreshStats(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_cache_refresh_beats_failed_total",
			Help: "Cache-refresh beats the store did not answer within --cache-refresh; each is followed by a refresh of the device cache, as if other processes wrote.",
		}, func() float64 { _, _, n := f.RefreshStats(); return float64(n) }),
	}
}

// fleetLimits: the per-kettle and login limits, and the store lookups of
// unknown case-study ids.
func fleetLimits(f Fleet) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_device_rate_limit_per_second",
			Help: "Requests a second one kettle may make (--device-rate, in bursts of --device-burst); 0: no limit.",
		}, func() float64 { return f.Config().DeviceRate }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_device_rate_limited_total",
			Help:        rateLimitedHelp,
			ConstLabels: prometheus.Labels{"kind": "refused"},
		}, func() float64 { return float64(f.Limits().DeviceRefused) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_device_rate_limited_total",
			Help:        rateLimitedHelp,
			ConstLabels: prometheus.Labels{"kind": "paced"},
		}, func() float64 { return float64(f.Limits().DevicePaced) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_registrations_refused_total",
			Help:        registrationsRefusedHelp,
			ConstLabels: prometheus.Labels{"reason": "login_rate"},
		}, func() float64 { return float64(f.Limits().LoginsRefused) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_registrations_refused_total",
			Help:        registrationsRefusedHelp,
			ConstLabels: prometheus.Labels{"reason": "registry_full"},
		}, func() float64 { return float64(f.Limits().RegistryFull) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_registrations_refused_total",
			Help:        registrationsRefusedHelp,
			ConstLabels: prometheus.Labels{"reason": "login_rate_source"},
		}, func() float64 { return float64(f.Limits().SourceRefused) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_login_sources_untracked_total",
			Help: "POST /login requests from a new address not held to --login-rate-per-source because its table was full (65,536 addresses, all within their bursts); --login-rate still applied.",
		}, func() float64 { return float64(f.Limits().SourcesUntracked) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_device_lookups_total",
			Help:        lookupsHelp,
			ConstLabels: prometheus.Labels{"kind": "found"},
		}, func() float64 { return float64(f.Lookups().Found) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_device_lookups_total",
			Help:        lookupsHelp,
			ConstLabels: prometheus.Labels{"kind": "unknown"},
		}, func() float64 { return float64(f.Lookups().Unknown) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kettle_device_lookups_total",
			Help:        lookupsHelp,
			ConstLabels: prometheus.Labels{"kind": "error"},
		}, func() float64 { return float64(f.Lookups().Failed) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_device_lookups_avoided_total",
			Help: "Case-study credentials refused (401) from this node's memory of ids the store did not hold, without a store lookup.",
		}, func() float64 { return float64(f.Lookups().MissHits) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_device_lookup_misses",
			Help: "Ids the store did not hold that this node remembers (for " + fleet.LookupMissTTL.String() + " each); compare with kettle_device_lookup_misses_capacity: when full, the oldest goes.",
		}, func() float64 { return float64(f.Lookups().Misses) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_device_lookup_misses_capacity",
			Help: "Ids the store did not hold that this node remembers at most.",
		}, func() float64 { return float64(f.Lookups().MissesMax) }),
	}
}

// fleetUpkeep: pruning, the clock check and retention.
func fleetUpkeep(f Fleet) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_devices_pruned_total",
			Help: "Devices removed from this node's registry because they never reported (POST /v1/devices/prune here, or found pruned by another node at a cache refresh).",
		}, func() float64 { return float64(f.Pruned()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_prune_unreported_seconds",
			Help: "Devices registered longer ago than this that never reported are pruned every --expire-every (--prune-unreported); 0: only when asked.",
		}, func() float64 { return f.Config().PruneUnreported.Seconds() }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_prune_errors_total",
			Help: "Automatic prunes (--prune-unreported) that failed (the log says why); the next round tries again.",
		}, func() float64 { return float64(f.PruneErrors()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_devices_max",
			Help: "Devices this server registers at most (--max-devices; 0: no bound). Compare with kettle_devices_registered.",
		}, func() float64 { return float64(f.Config().MaxDevices) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_clock_skew_seconds",
			Help: "This node's clock minus the database's (PostgreSQL's clock_timestamp()), measured at start, at every cache-refresh beat and before every expiry; 0 on SQLite, which has no clock but the node's. Past kettle_clock_max_skew_seconds either way the node is not ready, refuses readings (503, reason clock_skew) and expires nothing: synchronise its clock (NTP).",
		}, func() float64 { d, _ := f.ClockSkew(); return d.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_clock_max_skew_seconds",
			Help: "The most this node's clock may be from the database's before it stops serving (--max-clock-skew; negative: not checked).",
		}, func() float64 { return f.Config().MaxClockSkew.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_retention_seconds",
			Help: "How long readings are kept, by device time (--retention); 0: everything is kept.",
		}, func() float64 { return f.Config().Retention.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_expire_every_seconds",
			Help: "How often the retention loop runs (--expire-every).",
		}, func() float64 { return f.Config().ExpireEvery.Seconds() }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_expire_runs_total",
			Help: "Runs of the retention loop (every --expire-every with --retention).",
		}, func() float64 { return float64(f.ExpiryStats().Runs) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_expire_errors_total",
			Help: "Runs of the retention loop that failed or left a partition for the next run (the log says why).",
		}, func() float64 { return float64(f.ExpiryStats().Errors) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_expired_measurements_total",
			Help: "Readings removed by the retention loop since start.",
		}, func() float64 { return float64(f.ExpiryStats().Removed) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_expire_last_duration_seconds",
			Help: "How long the last run of the retention loop took (writers wait only for its last step; see docs/reliability.md).",
		}, func() float64 { return f.ExpiryStats().LastDuration.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_expire_last_success_timestamp_seconds",
			Help: "Unix time the retention loop last succeeded; 0: not yet. Alert when it lags --expire-every by much: the store keeps growing.",
		}, func() float64 {
			t := f.ExpiryStats().LastSuccess
			if t.IsZero() {
				return 0
			}
			return float64(t.UnixNano()) / 1e9
		}),
	}
}

// Conns is the server's connection-limiting listener.
type Conns interface {
	Active() int64
	Refused() int64
}

// RegisterConns registers the open and refused connection counts of the
// server's listener. Call it once.
func (m *Server) RegisterConns(l Conns) {
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_http_connections_open",
			Help: "Open HTTP connections (capped by --max-conns).",
		}, func() float64 { return float64(l.Active()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_http_connections_refused_total",
			Help: "Connections over --max-conns, answered 503 and closed at once.",
		}, func() float64 { return float64(l.Refused()) }),
	)
}

// TLS is the server's certificate in force (internal/tlscert.Reloader).
type TLS interface {
	NotAfter() time.Time
	Reloads() int64
	Failures() int64
}

// RegisterTLS registers the certificate's expiry and its reloads, and the
// failed handshakes handshakeErrors counts. Call it once, only when the
// server speaks TLS.
func (m *Server) RegisterTLS(t TLS, handshakeErrors func() int64) {
	m.reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_tls_handshake_errors_total",
			Help: "TLS handshakes that failed, HTTP and MQTT (a client that distrusts the certificate, plain HTTP or MQTT sent to the TLS port, a TCP probe that closes at once); counted, not logged (debug level logs each).",
		}, func() float64 { return float64(handshakeErrors()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_tls_certificate_expiry_timestamp_seconds",
			Help: "When the TLS certificate in force expires (its NotAfter, Unix seconds); alert KettleTLSCertificateExpiring.",
		}, func() float64 { return float64(t.NotAfter().UnixNano()) / 1e9 }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_tls_certificate_reloads_total",
			Help: "Renewed certificate files loaded without a restart.",
		}, func() float64 { return float64(t.Reloads()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_tls_certificate_reload_errors_total",
			Help: "Changed certificate files that did not load (the previous pair stays in force; the log says why).",
		}, func() float64 { return float64(t.Failures()) }),
	)
}

// RegisterRotation exposes the credentials being retired: whether a
// previous operator token and device secret are accepted, and how often
// each was used.
func (m *Server) RegisterRotation(previousOperator, previousSecret bool, operatorUses, deviceUses func() int64, devicesOnPrevious func() int) {
	const usedHelp = "Requests (an MQTT connection, a dashboard sign-in) authenticated with a credential being retired: operator, --operator-token-previous; device, a device token of --secret-previous. Remove the flag once this stops rising."
	const acceptedHelp = "1 while a credential being retired is accepted beside the one in force (--operator-token-previous, --secret-previous)."
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	m.reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kettle_previous_credentials_used_total", Help: usedHelp, ConstLabels: prometheus.Labels{"kind": "operator"}},
			func() float64 { return float64(operatorUses()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kettle_previous_credentials_used_total", Help: usedHelp, ConstLabels: prometheus.Labels{"kind": "device"}},
			func() float64 { return float64(deviceUses()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kettle_previous_credentials_accepted", Help: acceptedHelp, ConstLabels: prometheus.Labels{"kind": "operator"}},
			func() float64 { return b(previousOperator) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kettle_previous_credentials_accepted", Help: acceptedHelp, ConstLabels: prometheus.Labels{"kind": "device"}},
			func() float64 { return b(previousSecret) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kettle_devices_on_previous_secret", Help: "Devices that used a token of --secret-previous in the last 10 minutes (a kettle polls every 30 s): kettles still to re-provision. Remove --secret-previous once it is 0 on every node."},
			func() float64 { return float64(devicesOnPrevious()) }),
	)
}

// BusyRetrier is implemented by the SQLite store.
type BusyRetrier interface{ BusyRetries() uint64 }

// StagedMerger is implemented by the SQLite store: its staging table (rows
// staged now) and the merges that empty it into measurements.
type StagedMerger interface {
	MergeStats() (staged int64, merges, errors uint64, seconds float64)
}

// WriteRetrier is implemented by the PostgreSQL store: write transactions
// run again after a deadlock or serialization failure (conflict), or after
// a measurement partition was found dropped (partition).
type WriteRetrier interface {
	ConflictRetries() uint64
	PartitionRetries() uint64
}

// RegisterStore registers what the store exposes: SQLite's busy retries when
// store implements BusyRetrier, its staging table when it implements
// StagedMerger, PostgreSQL's write retries when it implements WriteRetrier.
// (PostgreSQL's pool: RegisterPool.) Call it once; a store with nothing to
// expose registers nothing.
func (m *Server) RegisterStore(store any) {
	if sm, ok := store.(StagedMerger); ok {
		stat := func(f func(staged int64, merges, errs uint64, secs float64) float64) func() float64 {
			return func() float64 { return f(sm.MergeStats()) }
		}
		m.reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kettle_sqlite_staged_rows",
				Help: "Measurements committed to the staging table and not yet merged into measurements (a merge starts at 65,536).",
			}, stat(func(st int64, _, _ uint64, _ float64) float64 { return float64(st) })),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kettle_sqlite_merges_total",
				Help: "Merges of a bucket of the staging table (1/64 of it) into measurements committed.",
			}, stat(func(_ int64, n, _ uint64, _ float64) float64 { return float64(n) })),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kettle_sqlite_merge_errors_total",
				Help: "Merges that failed (the rows stay staged and readable; the merge is retried). Rising: see the log.",
			}, stat(func(_ int64, _, e uint64, _ float64) float64 { return float64(e) })),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kettle_sqlite_merge_seconds_total",
				Help: "Time spent merging, during which ingest batches wait for the writer.",
			}, stat(func(_ int64, _, _ uint64, s float64) float64 { return s })),
		)
	}
	if r, ok := store.(WriteRetrier); ok {
		const help = "PostgreSQL write transactions run again, by reason: conflict (deadlock or serialization failure: kettle's writers lock in one order, so another client of the database locks the same rows in another; the server log's deadlock DETAIL names the statements), partition (a measurement partition was dropped behind the store's back and re-created)."
		m.reg.MustRegister(
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kettle_pg_write_retries_total", Help: help,
				ConstLabels: prometheus.Labels{"reason": "conflict"}}, func() float64 { return float64(r.ConflictRetries()) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kettle_pg_write_retries_total", Help: help,
				ConstLabels: prometheus.Labels{"reason": "partition"}}, func() float64 { return float64(r.PartitionRetries()) }),
		)
	}
	if b, ok := store.(BusyRetrier); ok {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kettle_sqlite_busy_retries_total",
			Help: "Times a SQLite transaction found the database locked (SQLITE_BUSY) and was retried. Rising: another process writes the file, or the writer is saturated.",
		}, func() float64 { return float64(b.BusyRetries()) }))
	}
}

// PoolStats is a snapshot of the PostgreSQL connection pool. Its fields are
// those of postgres.PoolStats, in the same order, so the server converts one
// into the other: metrics.PoolStats(pg.PoolStats()). (This package does not
// import postgres and its driver.)
type PoolStats struct {
	MaxConns             int32
	TotalConns           int32
	AcquiredConns        int32
	IdleConns            int32
	AcquireCount         int64
	EmptyAcquireCount    int64
	AcquireDuration      time.Duration
	CanceledAcquireCount int64
}

// RegisterPool registers the PostgreSQL pool metrics, read from stats once per
// scrape (one consistent snapshot). Call it once.
func (m *Server) RegisterPool(stats func() PoolStats) {
	m.reg.MustRegister(&poolCollector{stats: stats})
}

var (
	poolMax      = prometheus.NewDesc("kettle_pg_pool_max_conns", "PostgreSQL pool capacity (--pg-pool).", nil, nil)
	poolTotal    = prometheus.NewDesc("kettle_pg_pool_total_conns", "Open PostgreSQL connections.", nil, nil)
	poolAcquired = prometheus.NewDesc("kettle_pg_pool_acquired_conns", "PostgreSQL connections in use.", nil, nil)
	poolIdle     = prometheus.NewDesc("kettle_pg_pool_idle_conns", "PostgreSQL connections open and free.", nil, nil)
	poolAcquires = prometheus.NewDesc("kettle_pg_pool_acquires_total", "Successful connection acquires from the PostgreSQL pool.", nil, nil)
	poolEmpty    = prometheus.NewDesc("kettle_pg_pool_empty_acquires_total", "Acquires that found no idle connection and had to wait: the pool, not the database, is the bottleneck when this climbs with the wait.", nil, nil)
	poolWait     = prometheus.NewDesc("kettle_pg_pool_acquire_wait_seconds_total", "Total time spent waiting for a PostgreSQL connection; rate() of it is the average number of requests waiting.", nil, nil)
	poolCanceled = prometheus.NewDesc("kettle_pg_pool_canceled_acquires_total", "Acquires given up by their context while waiting for a connection.", nil, nil)
)

type poolCollector struct{ stats func() PoolStats }

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{poolMax, poolTotal, poolAcquired, poolIdle, poolAcquires, poolEmpty, poolWait, poolCanceled} {
		ch <- d
	}
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	g := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	n := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v)
	}
	g(poolMax, float64(s.MaxConns))
	g(poolTotal, float64(s.TotalConns))
	g(poolAcquired, float64(s.AcquiredConns))
	g(poolIdle, float64(s.IdleConns))
	n(poolAcquires, float64(s.AcquireCount))
	n(poolEmpty, float64(s.EmptyAcquireCount))
	n(poolWait, s.AcquireDuration.Seconds())
	n(poolCanceled, float64(s.CanceledAcquireCount))
}

// PGMaintenance is the PostgreSQL server's periodic work; its fields are
// those of postgres.Maintenance, in the same order.
type PGMaintenance struct {
	CheckpointsTimed, CheckpointsRequested int64
	CheckpointBuffers                      int64
	WALBytes                               int64
	WALFullPageImages                      int64
	CheckpointTimeout                      time.Duration
	Segment, SegmentsReady                 int64
	SegmentsKnown                          bool
}

// RegisterPGMaintenance registers the database server's checkpoint and WAL
// counters, read by stats (one query, bounded by a 2 s deadline) once per
// scrape; a scrape whose query fails leaves them out. Call it once.
func (m *Server) RegisterPGMaintenance(stats func(context.Context) (PGMaintenance, error)) {
	m.reg.MustRegister(&pgMaintCollector{stats: stats})
}

var (
	pgCheckpoints = prometheus.NewDesc("kettle_pg_checkpoints_total", "PostgreSQL checkpoints since its statistics were reset (the whole server, not only kettle's database), counted as each begins, by what started it: timed (checkpoint_timeout) or requested (WAL reached max_wal_size, a CHECKPOINT command, a restart).", []string{"kind"}, nil)
	pgCPBuffers   = prometheus.NewDesc("kettle_pg_checkpoint_buffers_written_total", "Buffers PostgreSQL's checkpoints wrote, counted as they go: it rises through a checkpoint's write phase and stops for its sync phase.", nil, nil)
	pgWALBytes    = prometheus.NewDesc("kettle_pg_wal_bytes_total", "WAL PostgreSQL generated, bytes.", nil, nil)
	pgWALFPI      = prometheus.NewDesc("kettle_pg_wal_full_page_images_total", "Full-page images in PostgreSQL's WAL: every page first written after a checkpoint goes in whole, so they follow checkpoints.", nil, nil)
	pgCPTimeout   = prometheus.NewDesc("kettle_pg_checkpoint_timeout_seconds", "PostgreSQL's checkpoint_timeout: a benchmark shorter than this may hold no checkpoint.", nil, nil)
	pgWALSegment  = prometheus.NewDesc("kettle_pg_wal_segment", "Number of the WAL segment file PostgreSQL writes (counted from the first of its WAL): it steps once per wal_segment_size (16 MiB) of WAL. Absent when the role may not list pg_wal (grant pg_monitor).", nil, nil)
	pgWALReady    = prometheus.NewDesc("kettle_pg_wal_segments_ready", "WAL segment files waiting in pg_wal after the one being written (recycled by checkpoints). At 0, each segment switch creates a new file and zero-fills it (wal_init_zero) while commits wait: raise min_wal_size. Absent when the role may not list pg_wal (grant pg_monitor).", nil, nil)
)

type pgMaintCollector struct {
	stats func(context.Context) (PGMaintenance, error)
}

func (c *pgMaintCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{pgCheckpoints, pgCPBuffers, pgWALBytes, pgWALFPI, pgCPTimeout, pgWALSegment, pgWALReady} {
		ch <- d
	}
}

func (c *pgMaintCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := c.stats(ctx)
	if err != nil {
		return
	}
	n := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	n(pgCheckpoints, s.CheckpointsTimed, "timed")
	n(pgCheckpoints, s.CheckpointsRequested, "requested")
	n(pgCPBuffers, s.CheckpointBuffers)
	n(pgWALBytes, s.WALBytes)
	n(pgWALFPI, s.WALFullPageImages)
	ch <- prometheus.MustNewConstMetric(pgCPTimeout, prometheus.GaugeValue, s.CheckpointTimeout.Seconds())
	if s.SegmentsKnown {
		ch <- prometheus.MustNewConstMetric(pgWALSegment, prometheus.GaugeValue, float64(s.Segment))
		ch <- prometheus.MustNewConstMetric(pgWALReady, prometheus.GaugeValue, float64(s.SegmentsReady))
	}
}

// MQTTStats is a snapshot of the MQTT adapter's counters; its fields are
// those of mqttapi.Stats, in the same order, so the server converts one into
// the other (this package does not import the broker).
type MQTTStats struct {
	Connections, ConnectsRefused int64
	Publishes                    [3]int64
	Readings, Invalid, ACLDenied int64
	Withheld, Dropped, Unacked   int64
	CommandsPushed               int64
	CommandsDropped              int64
	Malformed                    int64
	Shed                         [3]int64 // by MQTTShedReasons
	MaxConns                     int64
}

// MQTTShedReasons label MQTTStats.Shed, in order.
var MQTTShedReasons = [3]string{"quota_exceeded", "server_busy", "use_another_server"}

// RegisterMQTT registers the MQTT metrics, read from stats once per scrape.
// Call it once, when MQTT is on.
func (m *Server) RegisterMQTT(stats func() MQTTStats) {
	m.reg.MustRegister(&mqttCollector{stats: stats})
}

var (
	mqttConns     = prometheus.NewDesc("kettle_mqtt_connections", "Open MQTT device connections (external-broker mode: 1 while connected to the broker).", nil, nil)
	mqttRefused   = prometheus.NewDesc("kettle_mqtt_connects_refused_total", "MQTT CONNECTs refused: bad credentials or a client id that is not the device's.", nil, nil)
	mqttPublishes = prometheus.NewDesc("kettle_mqtt_publishes_total", "Measurement PUBLISHes received, by QoS.", []string{"qos"}, nil)
	mqttReadings  = prometheus.NewDesc("kettle_mqtt_readings_total", "Readings from MQTT committed (stored or duplicate).", nil, nil)
	mqttInvalid   = prometheus.NewDesc("kettle_mqtt_invalid_total", "MQTT payloads refused by validation (0x99 on MQTT 5, dropped and counted on 3.1.1).", nil, nil)
	mqttACL       = prometheus.NewDesc("kettle_mqtt_acl_denied_total", "Publishes or subscriptions outside the device's own topics.", nil, nil)
	mqttWithheld  = prometheus.NewDesc("kettle_mqtt_puback_withheld_total", "QoS 1 messages whose PUBACK was held back because ingest was unavailable (queue full, store down).", nil, nil)
	mqttDropped   = prometheus.NewDesc("kettle_mqtt_qos0_dropped_total", "QoS 0 messages dropped because ingest was unavailable.", nil, nil)
	mqttUnacked   = prometheus.NewDesc("kettle_mqtt_unacked_total", "QoS 1 messages given up without PUBACK (client gone or shutdown); the client redelivers.", nil, nil)
	mqttCommands  = prometheus.NewDesc("kettle_mqtt_commands_pushed_total", "Command messages published to kettles (on subscribe and on change).", nil, nil)
	mqttMalformed = prometheus.NewDesc("kettle_mqtt_malformed_total", "MQTT connections closed because a malformed packet crashed the packet decoder (contained to the connection).", nil, nil)
	mqttCmdDrop   = prometheus.NewDesc("kettle_mqtt_commands_dropped_total", "Command pushes whose write failed (the kettle stopped reading past --mqtt-write-timeout, or its connection ended); it gets the current command when it subscribes again.", nil, nil)
	mqttShed      = prometheus.NewDesc("kettle_mqtt_connects_shed_total", "MQTT CONNECTs refused for capacity, by the reason an MQTT 5 kettle is told: quota_exceeded (over --mqtt-max-conns), server_busy (shedding load), use_another_server (either, with --mqtt-server-reference); MQTT 3.1.1 kettles get 0x03 for each.", []string{"reason"}, nil)
	mqttMaxConns  = prometheus.NewDesc("kettle_mqtt_connections_max", "MQTT device connections this node accepts (--mqtt-max-conns); beyond it CONNECTs are refused with a reason.", nil, nil)
)

type mqttCollector struct{ stats func() MQTTStats }

func (c *mqttCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{mqttConns, mqttRefused, mqttPublishes, mqttReadings, mqttInvalid, mqttACL, mqttWithheld, mqttDropped, mqttUnacked, mqttCommands, mqttCmdDrop, mqttMalformed, mqttShed, mqttMaxConns} {
		ch <- d
	}
}

func (c *mqttCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	n := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	ch <- prometheus.MustNewConstMetric(mqttConns, prometheus.GaugeValue, float64(s.Connections))
	n(mqttRefused, s.ConnectsRefused)
	for q, v := range s.Publishes {
		n(mqttPublishes, v, string(rune('0'+q)))
	}
	n(mqttReadings, s.Readings)
	n(mqttInvalid, s.Invalid)
	n(mqttACL, s.ACLDenied)
	n(mqttWithheld, s.Withheld)
	n(mqttDropped, s.Dropped)
	n(mqttUnacked, s.Unacked)
	n(mqttCommands, s.CommandsPushed)
	n(mqttCmdDrop, s.CommandsDropped)
	n(mqttMalformed, s.Malformed)
	for i, v := range s.Shed {
		n(mqttShed, v, MQTTShedReasons[i])
	}
	if s.MaxConns > 0 {
		ch <- prometheus.MustNewConstMetric(mqttMaxConns, prometheus.GaugeValue, float64(s.MaxConns))
	}
}

// ReplicaStats describe the read replica (kettle serve --db-read); its fields
// are those of postgres.ReplicaStats, in the same order.
type ReplicaStats struct {
	Configured          bool
	LagSeconds          float64
	MaxLagSeconds       float64
	Reads, PrimaryReads uint64
}

// RegisterReplica registers the read replica's lag and how many reads it
// took (with --db-read).
func (m *Server) RegisterReplica(stats func() ReplicaStats) {
	m.reg.MustRegister(&replicaCollector{stats: stats})
}

var (
	replicaLag    = prometheus.NewDesc("kettle_pg_read_replica_lag_seconds", "Replay lag of the --db-read replica, measured every second (0: it has replayed all it received); NaN while it cannot be measured (unreachable, not streaming), when its reads go to the primary.", nil, nil)
	replicaMaxLag = prometheus.NewDesc("kettle_pg_read_replica_max_lag_seconds", "--max-read-lag: over it the replica's reads go to the primary.", nil, nil)
	replicaReads  = prometheus.NewDesc("kettle_pg_read_replica_reads_total", "Reads that tolerate lag, by where they went: replica, or primary (the replica's lag over --max-read-lag or unknown).", []string{"target"}, nil)
)

type replicaCollector struct{ stats func() ReplicaStats }

func (c *replicaCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- replicaLag
	ch <- replicaMaxLag
	ch <- replicaReads
}

func (c *replicaCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	ch <- prometheus.MustNewConstMetric(replicaLag, prometheus.GaugeValue, s.LagSeconds)
	ch <- prometheus.MustNewConstMetric(replicaMaxLag, prometheus.GaugeValue, s.MaxLagSeconds)
	ch <- prometheus.MustNewConstMetric(replicaReads, prometheus.CounterValue, float64(s.Reads), "replica")
	ch <- prometheus.MustNewConstMetric(replicaReads, prometheus.CounterValue, float64(s.PrimaryReads), "primary")
}
