package report

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
)

// Timeline is what the verdict reads: the run's per-second signals, aligned
// on the swarm's seconds (T[i] seconds after Start). A value is NaN (null in
// JSON) when it was not measured that second. Build derives it from a
// results.json; the verdict tests replay recorded ones from testdata.
type Timeline struct {
	Start time.Time `json:"start"`
	T     []int     `json:"t"`
	// CPUs is the machine's CPU count: CPU % runs to 100×CPUs.
	CPUs int `json:"cpus"`
	// SameProcess: the server runs in the simulator's process (kettle demo);
	// its CPU is under ServerCPU and SimCPU is empty.
	SameProcess bool `json:"same_process,omitempty"`
	// Sampled is false for results without a system section: only the
	// simulator's own signals are known.
	Sampled bool `json:"sampled"`

	SLOP99Ms     float64 `json:"slo_p99_ms,omitempty"`
	MaxErrorRate float64 `json:"max_error_rate,omitempty"`

	Kettles  []Num `json:"kettles"`
	Requests []Num `json:"requests"` // completed per second, all endpoints
	Errors   []Num `json:"errors"`
	// ErrorKinds counts the run's failed requests by kind (http_401,
	// timeout, …), all endpoints.
	ErrorKinds map[string]float64 `json:"error_kinds,omitempty"`
	P99Ms      []Num              `json:"p99_ms"` // worst endpoint's p99 that second
	// P99RunMs is the worst endpoint's p99 over the whole run.
	P99RunMs float64 `json:"p99_run_ms,omitempty"`
	LagMs    []Num   `json:"lag_ms"` // simulator dispatch lag
	Late     []Num   `json:"late_starts"`

	ServerCPU   []Num `json:"server_cpu"` // % (100 = one core)
	PostgresCPU []Num `json:"postgres_cpu"`
	SimCPU      []Num `json:"sim_cpu"`
	MachineCPU  []Num `json:"machine_cpu"` // busy: user+system+steal
	RunQueue    []Num `json:"run_queue,omitempty"`

	ServerRSS []Num `json:"server_rss"` // bytes
	// ServerHeap is the server's Go heap (go_memstats_heap_alloc_bytes): it
	// falls when a collection ends.
	ServerHeap []Num `json:"server_heap,omitempty"`
	// ServerHeapLive is the live Go heap after the server's last collection
	// (bytes; empty when its /metrics has no go_gc_heap_live_bytes).
	ServerHeapLive []Num   `json:"server_heap_live,omitempty"`
	PostgresRSS    []Num   `json:"postgres_rss"`
	MemAvailable   []Num   `json:"mem_available"`
	MemTotalBytes  float64 `json:"mem_total_bytes"`

	Disk        string `json:"disk,omitempty"` // the busiest device
	DiskAwaitMs []Num  `json:"disk_await_ms"`
	DiskUtil    []Num  `json:"disk_util"`

	QueueRows    []Num `json:"queue_rows"`
	QueueCap     []Num `json:"queue_cap"`
	RejectedPerS []Num `json:"rejected_per_s"`
	CommitMs     []Num `json:"commit_ms,omitempty"`
	// MergeBusy is the share of each second the SQLite writer spent merging
	// staged rows (kettle_sqlite_merge_seconds_total's rate).
	MergeBusy []Num `json:"merge_busy,omitempty"`
	// PostgreSQL's WAL: full-page images and MiB a second, checkpoints
	// begun a second (empty on SQLite).
	FPIPerS         []Num `json:"pg_fpi_per_s,omitempty"`
	WALMiBPerS      []Num `json:"pg_wal_mib_per_s,omitempty"`
	CheckpointsPerS []Num `json:"pg_checkpoints_per_s,omitempty"`
	// Buffers checkpoints wrote a second: they write through their write
	// phase (checkpoint_completion_target of the interval) and stop for
	// the sync phase, which fsyncs every file they wrote.
	CheckpointBufPerS []Num `json:"pg_checkpoint_buffers_per_s,omitempty"`
	// New WAL segment files a second (created, not recycled) and the files
	// ready after the one being written.
	WALSegmentsPerS  []Num `json:"pg_wal_segments_created_per_s,omitempty"`
	WALSegmentsReady []Num `json:"pg_wal_segments_ready,omitempty"`
	PoolWait         []Num `json:"pool_wait"` // seconds waited per second: mean acquirers waiting
	PoolAcquired     []Num `json:"pool_acquired"`
	PoolMax          []Num `json:"pool_max"`
}

// Verdict classes.
const (
	ClassAppCPU      = "app-cpu"
	ClassDBCPU       = "db-cpu"
	ClassMachineCPU  = "machine-cpu"
	ClassPool        = "db-pool"
	ClassDisk        = "disk"
	ClassMemory      = "memory"
	ClassQueue       = "ingest-queue"
	ClassLoadGen     = "load-generator"
	ClassErrors      = "errors"
	ClassStoreWriter = "store-writer"
	ClassGC          = "gc"
	ClassCheckpoint  = "db-checkpoint"
	ClassWALSegment  = "db-wal-segment"
	ClassNone        = "none"
	ClassUnexplained = "unexplained"
)

// Verdict names the first resource to saturate, with its evidence.
type Verdict struct {
	Class    string `json:"class"`
	Resource string `json:"resource,omitempty"`
	// T is the second (since the run's start) the resource saturated; 0 for
	// none. At is the same as a wall-clock time.
	T    int       `json:"t,omitempty"`
	At   time.Time `json:"at,omitzero"`
	Text string    `json:"text"`
	// Also lists other resources that saturated later (symptoms or second
	// limits), one line each.
	Also []string `json:"also,omitempty"`
}

// Thresholds of saturation. CPU is relative to the machine (100×CPUs).
const (
	cpuSatFrac    = 0.90 // of the machine's CPU
	shareDominant = 0.60 // of the busy CPU, to blame one process
	sustainS      = 3    // seconds a condition must hold
	lagSatMs      = 500
	poolWaitSat   = 0.5 // acquirers waiting on average
	diskAwaitSat  = 50  // ms
	diskUtilSat   = 90
	queueSatFrac  = 0.80
	memLowFrac    = 0.10 // of the machine's memory available
	// defaultMaxErrorRate is kettle swarm's --max-error-rate default: how
	// many failed requests a run without that gate may have and still hold.
	defaultMaxErrorRate = 0.001
	memGrowthFrac       = 1.5 // RSS (or the live heap) grew to this multiple of its early level
	memGrowthMin        = 64 << 20
	rootWindowS         = 5 // a root cause this close after a symptom wins
)

type finding struct {
	class, resource string
	t               int // index into T
	text            string
	root            bool // a resource (CPU, disk, pool, memory), not a symptom (queue, lag)
	prio            int
}

// Judge is the verdict: the first resource that saturated, in the USE
// method's sense, explained with numbers. It is a pure function of tl.
//
// Each bottleneck class has its own detector (see detectors); Judge ranks
// what they found: the earliest first, a root cause over the symptom it
// explains.
func Judge(tl *Timeline) Verdict {
	j := newJudging(tl)
	var fs []finding
	for _, d := range detectors {
		fs = append(fs, d.detect(j)...)
	}
	if len(fs) == 0 {
		return noSaturation(tl, j.clock)
	}
	sort.SliceStable(fs, func(a, b int) bool {
		if fs[a].t != fs[b].t {
			return fs[a].t < fs[b].t
		}
		return fs[a].prio < fs[b].prio
	})
	first := fs[0]
	// A symptom (a full queue, a late simulator) is usually caused by a
	// resource that saturates just after it shows: name the resource.
	if !first.root {
		for _, f := range fs[1:] {
			if f.root && f.t-first.t <= rootWindowS {
				first = f
				break
			}
		}
	}
	v := Verdict{Class: first.class, Resource: first.resource, T: tl.T[first.t], Text: first.text}
	if !tl.Start.IsZero() {
		v.At = tl.Start.Add(time.Duration(v.T) * time.Second).UTC()
	}
	for _, f := range fs {
		if f != first {
			v.Also = append(v.Also, f.text)
		}
	}
	return v
}

// judging is what every detector reads: the timeline and what Judge
// derives from it once.
type judging struct {
	tl    *Timeline
	n     int     // samples
	total float64 // the machine's CPU, 100 × CPUs
	clock func(i int) string
}

func newJudging(tl *Timeline) *judging {
	return &judging{
		tl: tl, n: len(tl.T), total: 100 * float64(max(tl.CPUs, 1)),
		clock: func(i int) string {
			if tl.Start.IsZero() {
				return fmt.Sprintf("t=%ds", tl.T[i])
			}
			return tl.Start.Add(time.Duration(tl.T[i])*time.Second).UTC().Format("15:04:05") + fmt.Sprintf(" (t=%ds)", tl.T[i])
		},
	}
}

// detector finds when one class of bottleneck saturated, with its
// evidence; it finds nothing when that class did not.
type detector struct {
	class  string // the bottleneck class it looks for (one of Class…, or several)
	detect func(j *judging) []finding
}

// detectors are the bottleneck classes Judge looks for, one each.
var detectors = []detector{
	{ClassAppCPU + "|" + ClassDBCPU + "|" + ClassMachineCPU, detectCPU},
	{ClassPool, detectPool},
	{ClassDisk, detectDisk},
	{ClassMemory, detectMemory},
	{ClassQueue, detectQueue},
	{ClassLoadGen, detectLoadGen},
}

// detectCPU finds the CPU at its limit: the machine's, or one process's
// that dominates it.
func detectCPU(j *judging) (fs []finding) {
	if i := onset(j.n, func(i int) bool {
		return at(j.tl.MachineCPU, i) >= cpuSatFrac*j.total || at(j.tl.ServerCPU, i) >= cpuSatFrac*j.total || at(j.tl.PostgresCPU, i) >= cpuSatFrac*j.total
	}); i >= 0 {
		end := min(j.n, i+10)
		srv, pg, sim, mach := nz(mean(j.tl.ServerCPU, i, end)), nz(mean(j.tl.PostgresCPU, i, end)), nz(mean(j.tl.SimCPU, i, end)), nz(mean(j.tl.MachineCPU, i, end))
		mach = math.Max(mach, srv+pg+sim)
		other := math.Max(0, mach-srv-pg-sim)
		f := finding{t: i, root: true, prio: 3}
		switch {
		case srv >= shareDominant*mach:
			f.class, f.resource = ClassAppCPU, "server CPU"
			f.text = fmt.Sprintf("server CPU %s of %s from %s while PostgreSQL used %s: the application server is the bottleneck",
				pct(srv), pct(j.total), j.clock(i), pct(pg))
			if j.tl.SameProcess {
				f.text = fmt.Sprintf("server+simulator process CPU %s of %s from %s while PostgreSQL used %s: the one process running both (kettle demo) is the bottleneck; run serve and swarm apart to tell which",
					pct(srv), pct(j.total), j.clock(i), pct(pg))
			}
		case pg >= shareDominant*mach:
			f.class, f.resource = ClassDBCPU, "database CPU"
			f.text = fmt.Sprintf("PostgreSQL CPU %s of %s from %s while the server used %s: the database is the bottleneck",
				pct(pg), pct(j.total), j.clock(i), pct(srv))
		default:
			f.class, f.resource = ClassMachineCPU, "machine CPU"
			parts := []string{"server " + pct(srv)}
			if j.tl.Sampled && !allNaN(j.tl.PostgresCPU) {
				parts = append(parts, "PostgreSQL "+pct(pg))
			}
			if !j.tl.SameProcess {
				parts = append(parts, "simulator "+pct(sim))
			}
			parts = append(parts, "other processes "+pct(other))
			f.text = fmt.Sprintf("the machine's CPU was the limit from %s: %s of %s", j.clock(i), strings.Join(parts, ", "), pct(j.total))
			if other >= shareDominant*mach {
				f.text += ": mostly work outside the test competed for the CPU; rerun on a quiet machine before trusting the numbers"
			}
		}
		fs = append(fs, f)
	}
	return fs
}

// detectPool finds the PostgreSQL pool with every connection in use and
// requests waiting for one.
func detectPool(j *judging) (fs []finding) {
	if i := onset(j.n, func(i int) bool {
		return at(j.tl.PoolWait, i) >= poolWaitSat || (at(j.tl.PoolMax, i) > 0 && at(j.tl.PoolAcquired, i) >= at(j.tl.PoolMax, i) && at(j.tl.PoolWait, i) >= 0.1)
	}); i >= 0 {
		fs = append(fs, finding{class: ClassPool, resource: "DB pool", t: i, root: true, prio: 1,
			text: fmt.Sprintf("the PostgreSQL pool was the limit from %s: %g of %g connections in use and on average %.1f requests waiting for one (peak %.1f); the database itself used %s CPU",
				j.clock(i), at(j.tl.PoolAcquired, i), at(j.tl.PoolMax, i), at(j.tl.PoolWait, i), peak(j.tl.PoolWait), pct(mean(j.tl.PostgresCPU, i, min(j.n, i+10))))})
	}
	return fs
}

// detectDisk finds the disk at its limit: long waits or always busy.
func detectDisk(j *judging) (fs []finding) {
	if i := onset(j.n, func(i int) bool {
		return at(j.tl.DiskAwaitMs, i) >= diskAwaitSat || at(j.tl.DiskUtil, i) >= diskUtilSat
	}); i >= 0 {
		fs = append(fs, finding{class: ClassDisk, resource: "disk", t: i, root: true, prio: 0,
			text: fmt.Sprintf("disk %s was the limit from %s: await %.0f ms (peak %.0f ms), %s busy",
				orDash(j.tl.Disk), j.clock(i), at(j.tl.DiskAwaitMs, i), peak(j.tl.DiskAwaitMs), pct(at(j.tl.DiskUtil, i)))})
	}
	return fs
}

// detectMemory finds memory at its limit: the machine running out, or the
// server growing without bound.
func detectMemory(j *judging) (fs []finding) {
	if j.tl.MemTotalBytes > 0 {
		if i := onset(j.n, func(i int) bool { return at(j.tl.MemAvailable, i) < memLowFrac*j.tl.MemTotalBytes }); i >= 0 {
			fs = append(fs, finding{class: ClassMemory, resource: "memory", t: i, root: true, prio: 2,
				text: fmt.Sprintf("memory was the limit from %s: %s available of %s (server RSS %s, PostgreSQL %s)",
					j.clock(i), mib(at(j.tl.MemAvailable, i)), mib(j.tl.MemTotalBytes), mib(at(j.tl.ServerRSS, i)), mib(at(j.tl.PostgresRSS, i)))})
		}
	}
	// Growth counts only once the fleet is complete: hatching kettles
	// legitimately grows the server's connections and caches.
	full := 0
	for full < j.n && at(j.tl.Kettles, full) < lastValid(j.tl.Kettles) {
		full++
	}
	steadyEnd := min(j.n, full+max((j.n-full)/5, 1))
	// A garbage-collected server's RSS grows between collections by what its
	// collector target allows (at GOGC=400 up to 5× the live heap), steadily
	// over a short run at a steady load: when the server reports its live
	// heap, growth is judged on that, and RSS is quoted beside it.
	mem, what := j.tl.ServerRSS, "RSS"
	if !allNaN(j.tl.ServerHeapLive) {
		mem, what = j.tl.ServerHeapLive, "live heap (what its last collection kept)"
	}
	if base := -peak(neg(slice(mem, full, steadyEnd))); base > 0 && lastValid(mem) >= memGrowthFrac*base && lastValid(mem)-base >= memGrowthMin {
		if i := onset(j.n, func(i int) bool {
			return i >= full && at(mem, i) >= memGrowthFrac*base && increasing(mem, i)
		}); i >= 0 {
			last := lastValid(mem)
			mins := float64(j.tl.T[j.n-1]-j.tl.T[i]) / 60
			rate, rss := "", ""
			if mins > 0 {
				rate = fmt.Sprintf(", +%s/min", mib((last-at(mem, i))/mins))
			}
			if what != "RSS" {
				rss = fmt.Sprintf(" (RSS %s at the end)", mib(lastValid(j.tl.ServerRSS)))
			}
			fs = append(fs, finding{class: ClassMemory, resource: "server memory", t: i, root: true, prio: 2,
				text: fmt.Sprintf("server memory kept growing: %s %s early in the run, %s from %s, %s at the end%s%s; something is queueing without bound",
					what, mib(base), mib(at(mem, i)), j.clock(i), mib(last), rate, rss)})
		}
	}
	return fs
}

// detectQueue finds the ingest queue full, refusing, or growing: a symptom
// of a store that cannot keep up.
func detectQueue(j *judging) (fs []finding) {
	if i := onset(j.n, func(i int) bool {
		return (at(j.tl.QueueCap, i) > 0 && at(j.tl.QueueRows, i) >= queueSatFrac*at(j.tl.QueueCap, i)) || at(j.tl.RejectedPerS, i) > 0
	}); i >= 0 {
		commit := ""
		if c := mean(j.tl.CommitMs, i, min(j.n, i+10)); !math.IsNaN(c) {
			commit = fmt.Sprintf("; a commit took %.0f ms on average", c)
		}
		fs = append(fs, finding{class: ClassQueue, resource: "ingest queue", t: i, prio: 5,
			text: fmt.Sprintf("the ingest queue filled from %s: %.0f of %.0f rows, %.0f readings/s refused with 503: the store could not commit as fast as readings arrived%s",
				j.clock(i), at(j.tl.QueueRows, i), at(j.tl.QueueCap, i), peak(j.tl.RejectedPerS), commit)})
	} else if i := growth(j.tl.QueueRows, j.tl.QueueCap); i >= 0 {
		fs = append(fs, finding{class: ClassQueue, resource: "ingest queue", t: i, prio: 5,
			text: fmt.Sprintf("the ingest queue kept growing from %s (%.0f rows, %.0f at the end, capacity %.0f): the store could not keep up and would have refused soon",
				j.clock(i), at(j.tl.QueueRows, i), lastValid(j.tl.QueueRows), lastValid(j.tl.QueueCap))})
	}
	return fs
}

// detectLoadGen finds the simulator itself falling behind: a symptom, or a
// measurement made under less than the intended load.
func detectLoadGen(j *judging) (fs []finding) {
	if i := onset(j.n, func(i int) bool { return at(j.tl.LagMs, i) >= lagSatMs }); i >= 0 {
		extra := ""
		if !j.tl.SameProcess && !allNaN(j.tl.SimCPU) {
			extra = fmt.Sprintf(" (its CPU %s)", pct(peak(j.tl.SimCPU)))
		}
		fs = append(fs, finding{class: ClassLoadGen, resource: "simulator", t: i, prio: 6,
			text: fmt.Sprintf("the load generator was the limit: its lag reached %s from %s%s; the load it offered was late, so the server was measured under less than the intended load",
				dur(peak(j.tl.LagMs)), j.clock(i), extra)})
	}

	return fs
}

// noSaturation: either the target held, or the SLO broke with nothing we
// sample at its limit (locks, a single-threaded stage, the network).
func noSaturation(tl *Timeline, clock func(int) string) Verdict {
	n := len(tl.T)
	if tl.SLOP99Ms > 0 {
		if i := onset(n, func(i int) bool { return at(tl.P99Ms, i) > tl.SLOP99Ms }); i >= 0 {
			if v, ok := writerStalls(tl, i, clock); ok {
				return v
			}
			return Verdict{Class: ClassUnexplained, T: tl.T[i], At: atTime(tl, i),
				Text: fmt.Sprintf("p99 %.0f ms broke the SLO (%.0f ms) from %s but no sampled resource saturated: suspect a serialised stage (one SQLite writer, a lock) — see the commit time and the server's log",
					at(tl.P99Ms, i), tl.SLOP99Ms, clock(i))}
		}
	}
	// A p99 over the run above the SLO from spikes too short to count as a
	// saturation (no 3 s in a row) is not a run that held.
	if tl.SLOP99Ms > 0 && tl.P99RunMs > tl.SLOP99Ms {
		return spikes(tl)
	}
	// Failures that no saturated resource explains (a wrong token, a route
	// the server does not have, a server refusing for its own reasons) are
	// the run's result: more than the run's error gate allows (or, with the
	// gate off, more than the swarm's default 0.001) and it did not hold.
	var reqs, errs float64
	for i := range n {
		reqs, errs = reqs+nz(at(tl.Requests, i)), errs+nz(at(tl.Errors, i))
	}
	limit := tl.MaxErrorRate
	if limit < 0 {
		limit = defaultMaxErrorRate
	}
	if errs > 0 && errs > limit*reqs {
		first := 0
		for first < n-1 && nz(at(tl.Errors, first)) == 0 {
			first++
		}
		return Verdict{Class: ClassErrors, T: tl.T[first], At: atTime(tl, first),
			Text: fmt.Sprintf("requests failed with no resource saturated: %.0f of %.0f (%s) from %s, %s; look at the client's configuration and the server's log, not its capacity",
				errs, reqs, ratePct(errs/reqs), clock(first), topKinds(tl.ErrorKinds, 3))}
	}
	if !tl.Sampled {
		return Verdict{Class: ClassNone, Text: "the simulator kept up and nothing it measures saturated; the system was not sampled (no system section in the results), so server resources are unknown"}
	}
	return Verdict{Class: ClassNone, Text: fmt.Sprintf("no resource saturated: the target held (peak CPU: machine %s of %s, server %s)",
		pct(peak(tl.MachineCPU)), pct(100*float64(max(tl.CPUs, 1))), pct(peak(tl.ServerCPU)))}
}

// spikes explains a run whose p99 broke the SLO in seconds that never lasted
// sustainS in a row. A spike in the second a collection of the server's heap
// ended, or the one before or after (the heap falls by a third or more), is
// the collector's: its mark phase takes a share of the CPU and makes the
// goroutines that allocate help it.
func spikes(tl *Timeline) Verdict {
	n := len(tl.T)
	var over, atGC []int
	for i := range n {
		if at(tl.P99Ms, i) > tl.SLOP99Ms {
			over = append(over, i)
		}
	}
	gcAt := func(j int) bool {
		return j >= 1 && j < n && at(tl.ServerHeap, j) < 0.67*at(tl.ServerHeap, j-1)
	}
	var peakHeap, live float64
	for _, i := range over {
		if gcAt(i-1) || gcAt(i) || gcAt(i+1) {
			atGC = append(atGC, i)
			for _, j := range []int{i - 2, i - 1, i} {
				peakHeap = math.Max(peakHeap, nz(at(tl.ServerHeap, j)))
			}
			live = math.Max(live, nz(at(tl.ServerHeapLive, min(i+1, n-1))))
		}
	}
	first := 0
	if len(over) > 0 {
		first = over[0]
	}
	seconds := func(is []int) string {
		var parts []string
		for k, i := range is {
			if k == 4 {
				parts = append(parts, "…")
				break
			}
			parts = append(parts, fmt.Sprintf("t=%ds %.0f ms", tl.T[i], at(tl.P99Ms, i)))
		}
		return strings.Join(parts, ", ")
	}
	if len(over) > 0 && 2*len(atGC) >= len(over) {
		liveTxt := ""
		if live > 0 {
			liveTxt = ", live heap " + mib(live)
		}
		return Verdict{Class: ClassGC, Resource: "server garbage collector", T: tl.T[first], At: atTime(tl, first),
			Text: fmt.Sprintf("p99 %.0f ms over the run broke the SLO (%.0f ms) in short spikes, %d of %d of them in the seconds the server's garbage collector finished a cycle (%s; heap up to %s%s); no resource saturated for %d s — the collector's mark phase, whose work grows with the live heap",
				tl.P99RunMs, tl.SLOP99Ms, len(atGC), len(over), seconds(over), mib(peakHeap), liveTxt, sustainS)}
	}
	if w, ok := pgWork(tl, over); ok {
		return Verdict{Class: w.class, Resource: "PostgreSQL WAL", T: tl.T[first], At: atTime(tl, first),
			Text: fmt.Sprintf("p99 %.0f ms over the run broke the SLO (%.0f ms) in short spikes, %d of %d of them (%s) %s; no resource saturated for %d s — %s",
				tl.P99RunMs, tl.SLOP99Ms, w.hits, len(over), seconds(over), w.what, sustainS, w.advice)}
	}
	return Verdict{Class: ClassUnexplained, T: tl.T[first], At: atTime(tl, first),
		Text: fmt.Sprintf("p99 %.0f ms over the run broke the SLO (%.0f ms) in short spikes (%s) but no sampled resource saturated for %d s: see the report's latency and CPU charts at those seconds, and the server's log",
			tl.P99RunMs, tl.SLOP99Ms, seconds(over), sustainS)}
}

// Store writer stalls: the commits of the seconds the p99 broke the SLO took
// at least stallFactor times the run's median commit (and stallMinMs).
const (
	stallFactor = 5
	stallMinMs  = 10
)

// writerStalls explains a p99 that broke the SLO from second first with no
// machine resource saturated when the store's commits stalled in those
// seconds (or the one before: a stall's slow answers land as it ends):
// the one writer a batch waits for is the serialised stage. For the
// embedded store it says how much of those seconds the writer spent
// merging staged rows.
func writerStalls(tl *Timeline, first int, clock func(int) string) (Verdict, bool) {
	n := len(tl.T)
	var all []float64
	for i := range n {
		if c := at(tl.CommitMs, i); !math.IsNaN(c) {
			all = append(all, c)
		}
	}
	if len(all) < sustainS {
		return Verdict{}, false
	}
	sort.Float64s(all)
	median := all[len(all)/2]
	var broke int
	var stalled []int
	worst, queue, merging, mergeSecs := 0.0, 0.0, 0.0, 0
	for i := first; i < n; i++ {
		if !(at(tl.P99Ms, i) > tl.SLOP99Ms) {
			continue
		}
		broke++
		c := math.Max(nz(at(tl.CommitMs, i)), nz(at(tl.CommitMs, max(i-1, 0))))
		c = math.Max(c, nz(at(tl.CommitMs, min(i+1, n-1))))
		if c < stallFactor*median || c < stallMinMs {
			continue
		}
		stalled = append(stalled, i)
		worst = math.Max(worst, c)
		for _, j := range []int{max(i-1, 0), i, min(i+1, n-1)} {
			queue = math.Max(queue, nz(at(tl.QueueRows, j)))
		}
		if m := math.Max(nz(at(tl.MergeBusy, i)), nz(at(tl.MergeBusy, max(i-1, 0)))); m > 0 {
			merging += m
			mergeSecs++
		}
	}
	// Most of the breaking seconds must coincide with a stall.
	if broke == 0 || 2*len(stalled) < broke {
		return Verdict{}, false
	}
	why := "the one writer every batch waits for (a lock held across a commit, or the store's own work)"
	if !allNaN(tl.MergeBusy) {
		if mergeSecs > 0 {
			why = fmt.Sprintf("the one SQLite writer, held by its merges of staged rows in %d of those %d seconds (%.0f %% of each on average; kettle_sqlite_merge_seconds_total)",
				mergeSecs, len(stalled), 100*merging/float64(mergeSecs))
		} else {
			why = "the one SQLite writer (not merging then: see its checkpoints and the server's log)"
		}
	}
	if w, ok := pgWork(tl, stalled); ok {
		return Verdict{Class: w.class, Resource: "PostgreSQL WAL", T: tl.T[first], At: atTime(tl, first),
			Text: fmt.Sprintf("p99 %.0f ms broke the SLO (%.0f ms) from %s while the store's commits stalled: in %d of the %d seconds over the SLO the mean commit reached up to %.0f ms (median %.1f ms over the run), and %d of those %d came %s; no machine resource saturated — %s",
				at(tl.P99Ms, first), tl.SLOP99Ms, clock(first), len(stalled), broke, worst, median, w.hits, len(stalled), w.what, w.advice)}, true
	}
	return Verdict{Class: ClassStoreWriter, Resource: "store writer", T: tl.T[first], At: atTime(tl, first),
		Text: fmt.Sprintf("p99 %.0f ms broke the SLO (%.0f ms) from %s while the store's commits stalled: in %d of the %d seconds over the SLO the mean commit reached up to %.0f ms (median %.1f ms over the run) and the ingest queue reached %.0f rows; no machine resource saturated — the limit is %s",
			at(tl.P99Ms, first), tl.SLOP99Ms, clock(first), len(stalled), broke, worst, median, queue, why)}, true
}

// pgCause is PostgreSQL work that most of a run's bad seconds coincided
// with: its class, how many of the seconds, what it was and what to do.
type pgCause struct {
	class        string
	hits         int
	what, advice string
}

// pgWork names the PostgreSQL work that most of secs (the seconds the p99
// broke the SLO, or the commits stalled) coincided with: first new WAL
// segment files (in the second, the one after or up to segmentStallS
// before), then a checkpoint's sync phase (its writes ended in the second
// or up to checkpointSyncS before), then a surge of full-page images (a
// checkpoint begun; in the second or a neighbour). Work that is about as common over the whole run
// explains nothing: full-page images flow for minutes after a checkpoint on
// a small database, and a stall from another cause then meets them by
// chance.
func pgWork(tl *Timeline, secs []int) (pgCause, bool) {
	n := len(tl.T)
	if len(secs) == 0 || n == 0 {
		return pgCause{}, false
	}
	// explains: whether hit holds in most episodes of secs (runs of bad
	// seconds at most one apart: one stall makes several), more of them
	// than chance would have it (see byChance); the seconds it holds in.
	explains := func(hit func(int) bool) (int, bool) {
		hits, all, episodes, epHits, counted := 0, 0, 0, 0, false
		for k, i := range secs {
			if k == 0 || i-secs[k-1] > 2 {
				episodes, counted = episodes+1, false
			}
			if hit(i) {
				hits++
				if !counted {
					epHits, counted = epHits+1, true
				}
			}
		}
		for i := range n {
			if hit(i) {
				all++
			}
		}
		return hits, 2*epHits >= episodes && byChance(epHits, episodes, float64(all)/float64(n)) <= chanceMax
	}
	if !allNaN(tl.WALSegmentsPerS) {
		created := sumOf(tl.WALSegmentsPerS)
		// A stall shows when its commits end, as long after the segment
		// switch as the file took to write: seconds on a slow disk.
		if hits, ok := explains(func(i int) bool { return nearMax(tl.WALSegmentsPerS, i, segmentStallS) > 0 }); ok {
			return pgCause{class: ClassWALSegment, hits: hits,
				what:   fmt.Sprintf("as PostgreSQL created a new WAL segment file (%.0f created over the run, %s ready ahead of the one being written)", created, readyText(tl.WALSegmentsReady)),
				advice: "a new segment file is written whole, 16 MiB of zeros (wal_init_zero), while the commits that need its space wait; a cluster in service writes into the files its checkpoints recycled: raise min_wal_size above the WAL written between checkpoints (a young cluster has none to recycle yet), and keep the WAL on a disk that writes 16 MiB fast; wal_init_zero=off only on a copy-on-write file system"}, true
		}
	}
	if !allNaN(tl.CheckpointBufPerS) {
		// The sync phase: a checkpoint's writes ended in the second or up
		// to checkpointSyncS before (they write on, then stop).
		syncEnd := func(i int) bool {
			for j := max(i-checkpointSyncS, 0); j <= i && j+1 < n; j++ {
				// (a missing sample after a writing one is no end)
				if nz(at(tl.CheckpointBufPerS, j)) > 0 && at(tl.CheckpointBufPerS, j+1) == 0 {
					return true
				}
			}
			return false
		}
		if hits, ok := explains(syncEnd); ok {
			return pgCause{class: ClassCheckpoint, hits: hits,
				what:   "as a PostgreSQL checkpoint finished writing its buffers and began its sync phase",
				advice: "the checkpoint fsyncs every file it wrote, and the WAL's fsyncs, which every commit waits for, queue behind that flush; spread checkpoints further apart (checkpoint_timeout, max_wal_size), let the kernel write back sooner (checkpoint_flush_after), or give the WAL a disk of its own"}, true
		}
	}
	fpiMedian := medianOf(tl.FPIPerS)
	if hits, ok := explains(func(i int) bool { _, ok := fpiSurge(tl, fpiMedian, i); return ok }); ok {
		fpiPeak := 0.0
		for _, i := range secs {
			if f, ok := fpiSurge(tl, fpiMedian, i); ok {
				fpiPeak = math.Max(fpiPeak, f)
			}
		}
		return pgCause{class: ClassCheckpoint, hits: hits,
			what:   fmt.Sprintf("while PostgreSQL wrote full-page images at up to %.0f a second (median %.0f over the run)", fpiPeak, fpiMedian),
			advice: "a checkpoint was under way: it writes every dirty page to disk, and every page first written after it began goes into the WAL whole; spread checkpoints further apart (checkpoint_timeout, max_wal_size) or give the WAL a faster disk"}, true
	}
	return pgCause{}, false
}

// byChance is the probability that at least hits of n episodes placed at
// random fall near the work, when a share base of all seconds does (the
// binomial tail, each episode taken as one second). Episodes are neither
// points nor independent, so it is a screen against coincidence, not a
// test of significance.
func byChance(hits, n int, base float64) float64 {
	if base <= 0 {
		return 0
	}
	if base >= 1 {
		return 1
	}
	p := 0.0
	for k := hits; k <= n; k++ {
		lc, _ := math.Lgamma(float64(n + 1))
		lk, _ := math.Lgamma(float64(k + 1))
		lnk, _ := math.Lgamma(float64(n - k + 1))
		p += math.Exp(lc - lk - lnk + float64(k)*math.Log(base) + float64(n-k)*math.Log1p(-base))
	}
	return p
}

// chanceMax is the most byChance may be for work to explain bad seconds.
const chanceMax = 0.1

// checkpointSyncS is how many seconds after a checkpoint's writes end a
// stall is taken as its sync phase's.
const checkpointSyncS = 3

// segmentStallS is how many seconds after a new WAL segment file a stall
// is taken as its.
const segmentStallS = 3

// readyText is how many WAL segment files were ready over the run: "none",
// "0 to 3".
func readyText(xs []Num) string {
	lo, hi := lowest(xs), peak(xs)
	switch {
	case math.IsNaN(hi):
		return "how many unknown"
	case hi == 0:
		return "none"
	}
	return fmt.Sprintf("%.0f to %.0f", lo, hi)
}

// fpiSurge reports whether PostgreSQL wrote full-page images at a surge in
// second i or a neighbour — at least fpiSurgeFactor times the run's median
// rate and fpiSurgeMin a second, as after a checkpoint begins — and the
// highest of those rates. False without the series (SQLite, not scraped).
func fpiSurge(tl *Timeline, median float64, i int) (float64, bool) {
	f := nearMax(tl.FPIPerS, i, 1)
	if math.IsNaN(median) {
		median = 0
	}
	return f, f >= fpiSurgeMin && f >= fpiSurgeFactor*median
}

const (
	fpiSurgeFactor = 2
	fpiSurgeMin    = 50
)

// medianOf is the median of the known values of xs (NaN: none).
func medianOf(xs []Num) float64 {
	var v []float64
	for _, x := range xs {
		if f := float64(x); !math.IsNaN(f) {
			v = append(v, f)
		}
	}
	if len(v) == 0 {
		return math.NaN()
	}
	sort.Float64s(v)
	return v[len(v)/2]
}

// ratePct is an error rate as a percentage, with as many decimals as a
// small one needs.
func ratePct(r float64) string {
	switch {
	case r >= 0.1:
		return fmt.Sprintf("%.0f %%", 100*r)
	case r >= 0.001:
		return fmt.Sprintf("%.2f %%", 100*r)
	}
	return fmt.Sprintf("%.4f %%", 100*r)
}

// topKinds lists the k most frequent error kinds, most frequent first.
func topKinds(kinds map[string]float64, k int) string {
	names := make([]string, 0, len(kinds))
	for name := range kinds {
		names = append(names, name)
	}
	sort.Slice(names, func(a, b int) bool {
		if kinds[names[a]] != kinds[names[b]] {
			return kinds[names[a]] > kinds[names[b]]
		}
		return names[a] < names[b]
	})
	if len(names) == 0 {
		return "kinds not recorded"
	}
	parts := make([]string, 0, k)
	for _, name := range names[:min(k, len(names))] {
		parts = append(parts, fmt.Sprintf("%s %.0f", name, kinds[name]))
	}
	return "by kind: " + strings.Join(parts, ", ")
}

func atTime(tl *Timeline, i int) time.Time {
	if tl.Start.IsZero() {
		return time.Time{}
	}
	return tl.Start.Add(time.Duration(tl.T[i]) * time.Second).UTC()
}

// onset is the first index from which cond holds for sustainS samples in a
// row (or to the end of a shorter run); -1 if never.
func onset(n int, cond func(int) bool) int {
	run := 0
	for i := range n {
		if cond(i) {
			run++
			if run >= sustainS {
				return i - run + 1
			}
		} else {
			run = 0
		}
	}
	if run > 0 && run == n { // a run shorter than the window, saturated throughout
		return 0
	}
	return -1
}

// growth finds a queue that rose for most of the last part of the run: the
// first index, where it starts rising, of a final stretch of ≥ 10 s that
// grew by > 10 % of the capacity overall and fell in under a quarter of its
// steps.
func growth(rows, capacity []Num) int {
	n := len(rows)
	c := lastValid(capacity)
	if n < 10 || c <= 0 {
		return -1
	}
	for start := 0; start+10 <= n; start++ {
		first, last := at(rows, start), lastValid(rows)
		if math.IsNaN(first) || last-first < 0.1*c || !(at(rows, start+1) > first) {
			continue
		}
		start++ // the first second above the level it grew from
		falls := 0
		for i := start; i < n; i++ {
			if at(rows, i) < at(rows, i-1) {
				falls++
			}
		}
		if falls*4 < n-start {
			return start
		}
	}
	return -1
}

func at(xs []Num, i int) float64 {
	if i < 0 || i >= len(xs) {
		return math.NaN()
	}
	return float64(xs[i])
}

func mean(xs []Num, i, j int) float64 {
	var s float64
	k := 0
	for ; i < j && i < len(xs); i++ {
		if v := float64(xs[i]); !math.IsNaN(v) {
			s += v
			k++
		}
	}
	if k == 0 {
		return math.NaN()
	}
	return s / float64(k)
}

// nearMax is the most of xs (missing values as 0) from back seconds before
// i to the one after it.
func nearMax(xs []Num, i, back int) float64 {
	m := 0.0
	for j := max(i-back, 0); j <= min(i+1, len(xs)-1); j++ {
		m = math.Max(m, nz(at(xs, j)))
	}
	return m
}

// sumOf is the sum of the known values of xs.
func sumOf(xs []Num) float64 {
	var t float64
	for i := range xs {
		t += nz(at(xs, i))
	}
	return t
}

// lowest is the least known value of xs (NaN: none).
func lowest(xs []Num) float64 {
	m := math.NaN()
	for _, x := range xs {
		if v := float64(x); !math.IsNaN(v) && (math.IsNaN(m) || v < m) {
			m = v
		}
	}
	return m
}

func peak(xs []Num) float64 {
	m := math.NaN()
	for _, x := range xs {
		if v := float64(x); !math.IsNaN(v) && (math.IsNaN(m) || v > m) {
			m = v
		}
	}
	return m
}

func slice(xs []Num, i, j int) []Num {
	if i >= len(xs) {
		return nil
	}
	return xs[i:min(j, len(xs))]
}

func allNaN(xs []Num) bool { return math.IsNaN(peak(xs)) }

func lastValid(xs []Num) float64 {
	for i := len(xs) - 1; i >= 0; i-- {
		if v := float64(xs[i]); !math.IsNaN(v) {
			return v
		}
	}
	return math.NaN()
}

// increasing: the series is higher at i than 5 s before (growth, not a spike).
func increasing(xs []Num, i int) bool {
	return i >= 5 && at(xs, i) > at(xs, i-5)
}

func pct(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.0f %%", v)
}

func mib(b float64) string {
	if math.IsNaN(b) {
		return "n/a"
	}
	return fmt.Sprintf("%.0f MiB", b/(1<<20))
}

func dur(ms float64) string {
	if ms >= 1000 {
		return fmt.Sprintf("%.1f s", ms/1000)
	}
	return fmt.Sprintf("%.0f ms", ms)
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}
