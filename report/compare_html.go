package report

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/kettlefleet/kettlefleet/sim"
)

//go:embed assets/compare.html
var compareHTML string

var comparePage = template.Must(template.New("compare.html").Funcs(template.FuncMap{
	"num": func(v Num, unit string) string {
		x := float64(v)
		switch {
		case math.IsNaN(x):
			return "—"
		case unit == "bytes":
			return fmt.Sprintf("%.1f KiB", x/1024)
		case unit == "":
			return fmt.Sprintf("%.5f", x)
		case x >= 100:
			return fmt.Sprintf("%.0f %s", x, unit)
		}
		return fmt.Sprintf("%.3g %s", x, unit)
	},
	"change":   func(f Figure) string { return change(&f) },
	"pct":      func(c float64) string { return fmt.Sprintf("%.0f %%", 100*c) },
	"runs":     func(i RunInfo) int { return max(1, len(i.Runs)) },
	"statusID": func(s string) string { return strings.ReplaceAll(s, " ", "-") },
	"add":      func(a, b int) int { return a + b },
}).Parse(compareHTML))

// forest is a figure's interval drawn on a scale around "no change": x
// positions (0..forestW) of the interval, the estimate, no change and the
// rule's bound.
type forest struct {
	Lo, Hi, Est, One, Bound float64
	HasBound                bool
}

const forestW = 220

// plot places a figure on its scale: logarithmic for a ratio, linear for a
// delta, wide enough for the interval, no change and the bound.
func plot(f *Figure, r *Rule) *forest {
	if f.Kind == "check" || f.Status == NotMeasured {
		return nil
	}
	lo, hi, est := float64(f.Lo), float64(f.Hi), float64(f.Estimate)
	var bound float64
	has := false
	if r != nil {
		for _, v := range []*float64{r.RegressIfRatioOver, r.RegressIfRatioUnder} {
			if v != nil && f.Kind == "ratio" {
				bound, has = *v, true
			}
		}
		if r.RegressIfDeltaOver != nil && f.Kind == "delta" {
			bound, has = *r.RegressIfDeltaOver, true
		}
	}
	tr := func(x float64) float64 { return x }
	one := 0.0
	if f.Kind == "ratio" {
		tr, one = math.Log, 1
	}
	xs := []float64{tr(lo), tr(hi), tr(est), tr(one)}
	if has {
		xs = append(xs, tr(bound))
	}
	mn, mx := xs[0], xs[0]
	for _, x := range xs {
		mn, mx = math.Min(mn, x), math.Max(mx, x)
	}
	pad := (mx - mn) * 0.08
	if pad == 0 {
		pad = 0.05
	}
	mn, mx = mn-pad, mx+pad
	at := func(x float64) float64 { return math.Round((tr(x)-mn)/(mx-mn)*forestW*10) / 10 }
	return &forest{Lo: at(lo), Hi: at(hi), Est: at(est), One: at(one), Bound: at(bound), HasBound: has}
}

// chartW and chartH are the size of an over-time chart, in SVG units.
const chartW, chartH = 560, 170

// overTime is one endpoint's p50 and p99 per second in both runs, as SVG
// paths on a logarithmic scale (a slowdown of the median and the spikes
// of the tail are both visible).
type overTime struct {
	Endpoint           string
	A50, A99, B50, B99 string // path d
	Grid               []gridLine
	Seconds            int
}

// gridLine is a decade of the y axis.
type gridLine struct {
	Y     float64
	Label string
}

func overTimeCharts(a, b *Summary) []overTime {
	var names []string
	for name := range a.Series.Endpoints {
		if b.Series.Endpoints[name] != nil {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	var out []overTime
	for _, name := range names {
		la, lb := a.Series.Endpoints[name].Latency, b.Series.Endpoints[name].Latency
		lo, hi := math.Inf(1), math.Inf(-1)
		for _, xs := range [][]Num{la["p50"], la["p99"], lb["p50"], lb["p99"]} {
			for _, x := range xs {
				if v := float64(x); v > 0 {
					lo, hi = math.Min(lo, v), math.Max(hi, v)
				}
			}
		}
		n := max(len(la["p50"]), len(lb["p50"]))
		if math.IsInf(lo, 0) || n < 2 {
			continue
		}
		d0, d1 := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
		if d1 == d0 {
			d1++
		}
		y := func(v float64) float64 { return chartH - (math.Log10(v)-d0)/(d1-d0)*chartH }
		path := func(xs []Num) string {
			var sb strings.Builder
			pen := "M"
			for i, v := range xs {
				if !(float64(v) > 0) {
					pen = "M"
					continue
				}
				fmt.Fprintf(&sb, "%s%.1f,%.1f", pen, float64(i)/float64(n-1)*chartW, y(float64(v)))
				pen = "L"
			}
			return sb.String()
		}
		ot := overTime{Endpoint: name, A50: path(la["p50"]), A99: path(la["p99"]), B50: path(lb["p50"]), B99: path(lb["p99"]), Seconds: n}
		for d := d0; d <= d1; d++ {
			ot.Grid = append(ot.Grid, gridLine{Y: math.Round(y(math.Pow(10, d))*10) / 10, Label: strconv.FormatFloat(math.Pow(10, d), 'g', -1, 64) + " ms"})
		}
		out = append(out, ot)
	}
	return out
}

// WriteHTML writes the comparison as one self-contained page.
func (c *Comparison) WriteHTML(w io.Writer) error {
	css, _ := assets.ReadFile("assets/report.css")
	type row struct {
		Figure
		Plot *forest
	}
	var rows []row
	for _, f := range c.Figures {
		rows = append(rows, row{f, plot(&f, c.rules.rule(f.Name))})
	}
	var charts []overTime
	if c.sa != nil && c.sb != nil {
		charts = overTimeCharts(c.sa, c.sb)
	}
	params := func(p sim.Params) string {
		return fmt.Sprintf("%d kettles, %s, interval %g s, hatch %g/s, %g s, batch %d, %s connections",
			p.Devices, strings.TrimSpace(p.API+" "+p.Protocol), p.IntervalS, p.HatchRate, p.DurationS, p.Batch, p.ConnMode)
	}
	data, err := json.Marshal(c)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	err = comparePage.Execute(&buf, map[string]any{
		"C": c, "Rows": rows, "CSS": template.CSS(css), "Charts": charts, "ForestW": forestW,
		"ChartW": chartW, "ChartH": chartH, "JSON": template.JS(data),
		"ParamsA": params(c.Baseline.Params), "ParamsB": params(c.Candidate.Params),
	})
	if err != nil {
		return err
	}
	_, err = w.Write(buf.Bytes())
	return err
}

// WriteFile writes the page to path.
func (c *Comparison) WriteFile(path string) error { return writePage(path, "comparison", c.WriteHTML) }

// writePage renders a page and writes it to path (its directory created);
// the error names what the page is.
func writePage(path, what string, render func(io.Writer) error) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := render(&buf); err != nil {
		return err
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", what, err)
	}
	return nil
}

// JSON is the comparison as indented JSON: kettle report --baseline's
// machine-readable verdict.
func (c *Comparison) JSON() ([]byte, error) { return json.MarshalIndent(c, "", " ") }

// Summary prints the comparison for a terminal: one line a figure, then
// the verdict.
func (c *Comparison) Summary(w io.Writer) {
	if c.Method == "runs" {
		na, nb := max(1, len(c.Baseline.Runs)), max(1, len(c.Candidate.Runs))
		fmt.Fprintf(w, "\ncomparison of %d runs with %d baseline runs (from %s, %d steady seconds; B: %d) — %.0f%% intervals from the spread between runs (Student's t, %d degrees of freedom)\n",
			nb, na, c.Baseline.Start.UTC().Format("2006-01-02 15:04:05"), c.Baseline.Seconds, c.Candidate.Seconds, 100*c.Confidence, na+nb-2)
	} else {
		fmt.Fprintf(w, "\ncomparison against the baseline (%s, %d steady seconds) — B: %d steady seconds, %.0f%% intervals, %d resamples in %d s blocks\n",
			c.Baseline.Start.UTC().Format("2006-01-02 15:04:05"), c.Baseline.Seconds, c.Candidate.Seconds, 100*c.Confidence, c.Resamples, c.BlockS)
	}
	for _, cv := range c.Caveats {
		fmt.Fprintf(w, "  caveat: %s\n", cv)
	}
	for _, f := range c.Figures {
		mark := " "
		switch f.Status {
		case Regressed:
			mark = "✗"
			if !f.Fail {
				mark = "!"
			}
		case Improved:
			mark = "✓"
		}
		fmt.Fprintf(w, "  %s %s\n", mark, f.Text)
	}
	fmt.Fprintf(w, "  comparison: %s\n", c.Line)
}
