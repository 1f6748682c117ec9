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
	// Method is how the intervals are read: "block-bootstrap" over the
	// seconds of one run a side, or "runs" (Student's t over the runs'
	// figures) when a side has several runs.
	Method    string   `json:"method"`
	Resamples int      `json:"resamples"`
	BlockS    int      `json:"block_s"` // bootstrap block length, seconds
	Figures   []Figure `json:"figures"`
	Regressed []string `json:"regressed,omitempty"` // figure names
	Improved  []string `json:"improved,omitempty"`
	// Failed: a figure whose rule fails the comparison regressed (the exit
	// code of kettle report --baseline).
	Failed bool   `json:"failed"`
	Line   string `json:"line"`

	rules  *Thresholds
	sa, sb *Summary // the runs' reports, for the page's charts
}

// RunInfo is one side of a comparison: its first run, and with several
// runs (rounds of the same build) each of them in Runs.
type RunInfo struct {
	Path    string    `json:"path,omitempty"`
	Command string    `json:"command"`
	Start   time.Time `json:"start"`
	Devices int       `json:"devices"`
	// SteadyFrom is the first second compared (after hatching), Seconds
	// how many are.
	SteadyFrom   int        `json:"steady_from"`
	Seconds      int        `json:"seconds"`
	Runs         []RunInfo  `json:"runs,omitempty"`
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
	return CompareRuns([]*sim.Results{a}, []*sim.Results{b}, th, o)
}

// CompareRuns compares runs of the candidate build (bs) with runs of the
// baseline build (as): rounds, each side's runs made alike. With one run a
// side each figure's interval is the moving-block bootstrap over the two
// runs' seconds; with more, each run's figure is one observation and the
// interval is the spread between runs (acrossRuns), which is what moves
// two runs of one build apart on a shared machine. BaselinePath and
// CandidatePath name the sides' first runs.
func CompareRuns(as, bs []*sim.Results, th *Thresholds, o CompareOptions) (*Comparison, error) {
	if len(as) == 0 || len(bs) == 0 {
		return nil, fmt.Errorf("compare: %d baseline and %d candidate runs, want at least one of each", len(as), len(bs))
	}
	if th == nil {
		th = DefaultThresholds()
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	ras, err := runSide("baseline", as)
	if err != nil {
		return nil, err
	}
	rbs, err := runSide("candidate", bs)
	if err != nil {
		return nil, err
	}
	ra, rb := ras[0], rbs[0]
	pooled := len(ras) > 1 || len(rbs) > 1
	c := &Comparison{Title: o.Title, Confidence: th.Confidence, Method: "block-bootstrap", Resamples: th.Resamples, BlockS: blockS,
		Baseline: sideInfo(ras, o.BaselinePath), Candidate: sideInfo(rbs, o.CandidatePath), rules: th, sa: ra.s, sb: rb.s}
	if pooled {
		c.Method, c.Resamples, c.BlockS = "runs", 0, 0
	}
	if c.Title == "" {
		c.Title = fmt.Sprintf("kettle report: %s against the baseline of %s",
			bs[0].Start.UTC().Format("2006-01-02 15:04"), as[0].Start.UTC().Format("2006-01-02 15:04"))
		if pooled {
			c.Title = fmt.Sprintf("kettle report: %d runs from %s against %d baseline runs from %s", len(bs),
				bs[0].Start.UTC().Format("2006-01-02 15:04"), len(as), as[0].Start.UTC().Format("2006-01-02 15:04"))
		}
	}
	c.Caveats = caveats(ras, rbs)

	k := &comparer{c: c, th: th, seed: o.Seed, ras: ras, rbs: rbs, pooled: pooled}
	add := k.add

	// Endpoints, in the order the report lists them.
	eps := map[string]bool{}
	for _, d := range append(slices.Clone(ras), rbs...) {
		for name := range d.hist {
			eps[name] = true
		}
	}
	names := make([]string, 0, len(eps))
	for n := range eps {
		names = append(names, n)
	}
	sort.Strings(names)
	pcts := []float64{50, 99, 99.9}
	for _, ep := range names {
		add(ep, []string{"p50", "p99", "p99.9"}, "ms", "ratio", func(d *runData) stat { return d.quantiles(ep, pcts) })
		add(ep, []string{"req_per_s"}, "req/s", "ratio", func(d *runData) stat { return d.mean(d.req[ep]) })
		add(ep, []string{"error_rate"}, "", "delta", func(d *runData) stat { return d.errorRate(ep) })
	}
	add("server", []string{"cpu_us_per_request"}, "µs", "ratio", func(d *runData) stat { return d.perRequest(d.serverCPU) })
	add("server", []string{"rss_per_kettle"}, "bytes", "ratio", func(d *runData) stat { return d.perKettle(d.serverRSS) })
	add("simulator", []string{"cpu_us_per_request"}, "µs", "ratio", func(d *runData) stat { return d.perRequest(d.simCPU) })
	add("simulator", []string{"rss_per_kettle"}, "bytes", "ratio", func(d *runData) stat { return d.perKettle(d.simRSS) })
	c.checks(th, ras, rbs)

	c.Line = c.line(c.tally())
	return c, nil
}

// comparer adds figures to a comparison of two sides' runs.
type comparer struct {
	c        *Comparison
	th       *Thresholds
	seed     uint64
	ras, rbs []*runData
	pooled   bool
}

// add compares the figures subject.measures, computed in a run by the
// stat mk gives for it (nil: not measured in that run).
func (k *comparer) add(subject string, measures []string, unit, kind string, mk func(d *runData) stat) {
	ra, rb := k.ras[0], k.rbs[0]
	fa, fb := mk(ra), mk(rb)
	var fs []Figure
	var rules []*Rule
	for _, m := range measures {
		name := subject + "." + m
		r := k.th.rule(name)
		fs = append(fs, Figure{Name: name, Subject: subject, Measure: m, Unit: unit, Kind: kind,
			Fail: r == nil || r.Fail == nil || *r.Fail, A: nan, B: nan, Estimate: nan, Lo: nan, Hi: nan, Status: NotMeasured})
		rules = append(rules, r)
	}
	if k.pooled {
		// Each run's figures, all its steady seconds once.
		values := func(ds []*runData) [][]float64 {
			vs := make([][]float64, len(measures))
			for _, d := range ds {
				v := make([]float64, len(measures))
				for j := range v {
					v[j] = math.NaN()
				}
				if st := mk(d); st != nil && d.n > 0 {
					st(all(d.n), v)
				}
				for j := range vs {
					vs[j] = append(vs[j], v[j])
				}
			}
			return vs
		}
		xa, xb := values(k.ras), values(k.rbs)
		for j := range fs {
			bs := acrossRuns(xa[j], xb[j], k.th.Confidence, kind == "delta")
			f := &fs[j]
			f.A, f.B, f.Estimate, f.Lo, f.Hi = Num(bs.a), Num(bs.b), Num(bs.est), Num(bs.lo), Num(bs.hi)
			f.Status, f.Bound = judgeFigure(kind, bs.est, bs.lo, bs.hi, rules[j])
		}
	} else if fa != nil && fb != nil && ra.n > 0 && rb.n > 0 {
		h := fnv.New64a()
		h.Write([]byte(subject + "." + strings.Join(measures, ",")))
		rng := rand.New(rand.NewPCG(k.seed, h.Sum64()))
		for j, bs := range ratioCI(rng, k.th.Resamples, k.th.Confidence, ra.n, rb.n, fa, fb, len(measures), kind == "delta") {
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
		fs[j].Text = figureText(&fs[j], k.th.Confidence)
		k.c.Figures = append(k.c.Figures, fs[j])
	}
}

// tally sorts the figures into regressed and improved, marks the
// comparison failed when a figure that fails the build regressed, and
// returns those figures' names.
func (c *Comparison) tally() []string {
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
	return fails
}

// runSide reads one side's runs (what: "baseline" or "candidate").
func runSide(what string, rs []*sim.Results) ([]*runData, error) {
	var ds []*runData
	for i, r := range rs {
		d, err := newRunData(r)
		if err != nil {
			if len(rs) > 1 {
				return nil, fmt.Errorf("%s run %d: %w", what, i+1, err)
			}
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		ds = append(ds, d)
	}
	return ds, nil
}

// checks adds the audit and the USE verdicts, side by side. With several
// runs a side, the verdict moved only when every run of a side agrees (no
// baseline run saturated and every candidate run did: regressed); a lost
// or duplicated reading in any run counts.
func (c *Comparison) checks(th *Thresholds, as, bs []*runData) {
	check := func(name, text, status string) {
		r := th.rule(name)
		if r != nil && r.Ignore {
			return
		}
		c.Figures = append(c.Figures, Figure{Name: name, Subject: "run", Measure: strings.TrimPrefix(name, "run."), Kind: "check",
			A: nan, B: nan, Estimate: nan, Lo: nan, Hi: nan, Status: status, Fail: r == nil || r.Fail == nil || *r.Fail, Text: text})
	}
	classes := func(ds []*runData) (names string, none, all bool) {
		var cs []string
		none, all = true, true
		for _, d := range ds {
			cl := d.s.Verdict.Class
			cs = append(cs, cl)
			none = none && cl == ClassNone
			all = all && cl != ClassNone
		}
		return strings.Join(cs, ", "), none, all
	}
	ca, noneA, allA := classes(as)
	cb, noneB, allB := classes(bs)
	st := WithinNoise
	switch {
	case noneA && allB:
		st = Regressed
	case allA && noneB:
		st = Improved
	}
	check("run.verdict", fmt.Sprintf("USE verdict: A %s, B %s", ca, cb), st)

	// audits sums a side's audits: whether any run lost or duplicated, and
	// how many runs had none.
	type audits struct {
		lost, dup        int64
		audited, skipped int
	}
	sum := func(ds []*runData) (a audits) {
		for _, d := range ds {
			switch {
			case d.r.Audit != nil:
				a.audited++
				a.lost += d.r.Audit.Lost
				a.dup += d.r.Audit.Duplicated
			case d.r.AuditSkipped != "":
				a.skipped++
			}
		}
		return a
	}
	aa, ab := sum(as), sum(bs)
	bad := func(a audits) bool { return a.lost > 0 || a.dup > 0 }
	st = WithinNoise
	switch {
	case ab.audited == 0:
		st = NotMeasured
	case bad(ab) && !bad(aa):
		st = Regressed
	case !bad(ab) && bad(aa):
		st = Improved
	}
	line := func(a audits, runs int) string {
		var s string
		switch {
		case a.audited > 0:
			s = fmt.Sprintf("lost %d, duplicated %d", a.lost, a.dup)
		case a.skipped > 0:
			return "skipped"
		default:
			return "not run"
		}
		if runs > 1 {
			s = fmt.Sprintf("%s (%d of %d runs audited)", s, a.audited, runs)
		}
		return s
	}
	check("run.audit", fmt.Sprintf("audit: A %s; B %s", line(aa, len(as)), line(ab, len(bs))), st)
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

// sideInfo is a side's first run, with every run in Runs and their steady
// seconds summed when there are several. paths is the side's results
// files, comma-separated.
func sideInfo(ds []*runData, paths string) RunInfo {
	ps := strings.Split(paths, ",")
	path := func(i int) string {
		if i < len(ps) {
			return ps[i]
		}
		return ""
	}
	i := ds[0].info(path(0))
	if len(ds) == 1 {
		i.Path = paths
		return i
	}
	i.Seconds = 0
	for k, d := range ds {
		i.Runs = append(i.Runs, d.info(path(k)))
		i.Seconds += d.n
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
// short for the bootstrap to say much. Runs are named A and B, or A1, A2,
// … B1, … when a side has several.
func caveats(as, bs []*runData) []string {
	type named struct {
		name string
		r    *runData
	}
	var runs []named
	for _, s := range []struct {
		side string
		ds   []*runData
	}{{"A", as}, {"B", bs}} {
		for i, d := range s.ds {
			n := s.side
			if len(s.ds) > 1 {
				n = fmt.Sprintf("%s%d", s.side, i+1)
			}
			runs = append(runs, named{n, d})
		}
	}
	var out []string
	ref := runs[0]
	pa := ref.r.r.Params
	for _, o := range runs[1:] {
		pb := o.r.r.Params
		diff := func(name string, x, y any) {
			if fmt.Sprint(x) != fmt.Sprint(y) {
				out = append(out, fmt.Sprintf("%s differs: %v in %s, %v in %s", name, x, ref.name, y, o.name))
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
	}
	pooled := len(as) > 1 || len(bs) > 1
	var busy []string
	for _, d := range runs {
		if !pooled && d.r.n < 4*blockS {
			out = append(out, fmt.Sprintf("run %s has %d steady seconds: the intervals are wide (run at least %d s after hatching)", d.name, d.r.n, 4*blockS))
		}
		// The interval of one run a side is the noise within a run;
		// neighbours that come and go between runs move every figure at
		// once (the simulator's CPU per request with them).
		if d.r.s.Verdict.Class == ClassMachineCPU {
			if !pooled {
				out = append(out, fmt.Sprintf("in run %s other processes held the machine's CPU (its verdict: %s): its figures measure them too", d.name, d.r.s.Verdict.Class))
			}
			busy = append(busy, d.name)
		}
	}
	if pooled && len(busy) > 0 {
		out = append(out, fmt.Sprintf("in %d of %d runs (%s) other processes held the machine's CPU (their verdict: %s): the spread between runs holds them", len(busy), len(runs), strings.Join(busy, ", "), ClassMachineCPU))
	}
	if pooled && len(as)+len(bs) < 4 {
		out = append(out, fmt.Sprintf("%d runs in all: the spread between runs rests on %d degrees of freedom and the intervals are wide (run 3 or more a side)", len(as)+len(bs), len(as)+len(bs)-2))
	}
	return out
}
