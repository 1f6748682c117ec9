package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sysstat"
)

// SchemaVersion names the layout of results.json; bump it when a field
// changes meaning. A report generator reads the file with these types.
const SchemaVersion = "kettlefleet/swarm-results/v1"

// Histogram geometry of every latency histogram: microseconds, 1 µs to 120 s,
// 3 significant digits. Histograms with one geometry merge exactly.
const (
	HistMinMicros = 1
	HistMaxMicros = 120_000_000
	HistSigFigs   = 3
)

// NewHistogram returns an empty latency histogram with the results geometry.
func NewHistogram() *hdrhistogram.Histogram {
	return hdrhistogram.New(HistMinMicros, HistMaxMicros, HistSigFigs)
}

// Results is the content of results.json.
type Results struct {
	Schema  string    `json:"schema"`  // SchemaVersion
	Command string    `json:"command"` // the command line that reproduces the run
	Params  Params    `json:"params"`
	Start   time.Time `json:"start"`
	End     time.Time `json:"end"`
	// Seconds has one entry per second of the run (T = seconds since Start).
	Seconds []Second `json:"seconds"`
	Totals  Totals   `json:"totals"`
	Audit   *Audit   `json:"audit,omitempty"` // nil when the audit did not run
	// AuditSkipped says why the audit did not run ("" when it ran or was
	// turned off with --audit=false): a run whose readings were never
	// checked must not pass for a clean one.
	AuditSkipped string `json:"audit_skipped,omitempty"`
	// System is what the machine and the processes under test did, sampled
	// each second (nil when not sampled; files without it stay readable).
	System *sysstat.Series `json:"system,omitempty"`
	// Workers are the lab's workers (kettle swarm --workers), one entry
	// each: its shard, its fate and its own cost (nil for one process).
	Workers []WorkerResult `json:"workers,omitempty"`
	// Faults are the faults injected during the run (chaos nemesis writes
	// them in afterwards); the report draws each as a band over its charts.
	Faults []FaultInterval `json:"faults,omitempty"`
	// Acked is every acknowledged reading (Config.ExportAcked); it travels
	// to the lab's controller by its own route, never in results.json.
	Acked []DeviceAcked `json:"-"`
}

// FaultInterval is one fault in force from Start to End (wall clock).
type FaultInterval struct {
	Name  string    `json:"name"`
	Kind  string    `json:"kind"`
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
}

// Params are the run's parameters, as used (after defaults and caps).
type Params struct {
	Target        string   `json:"target"`
	TLS           bool     `json:"tls,omitempty"`        // https target
	TLSResume     bool     `json:"tls_resume,omitempty"` // kettles resume TLS sessions
	API           string   `json:"api"`
	Protocol      string   `json:"protocol,omitempty"`      // "http" (default) or "mqtt"
	MQTTTarget    string   `json:"mqtt_target,omitempty"`   // host:port of the MQTT listener
	MQTTInflight  int      `json:"mqtt_inflight,omitempty"` // publishes a kettle may have awaiting PUBACK
	Devices       int      `json:"devices"`
	IntervalS     float64  `json:"interval_s"`
	JitterS       float64  `json:"jitter_s"`
	HatchRate     float64  `json:"hatch_rate"` // kettles started per second; 0 = all at once
	DurationS     float64  `json:"duration_s"`
	Batch         int      `json:"batch"`
	ConnMode      string   `json:"conn_mode"` // "per-device" or "shared"
	Conns         int      `json:"conns"`     // connection slots after the fd cap
	SourceIPs     int      `json:"source_ips"`
	SourceAddrs   []string `json:"source_addrs,omitempty"` // explicit source addresses (--source-addrs)
	TimeoutS      float64  `json:"timeout_s"`
	Seed          uint64   `json:"seed"`
	Provisioning  string   `json:"provisioning"` // "login" (v0), "secret" or "operator" (v1)
	GOMAXPROCS    int      `json:"gomaxprocs"`
	InProcessNote string   `json:"in_process_note,omitempty"` // e.g. "server runs in this process (demo)"
	// The run's service-level objective, as judged (0: none given).
	SLOP99Ms     float64 `json:"slo_p99_ms,omitempty"`
	MaxErrorRate float64 `json:"max_error_rate,omitempty"`
	// The load shape (kettle swarm --stages, --scenario), if any.
	Scenario string       `json:"scenario,omitempty"`
	Stages   []StageMark  `json:"stages,omitempty"`
	Rollout  *RolloutMark `json:"rollout,omitempty"`
}

// Endpoint names used as keys below.
const (
	EPLogin       = "login"
	EPMeasurement = "measurement"
	EPCommand     = "command"
	// MQTT kettles: dial + CONNECT + SUBSCRIBE, and a QoS 1 PUBLISH of
	// measurements until its PUBACK. Their Status keys are reason codes
	// ("0x00" = success).
	EPMQTTConnect = "mqtt_connect"
	EPMQTTPublish = "mqtt_publish"
)

// Second is what happened in one second of the run.
type Second struct {
	T int `json:"t"`
	// Kettles is how many kettles had started (hatched) by the end of the second.
	Kettles  int `json:"kettles"`
	InFlight int `json:"in_flight"` // kettle exchanges outstanding
	// Endpoints, keyed by EPLogin, EPMeasurement, EPCommand; only those used.
	Endpoints map[string]*EndpointSecond `json:"endpoints"`
	// LateStarts counts sends that were due while the kettle's previous
	// exchange was still outstanding: they were buffered and sent as soon as
	// it returned (latency still counts from the due time).
	LateStarts int64 `json:"late_starts"`
	// MaxLagMs is how far the dispatcher ran behind the schedule at worst in
	// this second (the simulator's own lag, not the server's).
	MaxLagMs float64 `json:"max_lag_ms"`
	// Readings generated, acknowledged (2xx), and dropped from a full
	// per-kettle buffer (never acknowledged, so not audited).
	Readings  int64 `json:"readings"`
	Acked     int64 `json:"acked"`
	Dropped   int64 `json:"dropped"`
	OpenConns int64 `json:"open_conns"`
	// CommandsReceived counts commands pushed to MQTT kettles (their
	// subscription) in the second.
	CommandsReceived int64 `json:"commands_received,omitempty"`
	// CPUSeconds is the process's cumulative user+system CPU; RSSBytes its
	// resident set now. They include the server when it runs in-process.
	CPUSeconds float64 `json:"cpu_seconds"`
	RSSBytes   int64   `json:"rss_bytes"`
	// Workers is each lab worker's own part of the second, in the order
	// of Results.Workers (CPUSeconds and RSSBytes above are their sums).
	Workers []WorkerSecond `json:"workers,omitempty"`
}

// EndpointSecond counts one endpoint's requests that completed in the second.
type EndpointSecond struct {
	// Offered counts requests that came due in the second on the kettles'
	// own schedule (open model), whether or not they could be sent.
	Offered  int64            `json:"offered,omitempty"`
	Requests int64            `json:"requests"`
	Status   map[string]int64 `json:"status,omitempty"` // HTTP status → count
	Errors   map[string]int64 `json:"errors,omitempty"` // kind (timeout, conn, refused, 503, 4xx, 5xx …) → count
	// Histogram is the latency (µs from the intended send time) of every
	// request that completed, as hdrhistogram-go's Encode(V2Compressed)
	// string; decode with hdrhistogram.Decode and Merge across seconds.
	Histogram string `json:"histogram"`
}

// Totals summarise the run.
type Totals struct {
	Endpoints map[string]*EndpointTotal `json:"endpoints"`
	Requests  int64                     `json:"requests"`
	Errors    int64                     `json:"errors"`
	ErrorRate float64                   `json:"error_rate"`
	// ErrorsByKind sums Errors over endpoints.
	ErrorsByKind map[string]int64 `json:"errors_by_kind,omitempty"`
	Readings     int64            `json:"readings"`
	Acked        int64            `json:"acked"`
	Unacked      int64            `json:"unacked"` // still buffered at the end
	Dropped      int64            `json:"dropped"`
	// DuplicatesReported counts readings the server answered as duplicates
	// (a retry of a reading whose first ack was lost: expected, not an error).
	DuplicatesReported int64 `json:"duplicates_reported"`
	LateStarts         int64 `json:"late_starts"`
	// PollsDeferred counts polls not sent because the last command's
	// Cache-Control max-age had not run out (the server asks for fewer
	// polls while overloaded).
	PollsDeferred int64   `json:"polls_deferred,omitempty"`
	MaxLagMs      float64 `json:"max_lag_ms"`
	Dials         int64   `json:"dials"`
	// TLS (an https target): handshakes completed, and how many the server
	// resumed (session tickets) instead of a full handshake.
	TLSHandshakes int64 `json:"tls_handshakes,omitempty"`
	TLSResumed    int64 `json:"tls_resumed,omitempty"`
	// MQTT: commands pushed to the kettles, and connections lost (then redialed).
	CommandsReceived int64   `json:"commands_received,omitempty"`
	ConnsLost        int64   `json:"conns_lost,omitempty"`
	CPUSeconds       float64 `json:"cpu_seconds"`
	// CPUPer10kKettles is CPU seconds per 10,000 kettles per minute of run.
	CPUPer10kKettlesPerMin float64 `json:"cpu_per_10k_kettles_per_min"`
	CPUMicrosPerRequest    float64 `json:"cpu_us_per_request"`
	MaxRSSBytes            int64   `json:"max_rss_bytes"`
	WallSeconds            float64 `json:"wall_seconds"`
}

// EndpointTotal is one endpoint over the whole run.
type EndpointTotal struct {
	// Offered counts requests that came due on the kettles' schedule;
	// Requests those that completed.
	Offered   int64   `json:"offered,omitempty"`
	Requests  int64   `json:"requests"`
	Errors    int64   `json:"errors"`
	PerSecond float64 `json:"per_second"` // mean over the steady part (after hatching)
	P50Ms     float64 `json:"p50_ms"`
	P99Ms     float64 `json:"p99_ms"`
	P999Ms    float64 `json:"p999_ms"`
	MaxMs     float64 `json:"max_ms"`
	Histogram string  `json:"histogram"` // whole run, same encoding as EndpointSecond
}

// Audit compares what the server acknowledged with what it stored.
type Audit struct {
	Devices int   `json:"devices"` // kettles with at least one acked reading
	Acked   int64 `json:"acked"`
	Stored  int64 `json:"stored"` // acked readings found exactly once or more
	Lost    int64 `json:"lost"`   // acked, not found
	// Duplicated counts acked readings returned more than once.
	Duplicated int64 `json:"duplicated"`
	// Unacked counts stored readings the swarm never saw acknowledged
	// (a timeout after commit): allowed, reported for curiosity.
	Unacked  int64    `json:"unacked_stored"`
	Seconds  float64  `json:"seconds"`
	Examples []string `json:"examples,omitempty"` // a few lost or duplicated readings, "device time"
}

// add sums another shard's audit into a, keeping the first ten examples
// (bench/mqttfleet sums whole runs' audits its own way: every example, and
// the slowest audit's seconds, as the runs audit side by side).
func (a *Audit) add(b *Audit) {
	a.Devices += b.Devices
	a.Acked += b.Acked
	a.Stored += b.Stored
	a.Lost += b.Lost
	a.Duplicated += b.Duplicated
	a.Unacked += b.Unacked
	for _, e := range b.Examples {
		if len(a.Examples) < 10 {
			a.Examples = append(a.Examples, e)
		}
	}
}

// Line is the audit's one-line verdict.
func (a *Audit) Line() string {
	return fmt.Sprintf("acked=%d stored=%d lost=%d duplicated=%d (unacked but stored=%d, %d devices, %.1fs)",
		a.Acked, a.Stored, a.Lost, a.Duplicated, a.Unacked, a.Devices, a.Seconds)
}

// WriteFile writes r as DIR/results.json and returns the path.
func (r *Results) WriteFile(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("create results dir: %w", err)
	}
	p := filepath.Join(dir, "results.json")
	b, err := json.MarshalIndent(r, "", " ")
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		return "", fmt.Errorf("write results: %w", err)
	}
	return p, nil
}

// ReadResults reads a results.json.
func ReadResults(path string) (*Results, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Results
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if r.Schema != SchemaVersion {
		return nil, fmt.Errorf("read %s: schema %q, want %q", path, r.Schema, SchemaVersion)
	}
	return &r, nil
}

// Summary prints the human summary of the run.
func (r *Results) Summary(w io.Writer) {
	t := r.Totals
	p := r.Params
	fmt.Fprintf(w, "\nswarm summary: %d kettles (%s, %s conns=%d), interval %gs, %.0fs wall\n",
		p.Devices, p.API, p.ConnMode, p.Conns, p.IntervalS, t.WallSeconds)
	for _, n := range slices.Sorted(maps.Keys(t.Endpoints)) {
		e := t.Endpoints[n]
		fmt.Fprintf(w, "  %-12s %8d req  %7.1f req/s  p50 %7.2f ms  p99 %7.2f ms  p99.9 %7.2f ms  max %7.1f ms  errors %d  (offered %d)\n",
			n, e.Requests, e.PerSecond, e.P50Ms, e.P99Ms, e.P999Ms, e.MaxMs, e.Errors, e.Offered)
	}
	fmt.Fprintf(w, "  requests %d, errors %d (rate %.5f)%s\n", t.Requests, t.Errors, t.ErrorRate, kinds(t.ErrorsByKind))
	fmt.Fprintf(w, "  readings %d: acked %d, still buffered %d, dropped %d; server-reported duplicates %d\n",
		t.Readings, t.Acked, t.Unacked, t.Dropped, t.DuplicatesReported)
	fmt.Fprintf(w, "  simulator: late starts %d, max lag %.1f ms, %d connections dialed\n", t.LateStarts, t.MaxLagMs, t.Dials)
	if r.Params.TLS {
		fmt.Fprintf(w, "  tls: %d handshakes, %d of them resumed (session resumption %s)\n", t.TLSHandshakes, t.TLSResumed, map[bool]string{true: "on", false: "off"}[r.Params.TLSResume])
	}
	if t.PollsDeferred > 0 {
		fmt.Fprintf(w, "  polls deferred by the server's Cache-Control max-age: %d\n", t.PollsDeferred)
	}
	if p.Protocol == ProtocolMQTT {
		fmt.Fprintf(w, "  mqtt: %s, in-flight window %d, commands received %d, connections lost %d\n", p.MQTTTarget, p.MQTTInflight, t.CommandsReceived, t.ConnsLost)
	}
	note := ""
	if p.InProcessNote != "" {
		note = " (" + p.InProcessNote + ")"
	}
	fmt.Fprintf(w, "  process CPU %.2fs = %.3f CPU-s per 10,000 kettles per minute, %.1f µs per request; max RSS %d MiB%s\n",
		t.CPUSeconds, t.CPUPer10kKettlesPerMin, t.CPUMicrosPerRequest, t.MaxRSSBytes>>20, note)
	for _, wr := range r.Workers {
		fmt.Fprintf(w, "  worker %s, %d kettles from #%d every %d: %s, %d req, %d errors, %d acked, CPU %.2fs (%.1f µs/req), max RSS %d MiB, max lag %.1f ms",
			wr.Addr, wr.Devices, wr.First, max(wr.Stride, 1), wr.State, wr.Requests, wr.Errors, wr.Acked, wr.CPUSeconds, wr.CPUMicrosPerRequest, wr.MaxRSSBytes>>20, wr.MaxLagMs)
		if wr.Audit != nil {
			fmt.Fprintf(w, ", audit lost=%d duplicated=%d", wr.Audit.Lost, wr.Audit.Duplicated)
		}
		fmt.Fprintln(w)
		if wr.State != stateDone {
			fmt.Fprintf(w, "    LOST: its share (%d of %d kettles, %.1f%%) is counted until t=%ds only and its readings are not audited (%s)\n",
				wr.Devices, p.Devices, 100*float64(wr.Devices)/float64(max(p.Devices, 1)), wr.LastT, wr.Error)
		}
	}
	switch {
	case r.Audit != nil:
		fmt.Fprintf(w, "  audit: %s\n", r.Audit.Line())
	case r.AuditSkipped != "":
		fmt.Fprintf(w, "  audit: skipped (%s)\n", r.AuditSkipped)
	}
}

func kinds(m map[string]int64) string {
	if len(m) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(":")
	for _, k := range slices.Sorted(maps.Keys(m)) {
		fmt.Fprintf(&b, " %s=%d", k, m[k])
	}
	return b.String()
}

// MergeHistograms decodes and merges one endpoint's per-second histograms,
// which is how a report recomputes any window's percentiles.
func MergeHistograms(r *Results, endpoint string) (*hdrhistogram.Histogram, error) {
	h := NewHistogram()
	for _, s := range r.Seconds {
		e := s.Endpoints[endpoint]
		if e == nil || e.Histogram == "" {
			continue
		}
		sh, err := hdrhistogram.Decode([]byte(e.Histogram))
		if err != nil {
			return nil, fmt.Errorf("second %d %s: %w", s.T, endpoint, err)
		}
		h.Merge(sh)
	}
	return h, nil
}
