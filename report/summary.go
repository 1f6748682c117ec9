// Package report turns a swarm's results.json (and, for kettle capacity, its
// steps) into one self-contained HTML page: charts over time, a summary with
// the command that reproduces the run, a USE table per resource and a verdict
// naming the first resource that saturated. The page's scripts and styles are
// embedded in the binary; it needs no network to view.
package report

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// Num is a chart value: NaN (not measured) is null in JSON, and values are
// rounded to 3 decimals so the page and the golden files stay small.
type Num float64

// MarshalJSON implements json.Marshaler.
func (n Num) MarshalJSON() ([]byte, error) {
	f := float64(n)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return []byte("null"), nil
	}
	return strconv.AppendFloat(nil, math.Round(f*1000)/1000, 'f', -1, 64), nil
}

// UnmarshalJSON implements json.Unmarshaler (null is NaN).
func (n *Num) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*n = Num(math.NaN())
		return nil
	}
	f, err := strconv.ParseFloat(string(b), 64)
	*n = Num(f)
	return err
}

var nan = Num(math.NaN())

// Percentiles shown per endpoint (keys of EndpointSeries.Latency).
var Percentiles = []string{"p50", "p95", "p99", "p99.9", "max"}

// Summary is everything the page shows; it is also written as JSON (the
// golden file of the tests).
type Summary struct {
	Title        string                        `json:"title"`
	Command      string                        `json:"command"`
	Params       sim.Params                    `json:"params"`
	Start        time.Time                     `json:"start"`
	End          time.Time                     `json:"end"`
	Totals       map[string]*sim.EndpointTotal `json:"totals"`
	Requests     int64                         `json:"requests"`
	Errors       int64                         `json:"errors"`
	ErrorRate    float64                       `json:"error_rate"`
	ErrorsByKind map[string]int64              `json:"errors_by_kind,omitempty"`
	Audit        *sim.Audit                    `json:"audit,omitempty"`
	Sim          SimTotals                     `json:"simulator"`
	// System roles and what could not be sampled.
	Roles   map[string]string `json:"roles,omitempty"`
	Missing []string          `json:"missing,omitempty"`
	CPUs    int               `json:"cpus"`

	Series   Series    `json:"series"`
	Faults   []Band    `json:"faults,omitempty"` // drawn over the time-series charts
	Stages   []Band    `json:"stages,omitempty"` // the load shape's, drawn as the faults are
	USE      []UseRow  `json:"use"`
	Verdict  Verdict   `json:"verdict"`
	Capacity *Capacity `json:"capacity,omitempty"`
}

// Band is one fault of the run (chaos nemesis), in seconds since Start:
// the page shades it over every time-series chart, so a reader sees what
// it cost.
type Band struct {
	Name string  `json:"name"`
	Kind string  `json:"kind"`
	T0   float64 `json:"t0"`
	T1   float64 `json:"t1"`
}

// bands are the results' faults relative to the run's start.
func bands(r *sim.Results) []Band {
	var out []Band
	for _, f := range r.Faults {
		out = append(out, Band{Name: f.Name, Kind: f.Kind, T0: f.Start.Sub(r.Start).Seconds(), T1: f.End.Sub(r.Start).Seconds()})
	}
	return out
}

// SimTotals are the simulator's own figures.
type SimTotals struct {
	LateStarts       int64   `json:"late_starts"`
	MaxLagMs         float64 `json:"max_lag_ms"`
	CPUSeconds       float64 `json:"cpu_seconds"`
	CPUPer10kPerMin  float64 `json:"cpu_per_10k_kettles_per_min"`
	MaxRSSBytes      int64   `json:"max_rss_bytes"`
	Readings, Acked  int64
	Dropped, Unacked int64
}

// HeapLive is the key of the server's live Go heap (go_gc_heap_live_bytes,
// scraped from its /metrics) among Series.RSSMiB, charted with the resident
// memory it explains.
const HeapLive = "server live heap"

// Series are the charts' data, one value per second of the run.
type Series struct {
	T         []int                      `json:"t"`
	Endpoints map[string]*EndpointSeries `json:"endpoints"`
	Status    map[string][]Num           `json:"status"`      // HTTP status (all endpoints) → per second
	ErrorKind map[string][]Num           `json:"error_kinds"` // error kind → per second
	Kettles   []Num                      `json:"kettles"`
	InFlight  []Num                      `json:"in_flight"`
	LagMs     []Num                      `json:"lag_ms"`
	Late      []Num                      `json:"late_starts"`
	CPU       map[string][]Num           `json:"cpu"`     // role or "machine" / "other" → %
	RSSMiB    map[string][]Num           `json:"rss_mib"` // role → MiB; "available" = machine; HeapLive = the server's live Go heap
	DiskAwait map[string][]Num           `json:"disk_await_ms"`
	DiskUtil  map[string][]Num           `json:"disk_util"`
	Queue     map[string][]Num           `json:"queue"` // rows, capacity, rejected_per_s
	Pool      map[string][]Num           `json:"pool"`  // wait, acquired, max; PostgreSQL's WAL: pg_wal_mib_per_s, pg_fpi_per_s, pg_checkpoints_per_s (begun), pg_checkpoint_buffers_per_s, pg_wal_segments_created_per_s, pg_wal_segments_ready
	RunQueue  []Num                      `json:"run_queue"`
	PSI       map[string][]Num           `json:"psi,omitempty"` // resource → some %
	NetMiBps  map[string][]Num           `json:"net_mibps,omitempty"`
}

// EndpointSeries is one endpoint over time.
type EndpointSeries struct {
	Offered   []Num            `json:"offered"`
	Completed []Num            `json:"completed"`
	Latency   map[string][]Num `json:"latency_ms"` // Percentiles → per second
}

// UseRow is one resource of the USE table.
type UseRow struct {
	Resource    string `json:"resource"`
	Utilisation string `json:"utilisation"`
	Saturation  string `json:"saturation"`
	Errors      string `json:"errors"`
	// Saturated is the second it saturated (0: it did not).
	Saturated int  `json:"saturated,omitempty"`
	Verdict   bool `json:"verdict,omitempty"` // this row is the verdict's resource
}

// Options tune Build.
type Options struct {
	Title string
	// SLOP99Ms and MaxErrorRate judge the run when the results do not carry
	// them (0: from the results' params).
	SLOP99Ms     float64
	MaxErrorRate float64
}

// Build computes the summary of a run.
func Build(r *sim.Results, o Options) (*Summary, error) {
	s := &Summary{
		Title: o.Title, Command: r.Command, Params: r.Params, Start: r.Start, End: r.End,
		Totals: r.Totals.Endpoints, Requests: r.Totals.Requests, Errors: r.Totals.Errors,
		ErrorRate: r.Totals.ErrorRate, ErrorsByKind: r.Totals.ErrorsByKind, Audit: r.Audit,
		Sim: SimTotals{LateStarts: r.Totals.LateStarts, MaxLagMs: r.Totals.MaxLagMs, CPUSeconds: r.Totals.CPUSeconds,
			CPUPer10kPerMin: r.Totals.CPUPer10kKettlesPerMin, MaxRSSBytes: r.Totals.MaxRSSBytes,
			Readings: r.Totals.Readings, Acked: r.Totals.Acked, Dropped: r.Totals.Dropped, Unacked: r.Totals.Unacked},
		CPUs: r.Params.GOMAXPROCS, Faults: bands(r), Stages: stageBands(r.Params),
	}
	if s.Title == "" {
		s.Title = fmt.Sprintf("kettle swarm: %d kettles, %s", r.Params.Devices, r.Start.UTC().Format("2006-01-02 15:04:05 UTC"))
	}
	tl, err := s.buildSeries(r)
	if err != nil {
		return nil, err
	}
	tl.SLOP99Ms, tl.MaxErrorRate = r.Params.SLOP99Ms, r.Params.MaxErrorRate
	if o.SLOP99Ms > 0 {
		tl.SLOP99Ms = o.SLOP99Ms
	}
	if o.MaxErrorRate > 0 {
		tl.MaxErrorRate = o.MaxErrorRate
	}
	s.Verdict = Judge(tl)
	s.USE = useTable(tl, s)
	return s, nil
}

// TimelineOf is the verdict's input for a run (what the fixtures record).
func TimelineOf(r *sim.Results) (*Timeline, error) {
	s := &Summary{}
	tl, err := s.buildSeries(r)
	if err != nil {
		return nil, err
	}
	tl.SLOP99Ms, tl.MaxErrorRate = r.Params.SLOP99Ms, r.Params.MaxErrorRate
	return tl, nil
}

// addTo adds a count to a series that starts out not measured (NaN).
func addTo(xs []Num, i int, c int64) {
	if math.IsNaN(float64(xs[i])) {
		xs[i] = 0
	}
	xs[i] += Num(c)
}

func filled(n int) []Num {
	xs := make([]Num, n)
	for i := range xs {
		xs[i] = nan
	}
	return xs
}

// buildSeries fills s.Series and returns the verdict's timeline.
func (s *Summary) buildSeries(r *sim.Results) (*Timeline, error) {
	n := len(r.Seconds)
	se := Series{
		T: make([]int, n), Endpoints: map[string]*EndpointSeries{}, Status: map[string][]Num{}, ErrorKind: map[string][]Num{},
		Kettles: filled(n), InFlight: filled(n), LagMs: filled(n), Late: filled(n),
		CPU: map[string][]Num{}, RSSMiB: map[string][]Num{}, DiskAwait: map[string][]Num{}, DiskUtil: map[string][]Num{},
		Queue: map[string][]Num{}, Pool: map[string][]Num{}, RunQueue: filled(n),
	}
	tl := &Timeline{Start: r.Start, T: se.T, CPUs: r.Params.GOMAXPROCS,
		Requests: filled(n), Errors: filled(n), P99Ms: filled(n)}
	if err := se.addSeconds(r.Seconds, tl); err != nil {
		return nil, err
	}
	for k, c := range r.Totals.ErrorsByKind {
		if tl.ErrorKinds == nil {
			tl.ErrorKinds = map[string]float64{}
		}
		tl.ErrorKinds[k] = float64(c)
	}
	tl.Kettles, tl.LagMs, tl.Late = se.Kettles, se.LagMs, se.Late
	for _, e := range r.Totals.Endpoints {
		tl.P99RunMs = math.Max(tl.P99RunMs, e.P99Ms)
	}

	// The simulator's own CPU, from its cumulative CPU seconds, when the
	// sampler did not run.
	simCPU := filled(n)
	for i := 1; i < n; i++ {
		simCPU[i] = Num((r.Seconds[i].CPUSeconds - r.Seconds[i-1].CPUSeconds) * 100)
	}
	if sys := r.System; sys != nil {
		s.Roles, s.Missing = sys.Roles, sys.Missing
		s.CPUs = sys.CPUs
		tl.CPUs, tl.SameProcess, tl.Sampled, tl.MemTotalBytes = sys.CPUs, sys.SameProcess, true, float64(sys.MemTotalBytes)
		heap, diskPeak := se.addSamples(r, sys.Samples)
		tl.fromSystem(&se, heap, diskPeak)
	}
	if tl.SimCPU == nil && !tl.SameProcess {
		tl.SimCPU = simCPU
		if r.System == nil {
			se.CPU["simulator (process)"] = simCPU
		}
	}
	s.Series = se
	return tl, nil
}

// col is series k of m, made (not measured: NaN) on first use.
func (se *Series) col(m map[string][]Num, k string) []Num {
	if m[k] == nil {
		m[k] = filled(len(se.T))
	}
	return m[k]
}

// addSeconds fills the client's series from the run's seconds, and the
// timeline's requests, errors and worst p99 per second.
func (se *Series) addSeconds(secs []sim.Second, tl *Timeline) error {
	n := len(secs)
	for i, sec := range secs {
		se.T[i] = sec.T
		se.Kettles[i], se.InFlight[i], se.LagMs[i], se.Late[i] = Num(sec.Kettles), Num(sec.InFlight), Num(sec.MaxLagMs), Num(sec.LateStarts)
		var req, errs int64
		worst := math.NaN()
		for name, e := range sec.Endpoints {
			es := se.Endpoints[name]
			if es == nil {
				es = &EndpointSeries{Offered: filled(n), Completed: filled(n), Latency: map[string][]Num{}}
				for _, p := range Percentiles {
					es.Latency[p] = filled(n)
				}
				se.Endpoints[name] = es
			}
			es.Offered[i], es.Completed[i] = Num(e.Offered), Num(e.Requests)
			req += e.Requests
			for code, c := range e.Status {
				addTo(se.col(se.Status, code), i, c)
			}
			for k, c := range e.Errors {
				addTo(se.col(se.ErrorKind, k), i, c)
				errs += c
			}
			if e.Histogram == "" || e.Requests == 0 {
				continue
			}
			h, err := hdrhistogram.Decode([]byte(e.Histogram))
			if err != nil {
				return fmt.Errorf("second %d %s: %w", sec.T, name, err)
			}
			q := func(p float64) Num { return Num(float64(h.ValueAtQuantile(p)) / 1000) }
			es.Latency["p50"][i], es.Latency["p95"][i], es.Latency["p99"][i], es.Latency["p99.9"][i] = q(50), q(95), q(99), q(99.9)
			es.Latency["max"][i] = Num(float64(h.Max()) / 1000)
			if p := float64(es.Latency["p99"][i]); math.IsNaN(worst) || p > worst {
				worst = p
			}
		}
		tl.Requests[i], tl.Errors[i], tl.P99Ms[i] = Num(req), Num(errs), Num(worst)
	}
	// NaN counts become 0 where a map key appeared later in the run.
	for _, m := range []map[string][]Num{se.Status, se.ErrorKind} {
		for _, xs := range m {
			for i := range xs {
				if math.IsNaN(float64(xs[i])) {
					xs[i] = 0
				}
			}
		}
	}
	return nil
}

// addSamples places the system samples on the run's seconds; it returns
// the server's Go heap per second (for the verdict only, not charted) and
// each disk's peak activity.
func (se *Series) addSamples(r *sim.Results, samples []sysstat.Sample) (heap []Num, diskPeak map[string]float64) {
	n := len(se.T)
	heap, diskPeak = filled(n), map[string]float64{}
	var prev *sysstat.Sample // the last scraped sample: PostgreSQL's counters become rates
	for k := range samples {
		smp := &samples[k]
		// A sample covers the second before it: one taken after the
		// run ended is (mostly) the audit or the shutdown, not the run.
		if !r.End.IsZero() && smp.Time.After(r.End) {
			continue
		}
		i := int(math.Round(smp.Time.Sub(r.Start).Seconds())) - 1 // second T covers (T-1, T]
		if n > 0 && r.Seconds[0].T != 1 {
			i = int(math.Round(smp.Time.Sub(r.Start).Seconds())) - r.Seconds[0].T
		}
		if i < 0 || i >= n {
			continue
		}
		se.addMachine(i, smp, diskPeak)
		if g := smp.Server; g != nil && g.Up {
			se.addServer(i, smp, prev)
			prev = smp
			if g.HeapBytes != nil {
				heap[i] = Num(*g.HeapBytes)
			}
		}
	}
	return heap, diskPeak
}

// addMachine sets second i of the processes' and the machine's series
// from smp, and raises each disk's peak activity.
func (se *Series) addMachine(i int, smp *sysstat.Sample, diskPeak map[string]float64) {
	for role, p := range smp.Procs {
		se.col(se.CPU, role)[i] = Num(p.CPUPct)
		se.col(se.RSSMiB, role)[i] = Num(float64(p.RSSBytes) / (1 << 20))
	}
	se.col(se.CPU, "machine")[i] = Num(smp.CPU.Busy())
	var known float64
	for _, p := range smp.Procs {
		known += p.CPUPct
	}
	se.col(se.CPU, "other")[i] = Num(math.Max(0, smp.CPU.Busy()-known))
	se.col(se.CPU, "iowait")[i] = Num(smp.CPU.Iowait)
	se.col(se.RSSMiB, "available")[i] = Num(float64(smp.MemAvailableBytes) / (1 << 20))
	se.RunQueue[i] = Num(smp.ProcsRunning)
	for res, p := range smp.PSI {
		if se.PSI == nil {
			se.PSI = map[string][]Num{}
		}
		se.col(se.PSI, res)[i] = Num(p.SomePct)
	}
	for name, d := range smp.Disks {
		se.col(se.DiskAwait, name)[i] = Num(d.AwaitMs)
		se.col(se.DiskUtil, name)[i] = Num(d.UtilPct)
		diskPeak[name] = math.Max(diskPeak[name], d.UtilPct+d.AwaitMs/1000+d.IOPS*1e-9)
	}
	if se.NetMiBps == nil {
		se.NetMiBps = map[string][]Num{}
	}
	se.col(se.NetMiBps, "loopback")[i] = Num(smp.Net.LoopbackBps / (1 << 20))
	se.col(se.NetMiBps, "total")[i] = Num(smp.Net.TotalBps / (1 << 20))
}

// addServer sets second i of the server's scraped series from smp; its
// counters become rates against prev, the last scraped sample (nil: none).
func (se *Series) addServer(i int, smp, prev *sysstat.Sample) {
	g := smp.Server
	set := func(m map[string][]Num, k string, v *float64) {
		if v != nil {
			se.col(m, k)[i] = Num(*v)
		}
	}
	set(se.Queue, "rows", g.QueueRows)
	set(se.Queue, "capacity", g.QueueCapacityRows)
	set(se.Queue, "rejected_per_s", g.RejectedPerS)
	set(se.Queue, "commit_ms", g.CommitMeanMs)
	set(se.Pool, "wait", g.PoolWaitSecPerS)
	set(se.Pool, "acquired", g.PoolAcquiredConns)
	set(se.Pool, "max", g.PoolMaxConns)
	set(se.Pool, "sqlite_busy_per_s", g.SQLiteBusyPerS)
	set(se.Queue, "merge_s_per_s", g.SQLiteMergeSecPerS)
	set(se.Pool, "pg_wal_segments_ready", g.PGWALSegmentsReady)
	if prev != nil {
		dt := smp.Time.Sub(prev.Time).Seconds()
		perS := func(k string, cur, old *float64, scale float64) {
			if cur != nil && old != nil && dt > 0 && *cur >= *old {
				se.col(se.Pool, k)[i] = Num((*cur - *old) / dt / scale)
			}
		}
		perS("pg_fpi_per_s", g.PGWALFullPageImages, prev.Server.PGWALFullPageImages, 1)
		perS("pg_checkpoints_per_s", g.PGCheckpoints, prev.Server.PGCheckpoints, 1)
		perS("pg_checkpoint_buffers_per_s", g.PGCheckpointBuffers, prev.Server.PGCheckpointBuffers, 1)
		perS("pg_wal_mib_per_s", g.PGWALBytes, prev.Server.PGWALBytes, 1<<20)
		if created, ok := segmentsCreated(prev.Server, g); ok && dt > 0 {
			se.col(se.Pool, "pg_wal_segments_created_per_s")[i] = Num(created / dt)
		}
	}
	if g.HeapLiveBytes != nil {
		se.col(se.RSSMiB, HeapLive)[i] = Num(*g.HeapLiveBytes / (1 << 20))
	}
}

// fromSystem takes the verdict's system series from se: the busiest disk,
// CPU, memory (in bytes), the queue, the pool and PostgreSQL's WAL.
func (tl *Timeline) fromSystem(se *Series, heap []Num, diskPeak map[string]float64) {
	for _, name := range slices.Sorted(maps.Keys(diskPeak)) {
		if tl.Disk == "" || diskPeak[name] > diskPeak[tl.Disk] {
			tl.Disk = name
		}
	}
	tl.DiskAwaitMs, tl.DiskUtil = se.DiskAwait[tl.Disk], se.DiskUtil[tl.Disk]
	tl.ServerCPU, tl.PostgresCPU, tl.MachineCPU = se.CPU[sysstat.RoleServer], se.CPU[sysstat.RolePostgres], se.CPU["machine"]
	tl.SimCPU = se.CPU[sysstat.RoleSimulator]
	tl.RunQueue = se.RunQueue
	mb := func(xs []Num) []Num {
		if xs == nil {
			return nil
		}
		out := make([]Num, len(xs))
		for i, x := range xs {
			out[i] = x * (1 << 20)
		}
		return out
	}
	tl.ServerRSS, tl.PostgresRSS, tl.MemAvailable = mb(se.RSSMiB[sysstat.RoleServer]), mb(se.RSSMiB[sysstat.RolePostgres]), mb(se.RSSMiB["available"])
	tl.ServerHeapLive = mb(se.RSSMiB[HeapLive])
	tl.QueueRows, tl.QueueCap, tl.RejectedPerS, tl.CommitMs = se.Queue["rows"], se.Queue["capacity"], se.Queue["rejected_per_s"], se.Queue["commit_ms"]
	tl.MergeBusy = se.Queue["merge_s_per_s"]
	tl.FPIPerS, tl.WALMiBPerS, tl.CheckpointsPerS = se.Pool["pg_fpi_per_s"], se.Pool["pg_wal_mib_per_s"], se.Pool["pg_checkpoints_per_s"]
	tl.WALSegmentsPerS, tl.WALSegmentsReady = se.Pool["pg_wal_segments_created_per_s"], se.Pool["pg_wal_segments_ready"]
	tl.CheckpointBufPerS = se.Pool["pg_checkpoint_buffers_per_s"]
	if !allNaN(heap) {
		tl.ServerHeap = heap
	}
	tl.PoolWait, tl.PoolAcquired, tl.PoolMax = se.Pool["wait"], se.Pool["acquired"], se.Pool["max"]
}

// useTable is the USE method, one row per resource.
func useTable(tl *Timeline, s *Summary) []UseRow {
	u := &use{tl: tl, s: s, n: len(tl.T), total: 100 * float64(max(tl.CPUs, 1))}
	rq := "run queue peak " + numStr(peak(tl.RunQueue))
	if p := s.Series.PSI["cpu"]; p != nil {
		rq += ", CPU pressure (PSI some) peak " + pct(peak(p))
	}
	rows := []UseRow{
		u.cpu("server CPU", tl.ServerCPU, rq),
		u.cpu("database CPU", tl.PostgresCPU, "pool wait: see DB pool"),
		u.cpu("machine CPU", tl.MachineCPU, rq),
		u.memory(), u.disk(), u.queue(), u.pool(),
	}
	if !allNaN(tl.WALMiBPerS) {
		rows = append(rows, u.wal())
	}
	return append(rows, u.simulator())
}

// use builds the USE table's rows from the timeline and the summary.
type use struct {
	tl    *Timeline
	s     *Summary
	n     int
	total float64 // the machine's CPU, % (100 a core)
}

const notSampled = "not sampled"

// satAt is the second cond first holds from (0: never).
func (u *use) satAt(cond func(int) bool) int {
	if i := onset(u.n, cond); i >= 0 {
		return u.tl.T[i]
	}
	return 0
}

// row marks r as the verdict's resource when it is.
func (u *use) row(r UseRow) UseRow {
	r.Verdict = u.s.Verdict.Resource != "" && r.Resource == u.s.Verdict.Resource
	return r
}

func (u *use) cpu(name string, xs []Num, sat string) UseRow {
	if allNaN(xs) {
		return u.row(UseRow{Resource: name, Utilisation: notSampled, Saturation: "—", Errors: "—"})
	}
	return u.row(UseRow{Resource: name,
		Utilisation: fmt.Sprintf("peak %s, mean %s of %s", pct(peak(xs)), pct(mean(xs, 0, u.n)), pct(u.total)),
		Saturation:  sat, Errors: "—",
		Saturated: u.satAt(func(i int) bool { return at(xs, i) >= cpuSatFrac*u.total })})
}

func (u *use) memory() UseRow {
	tl, s := u.tl, u.s
	mem := UseRow{Resource: "memory", Utilisation: notSampled, Saturation: "—", Errors: "—"}
	if tl.Sampled {
		pg := ""
		if !allNaN(tl.PostgresRSS) {
			pg = ", PostgreSQL " + mib(peak(tl.PostgresRSS))
		}
		heap := ""
		if !allNaN(tl.ServerHeapLive) {
			heap = " (live Go heap peak " + mib(peak(tl.ServerHeapLive)) + ")"
		}
		mem.Utilisation = fmt.Sprintf("server RSS peak %s%s%s; machine memory available min %s of %s",
			mib(peak(tl.ServerRSS)), heap, pg, mib(-peak(neg(tl.MemAvailable))), mib(tl.MemTotalBytes))
		if p := s.Series.PSI["memory"]; p != nil {
			mem.Saturation = "memory pressure (PSI some) peak " + pct(peak(p))
		}
		if s.Verdict.Class == ClassMemory {
			mem.Saturated = s.Verdict.T
		}
	}
	mem = u.row(mem)
	if s.Verdict.Resource == "server memory" {
		mem.Verdict = true
	}
	return mem
}

func (u *use) disk() UseRow {
	tl := u.tl
	disk := UseRow{Resource: "disk", Utilisation: notSampled, Saturation: "—", Errors: "—"}
	if tl.Disk != "" {
		disk.Utilisation = fmt.Sprintf("%s busy peak %s", tl.Disk, pct(peak(tl.DiskUtil)))
		disk.Saturation = fmt.Sprintf("await peak %.1f ms", peak(tl.DiskAwaitMs))
		if p := u.s.Series.PSI["io"]; p != nil {
			disk.Saturation += ", I/O pressure (PSI some) peak " + pct(peak(p))
		}
		disk.Saturated = u.satAt(func(i int) bool { return at(tl.DiskAwaitMs, i) >= diskAwaitSat || at(tl.DiskUtil, i) >= diskUtilSat })
	}
	return u.row(disk)
}

func (u *use) queue() UseRow {
	tl := u.tl
	q := UseRow{Resource: "ingest queue", Utilisation: "not scraped (no server /metrics)", Saturation: "—", Errors: "—"}
	if !allNaN(tl.QueueCap) {
		q.Utilisation = fmt.Sprintf("peak %.0f of %.0f rows (%s)", peak(tl.QueueRows), peak(tl.QueueCap), pct(100*peak(tl.QueueRows)/peak(tl.QueueCap)))
		q.Saturation = fmt.Sprintf("503 refusals peak %.0f/s", nz(peak(tl.RejectedPerS)))
		if c := peak(tl.CommitMs); !math.IsNaN(c) {
			q.Errors = fmt.Sprintf("commit time peak %.0f ms", c)
		}
		q.Saturated = u.satAt(func(i int) bool {
			return (at(tl.QueueCap, i) > 0 && at(tl.QueueRows, i) >= queueSatFrac*at(tl.QueueCap, i)) || at(tl.RejectedPerS, i) > 0
		})
	}
	return u.row(q)
}

// pool is PostgreSQL's connection pool, or SQLite's one writer.
func (u *use) pool() UseRow {
	tl, s := u.tl, u.s
	p := UseRow{Resource: "DB pool", Utilisation: "no pool (SQLite store, or not scraped)", Saturation: "—", Errors: "—"}
	if !allNaN(tl.PoolMax) {
		p.Utilisation = fmt.Sprintf("peak %.0f of %.0f connections in use", peak(tl.PoolAcquired), peak(tl.PoolMax))
		p.Saturation = fmt.Sprintf("acquire wait peak %.2f s/s (requests waiting)", nz(peak(tl.PoolWait)))
		p.Saturated = u.satAt(func(i int) bool { return at(tl.PoolWait, i) >= poolWaitSat })
	} else if b := s.Series.Pool["sqlite_busy_per_s"]; b != nil {
		p.Saturation = fmt.Sprintf("SQLite busy retries peak %.0f/s", nz(peak(b)))
		if !allNaN(tl.MergeBusy) {
			p.Resource = "SQLite writer"
			p.Utilisation = fmt.Sprintf("merging staged rows: peak %s of a second, mean %s", pct(100*peak(tl.MergeBusy)), pct(100*mean(tl.MergeBusy, 0, len(tl.MergeBusy))))
		}
		if s.Verdict.Class == ClassStoreWriter {
			p.Saturated = s.Verdict.T
		}
	}
	return u.row(p)
}

// wal is PostgreSQL's WAL and checkpoints.
func (u *use) wal() UseRow {
	tl, s := u.tl, u.s
	cps := sumOf(tl.CheckpointsPerS)
	w := UseRow{Resource: "PostgreSQL WAL",
		Utilisation: fmt.Sprintf("WAL written: peak %.1f MiB/s, mean %.1f", peak(tl.WALMiBPerS), mean(tl.WALMiBPerS, 0, len(tl.WALMiBPerS))),
		Saturation:  fmt.Sprintf("full-page images: peak %.0f/s, median %.0f/s; %s begun", nz(peak(tl.FPIPerS)), nz(medianOf(tl.FPIPerS)), count(int64(math.Round(cps)), "checkpoint")),
		Errors:      "—"}
	if !allNaN(tl.WALSegmentsPerS) {
		w.Saturation += fmt.Sprintf("; %s created (segment files ready: %.0f to %.0f)", count(int64(math.Round(sumOf(tl.WALSegmentsPerS))), "new WAL segment file"),
			nz(lowest(tl.WALSegmentsReady)), nz(peak(tl.WALSegmentsReady)))
	}
	if s.Verdict.Class == ClassCheckpoint || s.Verdict.Class == ClassWALSegment {
		w.Saturated = s.Verdict.T
	}
	return u.row(w)
}

func (u *use) simulator() UseRow {
	tl, s := u.tl, u.s
	sm := UseRow{Resource: "simulator", Saturation: fmt.Sprintf("lag peak %s, %d late starts", dur(s.Sim.MaxLagMs), s.Sim.LateStarts),
		Errors: fmt.Sprintf("%d client-seen errors%s", s.Errors, kindsStr(s.ErrorsByKind))}
	if tl.SameProcess {
		sm.Utilisation = "shares the server's process (see server CPU)"
	} else {
		sm.Utilisation = fmt.Sprintf("CPU peak %s, %.2f CPU-s per 10k kettles per minute", pct(peak(tl.SimCPU)), s.Sim.CPUPer10kPerMin)
	}
	sm.Saturated = u.satAt(func(i int) bool { return at(tl.LagMs, i) >= lagSatMs })
	return u.row(sm)
}

func neg(xs []Num) []Num {
	out := make([]Num, len(xs))
	for i, x := range xs {
		out[i] = -x
	}
	return out
}

func nz(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return v
}

func numStr(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

func kindsStr(m map[string]int64) string {
	if len(m) == 0 {
		return ""
	}
	s := " ("
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprintf("%s %d", k, m[k])
	}
	return s + ")"
}

// JSON is the summary as indented JSON (the golden file's form).
func (s *Summary) JSON() ([]byte, error) { return json.MarshalIndent(s, "", " ") }
