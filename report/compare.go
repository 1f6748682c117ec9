package report

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// Statuses of a compared figure.
const (
	Regressed   = "regressed"
	Improved    = "improved"
	WithinNoise = "within noise"
	NotMeasured = "not measured"
)

// Comparison is a candidate run (B) against a baseline (A), figure by
// figure: what kettle report --baseline writes as JSON and shows as a page.
type Comparison struct {
	Title     string  `json:"title"`
	Baseline  RunInfo `json:"baseline"`
	Candidate RunInfo `json:"candidate"`
	// Caveats are differences between the runs' parameters (the figures
	// then compare more than one build against another) and other reasons
	// to read the figures with care.
	Caveats    []string `json:"caveats,omitempty"`
	Confidence float64  `json:"confidence"`
	Resamples  int      `json:"resamples"`
	BlockS     int      `json:"block_s"` // bootstrap block length, seconds
	Figures    []Figure `json:"figures"`
	Regressed  []string `json:"regressed,omitempty"` // figure names
	Improved   []string `json:"improved,omitempty"`
	// Failed: a figure whose rule fails the comparison regressed (the exit
	// code of kettle report --baseline).
	Failed bool   `json:"failed"`
	Line   string `json:"line"`

	rules  *Thresholds
	sa, sb *Summary // the runs' reports, for the page's charts
}

// RunInfo is one side of a comparison.
type RunInfo struct {
	Path    string    `json:"path,omitempty"`
	Command string    `json:"command"`
	Start   time.Time `json:"start"`
	Devices int       `json:"devices"`
	// SteadyFrom is the first second compared (after hatching), Seconds
	// how many are.
	SteadyFrom   int        `json:"steady_from"`
	Seconds      int        `json:"seconds"`
	Verdict      Verdict    `json:"verdict"`
	Audit        *sim.Audit `json:"audit,omitempty"`
	AuditSkipped string     `json:"audit_skipped,omitempty"`
	Params       sim.Params `json:"params"`
}

// Figure is one compared figure.
type Figure struct {
	Name    string `json:"name"` // SUBJECT.MEASURE, the thresholds file's key
	Subject string `json:"subject"`
	Measure string `json:"measure"`
	Unit    string `json:"unit"`
	// A and B are the figure in each run (over its steady seconds).
	A Num `json:"a"`
	B Num `json:"b"`
	// Kind is "ratio" (Estimate = B/A) or "delta" (B−A); "check" for the
	// audit and the USE verdict, which have no estimate.
	Kind     string `json:"kind"`
	Estimate Num    `json:"estimate"`
	Lo       Num    `json:"lo"` // the estimate's confidence interval
	Hi       Num    `json:"hi"`
	Status   string `json:"status"`
	// Fail: a regression of this figure fails the comparison.
	Fail  bool   `json:"fail"`
	Bound string `json:"bound,omitempty"` // the rule, in words
	Text  string `json:"text"`
}

// CompareOptions tune Compare.
type CompareOptions struct {
	Title string
	// BaselinePath and CandidatePath are shown on the page.
	BaselinePath, CandidatePath string
	// Seed of the bootstrap (0: 1); the same seed gives the same page.
	Seed uint64
}

// Compare compares candidate (B) with baseline (A) under th (nil: the
// defaults).
func Compare(a, b *sim.Results, th *Thresholds, o CompareOptions) (*Comparison, error) {
	if th == nil {
		th = DefaultThresholds()
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	ra, err := newRunData(a)
	if err != nil {
		return nil, fmt.Errorf("baseline: %w", err)
	}
	rb, err := newRunData(b)
	if err != nil {
		return nil, fmt.Errorf("candidate: %w", err)
	}
	c := &Comparison{Title: o.Title, Confidence: th.Confidence, Resamples: th.Resamples, BlockS: blockS,
		Baseline: ra.info(o.BaselinePath), Candidate: rb.info(o.CandidatePath), rules: th, sa: ra.s, sb: rb.s}
	if c.Title == "" {
		c.Title = fmt.Sprintf("kettle report: %s against the baseline of %s",
			b.Start.UTC().Format("2006-01-02 15:04"), a.Start.UTC().Format("2006-01-02 15:04"))
	}
	c.Caveats = caveats(ra, rb)

	// add compares the figures subject.measures, computed by fa and fb.
	add := func(subject string, measures []string, unit, kind string, fa, fb stat) {
		var fs []Figure
		var rules []*Rule
		for _, m := range measures {
			name := subject + "." + m
			r := th.rule(name)
			fs = append(fs, Figure{Name: name, Subject: subject, Measure: m, Unit: unit, Kind: kind,
				Fail: r == nil || r.Fail == nil || *r.Fail, A: nan, B: nan, Estimate: nan, Lo: nan, Hi: nan, Status: NotMeasured})
			rules = append(rules, r)
		}
		if fa != nil && fb != nil && ra.n > 0 && rb.n > 0 {
			h := fnv.New64a()
			h.Write([]byte(subject + "." + strings.Join(measures, ",")))
			rng := rand.New(rand.NewPCG(o.Seed, h.Sum64()))
			for j, bs := range ratioCI(rng, th.Resamples, th.Confidence, ra.n, rb.n, fa, fb, len(measures), kind == "delta") {
				f := &fs[j]
				f.A, f.B, f.Estimate, f.Lo, f.Hi = Num(bs.a), Num(bs.b), Num(bs.est), Num(bs.lo), Num(bs.hi)
				f.Status, f.Bound = judgeFigure(kind, bs.est, bs.lo, bs.hi, rules[j])
			}
		} else {
			one := func(st stat, n int, dst *Num) {
				if st != nil && n > 0 {
					v := make([]float64, len(measures))
					st(all(n), v)
					*dst = Num(v[0])
				}
			}
			if len(measures) == 1 {
				one(fa, ra.n, &fs[0].A)
				one(fb, rb.n, &fs[0].B)
			}
		}
		for j := range fs {
			if rules[j] != nil && rules[j].Ignore {
				continue
			}
			fs[j].Text = figureText(&fs[j], th.Confidence)
			c.Figures = append(c.Figures, fs[j])
		}
	}

	// Endpoints, in the order the report lists them.
	eps := map[string]bool{}
	for name := range ra.hist {
		eps[name] = true
	}
	for name := range rb.hist {
		eps[name] = true
	}
	names := make([]string, 0, len(eps))
	for n := range eps {
		names = append(names, n)
	}
	sort.Strings(names)
	pcts := []float64{50, 99, 99.9}
	for _, ep := range names {
		add(ep, []string{"p50", "p99", "p99.9"}, "ms", "ratio", ra.quantiles(ep, pcts), rb.quantiles(ep, pcts))
		add(ep, []string{"req_per_s"}, "req/s", "ratio", ra.mean(ra.req[ep]), rb.mean(rb.req[ep]))
		add(ep, []string{"error_rate"}, "", "delta", ra.errorRate(ep), rb.errorRate(ep))
	}
	add("server", []string{"cpu_us_per_request"}, "µs", "ratio", ra.perRequest(ra.serverCPU), rb.perRequest(rb.serverCPU))
	add("server", []string{"rss_per_kettle"}, "bytes", "ratio", ra.perKettle(ra.serverRSS), rb.perKettle(rb.serverRSS))
	add("simulator", []string{"cpu_us_per_request"}, "µs", "ratio", ra.perRequest(ra.simCPU), rb.perRequest(rb.simCPU))
	add("simulator", []string{"rss_per_kettle"}, "bytes", "ratio", ra.perKettle(ra.simRSS), rb.perKettle(rb.simRSS))
	c.checks(th)

	var fails []string
	for _, f := range c.Figures {
		switch f.Status {
		case Regressed:
			c.Regressed = append(c.Regressed, f.Name)
			if f.Fail {
				c.Failed = true
				fails = append(fails, f.Name)
			}
		case Improved:
			c.Improved = append(c.Improved, f.Name)
		}
	}
	c.Line = c.line(fails)
	return c, nil
}

// checks adds the audit and the USE verdicts, side by side.
func (c *Comparison) checks(th *Thresholds) {
	check := func(name, text, status string) {
		r := th.rule(name)
		if r != nil && r.Ignore {
			return
		}
		c.Figures = append(c.Figures, Figure{Name: name, Subject: "run", Measure: strings.TrimPrefix(name, "run."), Kind: "check",
			A: nan, B: nan, Estimate: nan, Lo: nan, Hi: nan, Status: status, Fail: r == nil || r.Fail == nil || *r.Fail, Text: text})
	}
	va, vb := c.Baseline.Verdict, c.Candidate.Verdict
	st := WithinNoise
	switch {
	case va.Class == ClassNone && vb.Class != ClassNone:
		st = Regressed
	case va.Class != ClassNone && vb.Class == ClassNone:
		st = Improved
	}
	check("run.verdict", fmt.Sprintf("USE verdict: A %s, B %s", va.Class, vb.Class), st)

	bad := func(a *sim.Audit) bool { return a != nil && (a.Lost > 0 || a.Duplicated > 0) }
	aa, ab := c.Baseline.Audit, c.Candidate.Audit
	st = WithinNoise
	switch {
	case ab == nil:
		st = NotMeasured
	case bad(ab) && !bad(aa):
		st = Regressed
	case !bad(ab) && bad(aa):
		st = Improved
	}
	line := func(a *sim.Audit, skipped string) string {
		switch {
		case a != nil:
			return fmt.Sprintf("lost %d, duplicated %d", a.Lost, a.Duplicated)
		case skipped != "":
			return "skipped"
		}
		return "not run"
	}
	check("run.audit", fmt.Sprintf("audit: A %s; B %s", line(aa, c.Baseline.AuditSkipped), line(ab, c.Candidate.AuditSkipped)), st)
}

func (c *Comparison) line(fails []string) string {
	n := len(c.Figures)
	switch {
	case len(fails) > 0:
		return fmt.Sprintf("regressed: %s (%d of %d figures beyond their threshold and the runs' noise)", strings.Join(c.describe(fails), ", "), len(fails), n)
	case len(c.Regressed) > 0:
		return fmt.Sprintf("passed: only figures that do not fail regressed (%s); %d figures compared", strings.Join(c.describe(c.Regressed), ", "), n)
	case len(c.Improved) > 0:
		return fmt.Sprintf("improved: %s; nothing regressed (%d figures)", strings.Join(c.describe(c.Improved), ", "), n)
	}
	return fmt.Sprintf("within noise: no figure moved beyond its threshold and the runs' noise (%d figures)", n)
}

func (c *Comparison) describe(names []string) []string {
	var out []string
	for _, n := range names {
		for _, f := range c.Figures {
			if f.Name == n {
				out = append(out, strings.TrimSpace(n+" "+change(&f)))
			}
		}
	}
	return out
}

// change is a figure's estimate in words: ×1.26, +0.0012, or its check.
func change(f *Figure) string {
	switch f.Kind {
	case "ratio":
		return "×" + sig(float64(f.Estimate))
	case "delta":
		return fmt.Sprintf("%+.4f", float64(f.Estimate))
	}
	return ""
}

// judgeFigure applies a rule to an estimate and its interval.
func judgeFigure(kind string, est, lo, hi float64, r *Rule) (status, bound string) {
	if math.IsNaN(est) || math.IsInf(est, 0) || math.IsNaN(lo) {
		return NotMeasured, ""
	}
	if r == nil {
		r = &Rule{}
	}
	var b []string
	status = WithinNoise
	switch {
	case kind == "delta":
		if v := r.RegressIfDeltaOver; v != nil {
			b = append(b, fmt.Sprintf("regressed above %+g", *v))
			if est > *v && lo > 0 {
				status = Regressed
			}
		}
		if v := r.ImproveIfDeltaOver; v != nil {
			b = append(b, fmt.Sprintf("improved below %+g", -*v))
			if est < -*v && hi < 0 {
				status = Improved
			}
		}
	case r.RegressIfRatioUnder != nil || r.ImproveIfRatioOver != nil: // lower is worse
		if v := r.RegressIfRatioUnder; v != nil {
			b = append(b, "regressed below ×"+sig(*v))
			if est < *v && hi < 1 {
				status = Regressed
			}
		}
		if v := r.ImproveIfRatioOver; v != nil {
			b = append(b, "improved above ×"+sig(*v))
			if est > *v && lo > 1 {
				status = Improved
			}
		}
	default:
		if v := r.RegressIfRatioOver; v != nil {
			b = append(b, "regressed above ×"+sig(*v))
			if est > *v && lo > 1 {
				status = Regressed
			}
		}
		if v := r.ImproveIfRatioUnder; v != nil {
			b = append(b, "improved below ×"+sig(*v))
			if est < *v && hi < 1 {
				status = Improved
			}
		}
	}
	if len(b) == 0 {
		b = append(b, "no bound: reported only")
	}
	return status, strings.Join(b, ", ")
}

// sig formats a ratio with 3 significant digits.
func sig(v float64) string { return fmt.Sprintf("%.3g", v) }

func figureText(f *Figure, conf float64) string {
	if f.Kind == "check" {
		return f.Text
	}
	val := func(v Num) string {
		x := float64(v)
		switch {
		case math.IsNaN(x):
			return "—"
		case f.Unit == "bytes":
			return fmt.Sprintf("%.1f KiB", x/1024)
		case f.Unit == "":
			return fmt.Sprintf("%.5f", x)
		case x >= 100:
			return fmt.Sprintf("%.0f %s", x, f.Unit)
		}
		return fmt.Sprintf("%.3g %s", x, f.Unit)
	}
	s := fmt.Sprintf("%s: %s → %s", f.Name, val(f.A), val(f.B))
	if f.Status == NotMeasured {
		return s + ": not measured in both runs"
	}
	switch f.Kind {
	case "ratio":
		s += fmt.Sprintf(", %s (%.0f%% CI ×%s–×%s)", change(f), 100*conf, sig(float64(f.Lo)), sig(float64(f.Hi)))
	case "delta":
		s += fmt.Sprintf(", %s (%.0f%% CI %+.4f to %+.4f)", change(f), 100*conf, float64(f.Lo), float64(f.Hi))
	}
	return s + ": " + f.Status
}

// runData is one run's per-second figures over its steady part.
type runData struct {
	r    *sim.Results
	s    *Summary
	from int // index of the first steady second
	n    int // steady seconds
	hist map[string]*secondsHist
	req  map[string][]float64 // completed per second, by endpoint
	errs map[string][]float64
	// All endpoints' completed requests; CPU seconds used in the second
	// (NaN: not sampled); resident bytes; kettles.
	allReq            []float64
	serverCPU, simCPU []float64
	serverRSS, simRSS []float64
	kettles           []float64
}

func newRunData(r *sim.Results) (*runData, error) {
	s, err := Build(r, Options{})
	if err != nil {
		return nil, err
	}
	d := &runData{r: r, s: s, hist: map[string]*secondsHist{}, req: map[string][]float64{}, errs: map[string][]float64{}}
	// The steady part, as the swarm's per-second means count it: from the
	// second after the last kettle hatched.
	if p := r.Params; p.HatchRate > 0 {
		d.from = int(float64(p.Devices)/p.HatchRate) + 1
	}
	if d.from >= len(r.Seconds)-1 {
		d.from = 0
	}
	secs := r.Seconds[d.from:]
	d.n = len(secs)
	enc := map[string][]string{}
	for i, sec := range secs {
		for name, e := range sec.Endpoints {
			if enc[name] == nil {
				enc[name] = make([]string, d.n)
				d.req[name] = make([]float64, d.n)
				d.errs[name] = make([]float64, d.n)
			}
			enc[name][i] = e.Histogram
			d.req[name][i] = float64(e.Requests)
			for _, c := range e.Errors {
				d.errs[name][i] += float64(c)
			}
		}
	}
	for name, es := range enc {
		if d.sum(d.req[name], all(d.n)) == 0 {
			delete(d.req, name)
			continue
		}
		if d.hist[name], err = newSecondsHist(es); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	d.allReq, d.kettles = make([]float64, d.n), make([]float64, d.n)
	d.simCPU, d.simRSS = make([]float64, d.n), make([]float64, d.n)
	for i, sec := range secs {
		for _, e := range sec.Endpoints {
			d.allReq[i] += float64(e.Requests)
		}
		d.kettles[i] = float64(sec.Kettles)
		d.simRSS[i] = float64(sec.RSSBytes)
		if j := d.from + i; j > 0 {
			d.simCPU[i] = sec.CPUSeconds - r.Seconds[j-1].CPUSeconds
		} else {
			d.simCPU[i] = math.NaN()
		}
	}
	if s.Params.InProcessNote != "" || (r.System != nil && r.System.SameProcess) {
		// The simulator's process is the server's too (kettle demo): its
		// CPU and memory are the server's figures, not the lab's.
		d.serverCPU, d.serverRSS = d.simCPU, d.simRSS
		d.simCPU, d.simRSS = nil, nil
		return d, nil
	}
	if xs := s.Series.CPU[sysstat.RoleServer]; !allNaN(xs) {
		d.serverCPU = make([]float64, d.n)
		for i := range d.serverCPU {
			d.serverCPU[i] = float64(xs[d.from+i]) / 100
		}
	}
	if xs := s.Series.RSSMiB[sysstat.RoleServer]; !allNaN(xs) {
		d.serverRSS = make([]float64, d.n)
		for i := range d.serverRSS {
			d.serverRSS[i] = float64(xs[d.from+i]) * (1 << 20)
		}
	}
	return d, nil
}

func (d *runData) info(path string) RunInfo {
	i := RunInfo{Path: path, Command: d.r.Command, Start: d.r.Start, Devices: d.r.Params.Devices, Params: d.r.Params,
		Verdict: d.s.Verdict, Audit: d.r.Audit, AuditSkipped: d.r.AuditSkipped, Seconds: d.n}
	if d.n > 0 {
		i.SteadyFrom = d.r.Seconds[d.from].T
	}
	return i
}

func (d *runData) sum(xs []float64, secs []int) float64 {
	var s float64
	for _, i := range secs {
		s += xs[i]
	}
	return s
}

// quantiles are an endpoint's percentiles ps (ascending), in ms.
func (d *runData) quantiles(ep string, ps []float64) stat {
	h := d.hist[ep]
	if h == nil {
		return nil
	}
	counts := make([]int64, len(h.values))
	return func(secs []int, out []float64) { h.quantiles(secs, ps, counts, out) }
}

func (d *runData) mean(xs []float64) stat {
	if xs == nil {
		return nil
	}
	return scalar(func(secs []int) float64 { return d.sum(xs, secs) / float64(len(secs)) })
}

func (d *runData) errorRate(ep string) stat {
	req, errs := d.req[ep], d.errs[ep]
	if req == nil {
		return nil
	}
	return scalar(func(secs []int) float64 {
		n := d.sum(req, secs)
		if n == 0 {
			return math.NaN()
		}
		return d.sum(errs, secs) / n
	})
}

// perRequest is CPU µs per completed request over the seconds where the
// CPU was sampled.
func (d *runData) perRequest(cpu []float64) stat {
	if cpu == nil || allNaNf(cpu) {
		return nil
	}
	return scalar(func(secs []int) float64 {
		var c, n float64
		for _, i := range secs {
			if !math.IsNaN(cpu[i]) {
				c += cpu[i]
				n += d.allReq[i]
			}
		}
		if n == 0 {
			return math.NaN()
		}
		return c / n * 1e6
	})
}

// perKettle is the mean of resident bytes per started kettle.
func (d *runData) perKettle(rss []float64) stat {
	if rss == nil || allNaNf(rss) {
		return nil
	}
	return scalar(func(secs []int) float64 {
		var s float64
		var n int
		for _, i := range secs {
			if !math.IsNaN(rss[i]) && rss[i] > 0 && d.kettles[i] > 0 {
				s += rss[i] / d.kettles[i]
				n++
			}
		}
		if n == 0 {
			return math.NaN()
		}
		return s / float64(n)
	})
}

func allNaNf(xs []float64) bool {
	return !slices.ContainsFunc(xs, func(x float64) bool { return !math.IsNaN(x) })
}

// caveats names what differs between the runs' parameters, and runs too
// short for the bootstrap to say much.
func caveats(a, b *runData) []string {
	var out []string
	pa, pb := a.r.Params, b.r.Params
	diff := func(name string, x, y any) {
		if fmt.Sprint(x) != fmt.Sprint(y) {
			out = append(out, fmt.Sprintf("%s differs: %v in A, %v in B", name, x, y))
		}
	}
	diff("kettles", pa.Devices, pb.Devices)
	diff("interval", pa.IntervalS, pb.IntervalS)
	diff("protocol", pa.API+" "+pa.Protocol, pb.API+" "+pb.Protocol)
	diff("batch", pa.Batch, pb.Batch)
	diff("connections", pa.ConnMode, pb.ConnMode)
	diff("hatch rate", pa.HatchRate, pb.HatchRate)
	diff("duration (s)", pa.DurationS, pb.DurationS)
	diff("GOMAXPROCS", pa.GOMAXPROCS, pb.GOMAXPROCS)
	for _, d := range []struct {
		name string
		r    *runData
	}{{"A", a}, {"B", b}} {
		if d.r.n < 4*blockS {
			out = append(out, fmt.Sprintf("run %s has %d steady seconds: the intervals are wide (run at least %d s after hatching)", d.name, d.r.n, 4*blockS))
		}
		// The interval is the noise within a run; neighbours that come and
		// go between runs move every figure at once (the simulator's CPU
		// per request with them).
		if d.r.s.Verdict.Class == ClassMachineCPU {
			out = append(out, fmt.Sprintf("in run %s other processes held the machine's CPU (its verdict: %s): its figures measure them too", d.name, d.r.s.Verdict.Class))
		}
	}
	return out
}
