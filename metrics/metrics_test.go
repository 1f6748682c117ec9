package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/metrics/metricstest"
)

// traffic starts an instrumented server, registers devices and sends two
// rounds of every kind of request, recorded on a Swarm too.
func traffic(t *testing.T) (*metricstest.Kettle, *metrics.Swarm, *metricstest.Client) {
	t.Helper()
	const queue = 64
	k := metricstest.Start(t, queue)
	sw := metrics.NewSwarm(prometheus.NewRegistry())
	c := &metricstest.Client{Base: k.URL, Swarm: sw, HTTP: &http.Client{Timeout: 10 * time.Second}}
	if err := c.Register(5); err != nil {
		t.Fatal(err)
	}
	sw.SetActive(len(c.Devices))
	sw.SetLag(3 * time.Millisecond)
	for range 2 {
		seen := c.Round(queue)
		for _, want := range []string{"measurement 200", "command 200", "device 200", "statistics 200", "notfound 404", "invalid 400", "login 200", "v0command 200", "overflow 503"} {
			if seen[want] == 0 {
				t.Fatalf("traffic: no %q; saw %v", want, seen)
			}
		}
	}
	// An invented method and a raw path no route matches.
	c.Do("other", "BREW", "/teapot/"+c.Devices[0].String(), "", nil)
	return k, sw, c
}

func gather(t *testing.T, g prometheus.Gatherer) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func labelValues(mf *dto.MetricFamily, name string) map[string]bool {
	out := map[string]bool{}
	if mf == nil {
		return out
	}
	for _, m := range mf.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == name {
				out[l.GetValue()] = true
			}
		}
	}
	return out
}

func TestRouteLabelIsTemplate(t *testing.T) {
	k, _, c := traffic(t)
	mfs := gather(t, k.Metrics.Registry())
	routes := labelValues(mfs["kettle_http_request_duration_seconds"], "route")
	for _, want := range []string{
		"GET /v1/devices/{id}", "POST /v1/measurements", "GET /v1/command", "POST /v1/devices",
		"GET /v1/statistics", "POST /login", "GET /command", "/",
	} {
		if !routes[want] {
			t.Errorf("route %q missing; routes: %v", want, routes)
		}
	}
	for r := range routes {
		for _, id := range c.Devices {
			if strings.Contains(r, id.String()) {
				t.Errorf("route label %q carries a device id", r)
			}
		}
		if strings.Contains(r, "teapot") || strings.Contains(r, "nope") {
			t.Errorf("route label %q is a raw path", r)
		}
	}
	methods := labelValues(mfs["kettle_http_request_duration_seconds"], "method")
	if !methods["OTHER"] || methods["BREW"] {
		t.Errorf("invented method not bounded: %v", methods)
	}
	status := labelValues(mfs["kettle_http_request_duration_seconds"], "status")
	for _, want := range []string{"2xx", "4xx", "5xx"} {
		if !status[want] {
			t.Errorf("status class %s missing: %v", want, status)
		}
	}
}

// TestRouteThroughWrappers checks the route survives what kettle serve puts
// between the middleware and the mux (a status-recording writer like the
// access log's), and documents what loses it: a layer that replaces the
// request (r.WithContext) hides the mux's Pattern, which then counts as
// "unmatched" — still bounded, but no longer useful.
func TestRouteThroughWrappers(t *testing.T) {
	f := func(wrap func(http.Handler) http.Handler, wantRoute string) {
		t.Helper()
		m := metrics.New(prometheus.NewRegistry())
		mux := http.NewServeMux()
		mux.HandleFunc("GET /v1/devices/{id}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) })
		srv := httptest.NewServer(m.Middleware(wrap(mux)))
		defer srv.Close()
		resp, err := http.Get(srv.URL + "/v1/devices/0b5c1a43-4f3e-4f1d-9d5b-0e8b0c3f6a11")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		got := labelValues(gather(t, m.Registry())["kettle_http_request_duration_seconds"], "route")
		if !got[wantRoute] || len(got) != 1 {
			t.Errorf("routes %v, want only %q", got, wantRoute)
		}
	}
	f(func(h http.Handler) http.Handler { return h }, "GET /v1/devices/{id}")
	f(func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h.ServeHTTP(&struct{ http.ResponseWriter }{w}, r)
		})
	}, "GET /v1/devices/{id}")
	f(func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), struct{}{}, 1)))
		})
	}, "unmatched")
}

// allowedLabels is every label name a kettlefleet metric may carry, each with
// a bounded set of values.
var allowedLabels = map[string]bool{
	"route": true, "method": true, "status": true, // HTTP RED
	"reason": true, "kind": true, // refusals, store and swarm errors
	"endpoint": true,                                    // swarm
	"le":       true, "quantile": true, "version": true, // histograms, summaries, go_info
	"cause": true, // promhttp_metric_handler_errors_total: encoding, gathering
}

var (
	uuidRE  = regexp.MustCompile(`(?i)[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}`)
	routeRE = regexp.MustCompile(`^(?:[A-Z]+ )?/(?:[a-z][a-z0-9_.-]*|\{[a-z_]+\.{0,3}\})?(?:/(?:[a-z][a-z0-9_.-]*|\{[a-z_]+\.{0,3}\}))*/?$`)
	// maxSeries bounds each family's series: a label gone unbounded under
	// real traffic shows up here before it shows up in Prometheus' memory.
	maxSeries = 300
)

var longNumber = regexp.MustCompile(`\d{4,}`)

// unbounded lists every label outside allowedLabels, every value that looks
// like an id (a UUID, a long number), every route label that is not a
// pattern template, and every family over maxSeries series.
func unbounded(mfs map[string]*dto.MetricFamily) []string {
	var out []string
	for name, mf := range mfs {
		if len(mf.GetMetric()) > maxSeries {
			out = append(out, fmt.Sprintf("%s: %d series (> %d): a label is unbounded", name, len(mf.GetMetric()), maxSeries))
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				ln, v := l.GetName(), l.GetValue()
				switch {
				case !allowedLabels[ln]:
					out = append(out, fmt.Sprintf("%s: label %q not in the allow-list (value %q)", name, ln, v))
				case uuidRE.MatchString(v):
					out = append(out, fmt.Sprintf("%s: label %s=%q carries an id", name, ln, v))
				case len(v) > 64:
					out = append(out, fmt.Sprintf("%s: label %s=%q longer than 64", name, ln, v))
				case longNumber.MatchString(v) && ln != "le" && ln != "quantile" && ln != "version":
					out = append(out, fmt.Sprintf("%s: label %s=%q carries a number", name, ln, v))
				case ln == "route" && v != "unmatched" && !routeRE.MatchString(v):
					out = append(out, fmt.Sprintf("%s: route %q is not a route template", name, v))
				}
			}
		}
	}
	return out
}

func checkBounded(t *testing.T, mfs map[string]*dto.MetricFamily) {
	t.Helper()
	for _, p := range unbounded(mfs) {
		t.Error(p)
	}
}

func TestLabelsBounded(t *testing.T) {
	k, sw, _ := traffic(t)
	checkBounded(t, gather(t, k.Metrics.Registry()))
	checkBounded(t, gather(t, sw.Registry()))

	// The checker itself catches what it is meant to catch.
	bad := prometheus.NewRegistry()
	v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "bad_total", Help: "x"}, []string{"route", "device"})
	v.WithLabelValues("GET /v1/devices/0b5c1a43-4f3e-4f1d-9d5b-0e8b0c3f6a11", "x").Inc()
	v.WithLabelValues("/v1/devices/12345", "y").Inc()
	bad.MustRegister(v)
	if got := unbounded(gather(t, bad)); len(got) < 4 {
		t.Errorf("checker missed unbounded labels; found only %q", got)
	}
}

// TestNamesAndHelp lints every family (promlint: units, _total on counters,
// no camel case) and requires a doc string on every metric.
func TestNamesAndHelp(t *testing.T) {
	k, sw, _ := traffic(t)
	for _, g := range []prometheus.Gatherer{k.Metrics.Registry(), sw.Registry()} {
		mfs, err := g.Gather()
		if err != nil {
			t.Fatal(err)
		}
		problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range problems {
			if strings.HasPrefix(p.Metric, "kettle_") {
				t.Errorf("lint %s: %s", p.Metric, p.Text)
			}
		}
		for _, mf := range mfs {
			if strings.TrimSpace(mf.GetHelp()) == "" {
				t.Errorf("%s has no help text", mf.GetName())
			}
			n := mf.GetName()
			if !strings.HasPrefix(n, "kettle_") {
				continue
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				if !strings.HasSuffix(n, "_total") {
					t.Errorf("counter %s does not end in _total", n)
				}
			case dto.MetricType_HISTOGRAM:
				if !strings.HasSuffix(n, "_seconds") && !strings.HasSuffix(n, "_rows") && !strings.HasSuffix(n, "_bytes") {
					t.Errorf("histogram %s has no unit suffix", n)
				}
			}
		}
	}
}

func value(t *testing.T, mfs map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	mf := mfs[name]
	if mf == nil {
		t.Fatalf("no metric %s", name)
	}
next:
	for _, m := range mf.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		case m.Summary != nil:
			return float64(m.Summary.GetSampleCount())
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

func TestServerMetricsAfterTraffic(t *testing.T) {
	k, _, c := traffic(t)
	mfs := gather(t, k.Metrics.Registry())
	f := func(name string, min float64, labels ...string) {
		t.Helper()
		if v := value(t, mfs, name, labels...); v < min {
			t.Errorf("%s%v = %v, want ≥ %v", name, labels, v, min)
		}
	}
	n := float64(len(c.Devices))
	f("kettle_ingest_rows_stored_total", 2*n)
	f("kettle_ingest_batch_rows", 1)
	f("kettle_ingest_commit_seconds", 1)
	f("kettle_ingest_rejected_total", 2*65, "reason", "queue_full")
	f("kettle_ingest_queue_capacity_rows", 64)
	f("kettle_devices_registered", n)
	f("kettle_devices_reporting", n)
	f("kettle_http_connections_open", 1)
	f("kettle_http_request_duration_seconds", 2*n, "route", "POST /v1/measurements", "status", "2xx")
	f("kettle_http_request_duration_seconds", 2, "route", "POST /v1/measurements", "status", "5xx")
	f("kettle_sqlite_busy_retries_total", 0)
	f("kettle_store_errors_total", 0, "kind", "unavailable")
	f("go_goroutines", 1)
	f("go_gc_duration_seconds", 0)
	f("process_open_fds", 1)
	if v := value(t, mfs, "kettle_http_requests_in_flight"); v != 1 && v != 0 {
		t.Errorf("in flight = %v after traffic", v) // 1: a scrape over HTTP counts itself
	}
	// /metrics over the wire.
	resp, err := http.Get(k.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), "kettle_ingest_queue_rows ") {
		t.Fatalf("GET /metrics: %d\n%.500s", resp.StatusCode, b)
	}
}

func TestFleetHooks(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	h := m.FleetHooks()
	h.Batch(10, 3, 5*time.Millisecond, nil)
	h.Batch(4, 0, time.Second, &kettle.Error{Code: kettle.EUnavailable, Message: "store unavailable"})
	h.Batch(2, 0, time.Second, fmt.Errorf("write: %w", context.DeadlineExceeded))
	h.Batch(2, 0, time.Second, errors.New("disk I/O error"))
	h.Rejected("queue_full", 7)
	h.Rejected("a reason nobody planned", 1)
	mfs := gather(t, m.Registry())
	f := func(name string, want float64, labels ...string) {
		t.Helper()
		if v := value(t, mfs, name, labels...); v != want {
			t.Errorf("%s%v = %v, want %v", name, labels, v, want)
		}
	}
	f("kettle_ingest_rows_stored_total", 7)
	f("kettle_ingest_duplicates_total", 3)
	f("kettle_ingest_batch_rows", 4)
	f("kettle_ingest_commit_seconds", 4)
	f("kettle_store_errors_total", 1, "kind", "unavailable")
	f("kettle_store_errors_total", 1, "kind", "timeout")
	f("kettle_store_errors_total", 1, "kind", "internal")
	f("kettle_store_errors_total", 0, "kind", "canceled")
	f("kettle_ingest_rejected_total", 8, "reason", "store_error")
	f("kettle_ingest_rejected_total", 7, "reason", "queue_full")
	f("kettle_ingest_rejected_total", 1, "reason", "other")
	f("kettle_ingest_rejected_total", 0, "reason", "shutting_down")
}

type conns struct{}

func (conns) Active() int64  { return 3 }
func (conns) Refused() int64 { return 9 }

type busy struct{}

func (busy) BusyRetries() uint64 { return 4 }

type retrier struct{}

func (retrier) ConflictRetries() uint64  { return 2 }
func (retrier) PartitionRetries() uint64 { return 1 }

func TestStoreAndListenerGauges(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	m.RegisterConns(conns{})
	m.RegisterStore(busy{})
	m.RegisterPool(func() metrics.PoolStats {
		return metrics.PoolStats{MaxConns: 8, TotalConns: 5, AcquiredConns: 2, IdleConns: 3, AcquireCount: 100, EmptyAcquireCount: 7, AcquireDuration: 1500 * time.Millisecond, CanceledAcquireCount: 1}
	})
	mfs := gather(t, m.Registry())
	f := func(name string, want float64) {
		t.Helper()
		if v := value(t, mfs, name); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	f("kettle_http_connections_open", 3)
	f("kettle_http_connections_refused_total", 9)
	f("kettle_sqlite_busy_retries_total", 4)
	f("kettle_pg_pool_max_conns", 8)
	f("kettle_pg_pool_total_conns", 5)
	f("kettle_pg_pool_acquired_conns", 2)
	f("kettle_pg_pool_idle_conns", 3)
	f("kettle_pg_pool_acquires_total", 100)
	f("kettle_pg_pool_empty_acquires_total", 7)
	f("kettle_pg_pool_acquire_wait_seconds_total", 1.5)
	f("kettle_pg_pool_canceled_acquires_total", 1)

	// The database server's periodic work; a scrape whose query fails
	// leaves it out rather than failing the scrape.
	mp := metrics.New(prometheus.NewRegistry())
	fail := false
	segKnown := true
	mp.RegisterPGMaintenance(func(context.Context) (metrics.PGMaintenance, error) {
		if fail {
			return metrics.PGMaintenance{}, errors.New("database down")
		}
		return metrics.PGMaintenance{CheckpointsTimed: 3, CheckpointsRequested: 2, CheckpointBuffers: 4096, WALBytes: 1 << 30, WALFullPageImages: 77, CheckpointTimeout: 30 * time.Minute,
			Segment: 513, SegmentsReady: 4, SegmentsKnown: segKnown}, nil
	})
	mfsp := gather(t, mp.Registry())
	for kind, want := range map[string]float64{"timed": 3, "requested": 2} {
		if v := value(t, mfsp, "kettle_pg_checkpoints_total", "kind", kind); v != want {
			t.Errorf("kettle_pg_checkpoints_total{kind=%q} = %v, want %v", kind, v, want)
		}
	}
	for name, want := range map[string]float64{"kettle_pg_checkpoint_buffers_written_total": 4096,
		"kettle_pg_wal_bytes_total": 1 << 30, "kettle_pg_wal_full_page_images_total": 77, "kettle_pg_checkpoint_timeout_seconds": 1800,
		"kettle_pg_wal_segment": 513, "kettle_pg_wal_segments_ready": 4} {
		if v := value(t, mfsp, name); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	segKnown = false // a role that may not list pg_wal
	mfsp = gather(t, mp.Registry())
	if _, ok := mfsp["kettle_pg_wal_segments_ready"]; ok {
		t.Error("segments unknown: kettle_pg_wal_segments_ready still there")
	}
	if v := value(t, mfsp, "kettle_pg_wal_bytes_total"); v != 1<<30 {
		t.Errorf("segments unknown: kettle_pg_wal_bytes_total = %v, want %v", v, 1<<30)
	}
	fail = true
	if _, ok := gather(t, mp.Registry())["kettle_pg_checkpoints_total"]; ok {
		t.Error("scrape with the database down: kettle_pg_checkpoints_total still there")
	}

	m3 := metrics.New(prometheus.NewRegistry())
	m3.RegisterStore(retrier{})
	mfs3 := gather(t, m3.Registry())
	for reason, want := range map[string]float64{"conflict": 2, "partition": 1} {
		if v := value(t, mfs3, "kettle_pg_write_retries_total", "reason", reason); v != want {
			t.Errorf("kettle_pg_write_retries_total{reason=%q} = %v, want %v", reason, v, want)
		}
	}

	// A store with nothing to expose registers nothing.
	m2 := metrics.New(prometheus.NewRegistry())
	m2.RegisterStore(struct{}{})
	if gather(t, m2.Registry())["kettle_sqlite_busy_retries_total"] != nil {
		t.Error("busy retries registered for a store without them")
	}
}

func TestSwarm(t *testing.T) {
	sw := metrics.NewSwarm(prometheus.NewRegistry())
	sw.Offered("measurement")
	sw.Offered("measurement")
	sw.Offered("command")
	sw.Offered("a new endpoint")
	sw.Completed("measurement", 200, 3*time.Millisecond)
	sw.Completed("measurement", 503, 40*time.Millisecond)
	sw.Completed("command", 304, time.Millisecond)
	sw.Error("measurement", "http_503")
	sw.Error("measurement", "timeout")
	sw.Error("command", "something odd")
	sw.Error("command", "http_99999")
	sw.SetActive(1000)
	sw.SetLag(2500 * time.Microsecond)
	mfs := gather(t, sw.Registry())
	f := func(name string, want float64, labels ...string) {
		t.Helper()
		if v := value(t, mfs, name, labels...); v != want {
			t.Errorf("%s%v = %v, want %v", name, labels, v, want)
		}
	}
	f("kettle_swarm_requests_offered_total", 2, "endpoint", "measurement")
	f("kettle_swarm_requests_offered_total", 1, "endpoint", "other")
	f("kettle_swarm_requests_completed_total", 1, "endpoint", "measurement", "status", "2xx")
	f("kettle_swarm_requests_completed_total", 1, "endpoint", "measurement", "status", "5xx")
	f("kettle_swarm_requests_completed_total", 1, "endpoint", "command", "status", "3xx")
	f("kettle_swarm_request_duration_seconds", 2, "endpoint", "measurement")
	f("kettle_swarm_errors_total", 1, "endpoint", "measurement", "kind", "http_503")
	f("kettle_swarm_errors_total", 1, "endpoint", "measurement", "kind", "timeout")
	f("kettle_swarm_errors_total", 2, "endpoint", "command", "kind", "other")
	f("kettle_swarm_kettles_active", 1000)
	f("kettle_swarm_lag_seconds", 0.0025)
	checkBounded(t, mfs)

	l, err := metrics.Listen("127.0.0.1:0", sw.Handler())
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(l.URL())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "kettle_swarm_kettles_active 1000") {
		t.Errorf("GET %s:\n%.400s", l.URL(), b)
	}
	if err := l.Close(); err != nil {
		t.Error(err)
	}
}

func BenchmarkMiddleware(b *testing.B) {
	m := metrics.New(prometheus.NewRegistry())
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/command", func(w http.ResponseWriter, r *http.Request) {})
	h := m.Middleware(mux)
	r := httptest.NewRequest("GET", "/v1/command", nil)
	w := httptest.NewRecorder()
	b.ReportAllocs()
	for b.Loop() {
		h.ServeHTTP(w, r)
	}
}
