package report

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sim"
)

// synth is a run drawn from known distributions (seeded): every second,
// perS uploads whose latency is lognormal with median medianMs and shape
// sigma, plus addMs; each fails with probability errP; perS itself is
// Poisson when poisson is set.
type synth struct {
	seconds       int
	perS          float64
	poisson       bool
	medianMs      float64
	sigma         float64
	addMs         float64
	errP          float64
	cpuUsPerReq   float64 // the simulator's CPU per request
	rssPerKettleB float64
}

func (sy synth) run(t testing.TB, seed uint64) *sim.Results {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 7))
	const kettles = 2000
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	r := &sim.Results{Schema: sim.SchemaVersion, Command: "synthetic", Start: start, End: start.Add(time.Duration(sy.seconds) * time.Second),
		Params: sim.Params{Devices: kettles, IntervalS: 30, API: "v1", Batch: 1, ConnMode: "per-device", DurationS: float64(sy.seconds), GOMAXPROCS: 2}}
	var cpu float64
	for s := 1; s <= sy.seconds; s++ {
		n := int(sy.perS)
		if sy.poisson {
			n = poisson(rng, sy.perS)
		}
		h := sim.NewHistogram()
		var errs int64
		for range n {
			ms := sy.medianMs*math.Exp(sy.sigma*rng.NormFloat64()) + sy.addMs
			if err := h.RecordValue(int64(ms * 1000)); err != nil {
				t.Fatal(err)
			}
			if rng.Float64() < sy.errP {
				errs++
			}
		}
		enc, err := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
		if err != nil {
			t.Fatal(err)
		}
		cpu += float64(n) * sy.cpuUsPerReq * (1 + 0.05*rng.NormFloat64()) / 1e6
		ep := &sim.EndpointSecond{Requests: int64(n), Histogram: string(enc)}
		if errs > 0 {
			ep.Errors = map[string]int64{"http_503": errs}
		}
		r.Seconds = append(r.Seconds, sim.Second{T: s, Kettles: kettles, CPUSeconds: cpu,
			RSSBytes:  int64(sy.rssPerKettleB * kettles * (1 + 0.01*rng.NormFloat64())),
			Endpoints: map[string]*sim.EndpointSecond{sim.EPMeasurement: ep}})
	}
	return r
}

func poisson(rng *rand.Rand, mean float64) int {
	// Knuth's method is slow for large means; the normal approximation
	// is exact enough at the means used here (≥ 50).
	return max(0, int(math.Round(mean+math.Sqrt(mean)*rng.NormFloat64())))
}

var base = synth{seconds: 40, perS: 100, medianMs: 2, sigma: 0.5, cpuUsPerReq: 300, rssPerKettleB: 40 << 10}

func figure(t testing.TB, c *Comparison, name string) Figure {
	t.Helper()
	for _, f := range c.Figures {
		if f.Name == name {
			return f
		}
	}
	t.Fatalf("no figure %s in %+v", name, c.Figures)
	return Figure{}
}

func fastThresholds() *Thresholds {
	th := DefaultThresholds()
	th.Resamples = 300
	return th
}

// TestBootstrapCoverage: with latencies drawn from lognormals whose medians
// differ by ×1.2 (so every percentile differs by ×1.2), the 95 % interval
// of the p50 and p99 ratios holds the true 1.2 in most of 24 seeded pairs
// of runs, and the estimate is close to it.
func TestBootstrapCoverage(t *testing.T) {
	slow := base
	slow.medianMs = 2.4
	const trials = 24
	covered := map[string]int{}
	th, err := ParseThresholds([]byte("resamples: 300\nfigures: {measurement.p50: {regress_if_ratio_over: 1.10}}"))
	if err != nil {
		t.Fatal(err)
	}
	for k := range trials {
		a, b := base.run(t, uint64(2*k+1)), slow.run(t, uint64(2*k+2))
		c, err := Compare(a, b, th, CompareOptions{Seed: uint64(k + 1)})
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"measurement.p50", "measurement.p99"} {
			f := figure(t, c, name)
			if f.Lo <= 1.2 && 1.2 <= f.Hi {
				covered[name]++
			}
			if math.Abs(float64(f.Estimate)/1.2-1) > 0.15 {
				t.Errorf("trial %d: %s estimate ×%.3f, true ×1.2", k, name, f.Estimate)
			}
		}
		if f := figure(t, c, "measurement.p50"); f.Status != Regressed {
			t.Errorf("trial %d: p50 ×1.2 (bound ×1.10 from a thresholds file): %s", k, f.Text)
		}
	}
	for name, n := range covered {
		// 95 % nominal; 24 trials: below 20 would be a broken interval.
		if n < 20 {
			t.Errorf("%s: the 95%% interval held the true ratio in %d of %d trials", name, n, trials)
		}
		t.Logf("%s: covered in %d of %d trials", name, n, trials)
	}
	if len(covered) != 2 {
		t.Errorf("coverage counted for %v", covered)
	}
}

// TestSameDistributionWithinNoise: two runs drawn from one distribution
// are within noise on every figure, in (almost) every seeded pair.
func TestSameDistributionWithinNoise(t *testing.T) {
	sy := base
	sy.poisson, sy.errP = true, 0.0005
	const trials = 20
	var flagged int
	for k := range trials {
		c, err := Compare(sy.run(t, uint64(100+2*k)), sy.run(t, uint64(101+2*k)), fastThresholds(), CompareOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// The figures, not the checks: a USE verdict says "errors" when a
		// run's few errors pass the 0.001 gate, which they may by chance.
		moved := 0
		for _, f := range c.Figures {
			if f.Kind != "check" && f.Status != WithinNoise && f.Status != NotMeasured {
				moved++
			}
		}
		if moved > 0 {
			flagged++
			t.Logf("trial %d: %s", k, c.Line)
		}
		if k == 0 {
			for _, f := range c.Figures {
				t.Log(f.Text)
			}
		}
	}
	if flagged > 1 {
		t.Errorf("%d of %d same-distribution pairs flagged a figure", flagged, trials)
	}
}

// TestSlowdownRegressed: 5 ms added to every upload (the deliberate
// slowdown of the real-run demonstration) regresses its percentiles by the
// known ratio and fails the comparison; throughput that dropped 10 %,
// errors that rose to 1 %, CPU per request up 30 % are each regressed.
func TestSlowdownRegressed(t *testing.T) {
	a := base
	a.poisson = true
	b := a
	b.addMs, b.perS, b.errP, b.cpuUsPerReq = 5, 0.9*a.perS, 0.01, 1.3*a.cpuUsPerReq
	c, err := Compare(a.run(t, 1), b.run(t, 2), fastThresholds(), CompareOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range c.Figures {
		t.Log(f.Text)
	}
	// The true p50 ratio: lognormal median 2 ms, +5 ms.
	if f := figure(t, c, "measurement.p50"); f.Status != Regressed || math.Abs(float64(f.Estimate)/3.5-1) > 0.05 {
		t.Errorf("p50: %s, want regressed at ×3.5", f.Text)
	}
	for _, name := range []string{"measurement.p99", "measurement.req_per_s", "measurement.error_rate", "simulator.cpu_us_per_request"} {
		if f := figure(t, c, name); f.Status != Regressed {
			t.Errorf("%s: %s", name, f.Text)
		}
	}
	if !c.Failed || c.Line[:9] != "regressed" {
		t.Errorf("comparison not failed: %s", c.Line)
	}
	// The other way round, the same figures improved and nothing fails.
	c, err = Compare(b.run(t, 2), a.run(t, 1), fastThresholds(), CompareOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if f := figure(t, c, "measurement.p50"); f.Status != Improved || c.Failed {
		t.Errorf("reversed: %s; %s", f.Text, c.Line)
	}
}

// TestCompareDeterministic: one seed, one comparison (the page and its
// golden file depend on it).
func TestCompareDeterministic(t *testing.T) {
	a, b := base.run(t, 1), base.run(t, 2)
	c1, _ := Compare(a, b, fastThresholds(), CompareOptions{Seed: 3})
	c2, _ := Compare(a, b, fastThresholds(), CompareOptions{Seed: 3})
	for i := range c1.Figures {
		if c1.Figures[i].Text != c2.Figures[i].Text {
			t.Fatalf("%s vs %s", c1.Figures[i].Text, c2.Figures[i].Text)
		}
	}
}

// TestQuantilesMatchHDR: the bootstrap's merged percentiles of all seconds
// are hdrhistogram's own over the merged histogram.
func TestQuantilesMatchHDR(t *testing.T) {
	r := base.run(t, 9)
	h, err := sim.MergeHistograms(r, sim.EPMeasurement)
	if err != nil {
		t.Fatal(err)
	}
	d, err := newRunData(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []float64{0, 1, 50, 90, 99, 99.9, 100} {
		out := make([]float64, 1)
		d.quantiles(sim.EPMeasurement, []float64{p})(all(d.n), out)
		got := out[0]
		if want := float64(h.ValueAtPercentile(p)) / 1000; got != want {
			t.Errorf("p%g: %g ms, hdrhistogram says %g", p, got, want)
		}
	}
}

// TestRoundsPooled: runs of one build whose latency moves from run to run
// (each run's whole distribution scaled by a factor drawn for it, as
// neighbours on a shared machine do) are flagged when compared one pair at
// a time, since one run's seconds cannot show that spread; pooled three
// runs a side they come out within noise, while 5 ms added to every upload
// still regresses in every pool.
func TestRoundsPooled(t *testing.T) {
	const trials, rounds = 16, 3
	rng := rand.New(rand.NewPCG(42, 42))
	seed := uint64(1000)
	runs := func(sy synth) []*sim.Results {
		var rs []*sim.Results
		for range rounds {
			s := sy
			s.medianMs *= math.Exp(0.3 * rng.NormFloat64())
			seed++
			rs = append(rs, s.run(t, seed))
		}
		return rs
	}
	moved := func(c *Comparison) int {
		n := 0
		for _, f := range c.Figures {
			if f.Kind != "check" && f.Status != WithinNoise && f.Status != NotMeasured {
				n++
			}
		}
		return n
	}
	sy := base
	sy.poisson, sy.seconds, sy.perS = true, 24, 60 // small runs: the test's time goes on making them
	// The single pairs only need their verdicts: few resamples.
	quick := fastThresholds()
	quick.Resamples = 100
	var single, pooled int
	for k := range trials {
		as, bs := runs(sy), runs(sy)
		c, err := Compare(as[0], bs[0], quick, CompareOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if moved(c) > 0 {
			single++
		}
		c, err = CompareRuns(as, bs, fastThresholds(), CompareOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if c.Method != "runs" || len(c.Baseline.Runs) != rounds || c.Baseline.Seconds != rounds*sy.seconds {
			t.Fatalf("pooled comparison: method %q, %d baseline runs, %d s", c.Method, len(c.Baseline.Runs), c.Baseline.Seconds)
		}
		if moved(c) > 0 {
			pooled++
			t.Logf("trial %d pooled: %s", k, c.Line)
		}
	}
	t.Logf("same build: %d of %d single pairs flagged a figure, %d of %d pools of %d rounds", single, trials, pooled, trials, rounds)
	if single < trials/4 {
		t.Errorf("only %d of %d single pairs flagged: the runs' spread is too small to test pooling", single, trials)
	}
	// The t interval's 5 % a figure, on 95 % intervals; an interval blind to
	// the spread between runs flags 4 of these 16.
	if pooled > 2 {
		t.Errorf("%d of %d pools of %d same-build rounds flagged a figure, want at most 2", pooled, trials, rounds)
	}

	slow := sy
	slow.addMs = 5
	for k := range 3 {
		c, err := CompareRuns(runs(sy), runs(slow), fastThresholds(), CompareOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if f := figure(t, c, "measurement.p50"); f.Status != Regressed || !c.Failed {
			t.Errorf("trial %d: 5 ms slower, pooled: %s; %s", k, f.Text, c.Line)
		}
	}
}
