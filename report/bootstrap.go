package report

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"

	"github.com/HdrHistogram/hdrhistogram-go"
	"gonum.org/v1/gonum/stat/distuv"
)

// The comparison's statistics: a moving-block bootstrap over a run's
// seconds. A second is the unit resampled, not a request: requests in one
// second share its garbage collections, checkpoints and neighbours on the
// machine, so they are not independent draws, and neither are adjacent
// seconds (a checkpoint lasts several), hence blocks of blockS seconds.
// Each replicate recomputes the figure from the resampled seconds (for a
// percentile: their histograms merged), in both runs independently; the
// interval of the ratio B/A (or difference B−A) is read off the replicates'
// percentiles.

// blockS is the bootstrap's block length in seconds.
const blockS = 5

// secondsHist is one endpoint's latency over a run's seconds: each second's
// histogram as (bucket, count) pairs over the run's distinct bucket values,
// so a replicate merges seconds by adding counts instead of decoding.
type secondsHist struct {
	values []int64   // distinct bucket values (µs, highest equivalent), ascending
	idx    [][]int32 // per second: indices into values
	cnt    [][]int64 // per second: counts
	total  []int64   // per second: requests
}

// newSecondsHist decodes the given per-second histograms (hdrhistogram V2
// compressed strings; "" for none).
func newSecondsHist(encoded []string) (*secondsHist, error) {
	type bar struct {
		v int64
		c int64
	}
	bars := make([][]bar, len(encoded))
	seen := map[int64]bool{}
	for i, e := range encoded {
		if e == "" {
			continue
		}
		h, err := hdrhistogram.Decode([]byte(e))
		if err != nil {
			return nil, err
		}
		if h.TotalCount() == 0 {
			continue
		}
		for _, b := range h.Distribution() {
			if b.Count > 0 {
				bars[i] = append(bars[i], bar{b.To, b.Count})
				seen[b.To] = true
			}
		}
	}
	s := &secondsHist{idx: make([][]int32, len(encoded)), cnt: make([][]int64, len(encoded)), total: make([]int64, len(encoded))}
	for v := range seen {
		s.values = append(s.values, v)
	}
	slices.Sort(s.values)
	for i, bs := range bars {
		for _, b := range bs {
			j, _ := slices.BinarySearch(s.values, b.v)
			s.idx[i] = append(s.idx[i], int32(j))
			s.cnt[i] = append(s.cnt[i], b.c)
			s.total[i] += b.c
		}
	}
	return s, nil
}

// quantiles merges the seconds listed (with repeats) into counts and returns
// the percentiles ps (ascending, 0..100) in ms, as hdrhistogram's
// ValueAtPercentile ranks them; NaN when the seconds hold no request.
// counts is scratch space of len(values).
func (s *secondsHist) quantiles(secs []int, ps []float64, counts []int64, out []float64) {
	clear(counts)
	var n int64
	for _, i := range secs {
		for k, j := range s.idx[i] {
			counts[j] += s.cnt[i][k]
		}
		n += s.total[i]
	}
	if n == 0 {
		for k := range out {
			out[k] = math.NaN()
		}
		return
	}
	var cum int64
	j := 0
	for k, p := range ps {
		rank := pctRank(p, n)
		for ; j < len(counts); j++ {
			if cum+counts[j] >= rank {
				break
			}
			cum += counts[j]
		}
		out[k] = float64(s.values[min(j, len(s.values)-1)]) / 1000
	}
}

// pctRank is hdrhistogram's rank of a percentile among n values.
func pctRank(p float64, n int64) int64 {
	r := p/100*float64(n) + 0.5
	if !(r >= 1) {
		return 1
	}
	if r >= float64(n) {
		return n
	}
	return int64(r)
}

// resampler draws moving-block bootstrap replicates of a run's n seconds.
type resampler struct {
	rng *rand.Rand
	buf []int
}

// draw returns n second indices: blocks of blockS consecutive seconds from
// uniformly chosen starts, the last block cut to length n.
func (r *resampler) draw(n int) []int {
	r.buf = r.buf[:0]
	l := min(blockS, n)
	for len(r.buf) < n {
		start := r.rng.IntN(n - l + 1)
		for k := 0; k < l && len(r.buf) < n; k++ {
			r.buf = append(r.buf, start+k)
		}
	}
	return r.buf
}

// all is every second once: the point estimate.
func all(n int) []int {
	xs := make([]int, n)
	for i := range xs {
		xs[i] = i
	}
	return xs
}

// interval is the percentile interval of the replicates at the given
// confidence (NaN replicates, where a resample held no request, left out).
func interval(reps []float64, confidence float64) (lo, hi float64) {
	xs := make([]float64, 0, len(reps))
	for _, x := range reps {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			xs = append(xs, x)
		}
	}
	if len(xs) == 0 {
		return math.NaN(), math.NaN()
	}
	sort.Float64s(xs)
	a := (1 - confidence) / 2
	return quantileSorted(xs, a), quantileSorted(xs, 1-a)
}

// quantileSorted is the q-quantile (0..1) of sorted xs, linearly interpolated.
func quantileSorted(xs []float64, q float64) float64 {
	if len(xs) == 1 {
		return xs[0]
	}
	pos := q * float64(len(xs)-1)
	i := int(pos)
	if i >= len(xs)-1 {
		return xs[len(xs)-1]
	}
	f := pos - float64(i)
	return xs[i]*(1-f) + xs[i+1]*f
}

// stat computes figures of one run from a list of its seconds (with
// repeats) into out: every figure of the comparison is one, and an
// endpoint's percentiles are one stat so that a replicate merges its
// seconds' histograms once for all of them.
type stat func(secs []int, out []float64)

// scalar is a stat of one figure.
func scalar(f func(secs []int) float64) stat {
	return func(secs []int, out []float64) { out[0] = f(secs) }
}

// bootstrapped is what ratioCI returns for each of a stat's figures.
type bootstrapped struct {
	a, b, est, lo, hi float64
}

// ratioCI bootstraps the k figures of a and b over both runs (na and nb
// seconds) and returns each figure in both runs, the point estimate of
// b/a (or b−a when diff) and its interval.
func ratioCI(rng *rand.Rand, resamples int, confidence float64, na, nb int, a, b stat, k int, diff bool) []bootstrapped {
	combine := func(x, y float64) float64 {
		if diff {
			return y - x
		}
		return y / x
	}
	va, vb := make([]float64, k), make([]float64, k)
	out := make([]bootstrapped, k)
	a(all(na), va)
	b(all(nb), vb)
	for j := range out {
		out[j] = bootstrapped{a: va[j], b: vb[j], est: combine(va[j], vb[j])}
	}
	ra, rb := &resampler{rng: rng}, &resampler{rng: rng}
	reps := make([][]float64, k)
	for j := range reps {
		reps[j] = make([]float64, resamples)
	}
	for r := range resamples {
		a(ra.draw(na), va)
		b(rb.draw(nb), vb)
		for j := range reps {
			reps[j][r] = combine(va[j], vb[j])
		}
	}
	for j := range out {
		out[j].lo, out[j].hi = interval(reps[j], confidence)
	}
	return out
}

// acrossRuns is what Compare reports for a figure measured in several runs
// a side (rounds of the same builds): a single run's seconds show the noise
// within it, not the noise between runs on a machine whose neighbours come
// and go, which moves every figure of a run at once. Each run's figure is
// one observation; the change is the ratio of the sides' geometric means
// (the difference of their means when diff), and its interval is Student's
// t on the runs' logarithms (values when diff) with the two sides' variance
// pooled: the same machine, the same noise. Runs whose figure is missing
// (or, for a ratio, not positive) are left out; with fewer than three runs
// in all there is no spread to read and the interval is NaN.
func acrossRuns(xs, ys []float64, confidence float64, diff bool) bootstrapped {
	f, inv := math.Log, math.Exp
	if diff {
		f, inv = func(x float64) float64 { return x }, func(x float64) float64 { return x }
	}
	obs := func(vs []float64) []float64 {
		var out []float64
		for _, v := range vs {
			if !math.IsNaN(v) && !math.IsInf(v, 0) && (diff || v > 0) {
				out = append(out, f(v))
			}
		}
		return out
	}
	lx, ly := obs(xs), obs(ys)
	out := bootstrapped{a: math.NaN(), b: math.NaN(), est: math.NaN(), lo: math.NaN(), hi: math.NaN()}
	if len(lx) == 0 || len(ly) == 0 {
		return out
	}
	mean := func(vs []float64) float64 {
		var s float64
		for _, v := range vs {
			s += v
		}
		return s / float64(len(vs))
	}
	ma, mb := mean(lx), mean(ly)
	out.a, out.b = inv(ma), inv(mb)
	d := mb - ma
	out.est = inv(d)
	df := len(lx) + len(ly) - 2
	if df < 1 {
		return out
	}
	var ss float64
	for _, v := range lx {
		ss += (v - ma) * (v - ma)
	}
	for _, v := range ly {
		ss += (v - mb) * (v - mb)
	}
	se := math.Sqrt(ss/float64(df)) * math.Sqrt(1/float64(len(lx))+1/float64(len(ly)))
	tq := distuv.StudentsT{Mu: 0, Sigma: 1, Nu: float64(df)}.Quantile(1 - (1-confidence)/2)
	out.lo, out.hi = inv(d-tq*se), inv(d+tq*se)
	return out
}
