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
	"statusID": func(s string) string { return strings.ReplaceAll(s, " ", "-") },
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

// overTime is one endpoint's p99 per second in both runs, as SVG paths.
type overTime struct {
	Endpoint string
	A, B     string  // path d
	MaxMs    float64 // the y axis's top
	Seconds  int
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
		pa, pb := a.Series.Endpoints[name].Latency["p99"], b.Series.Endpoints[name].Latency["p99"]
		top := math.Max(peak(pa), peak(pb))
		n := max(len(pa), len(pb))
		if math.IsNaN(top) || top <= 0 || n < 2 {
			continue
		}
		top = niceCeil(top)
		path := func(xs []Num) string {
			var sb strings.Builder
			pen := "M"
			for i, v := range xs {
				if math.IsNaN(float64(v)) {
					pen = "M"
					continue
				}
				fmt.Fprintf(&sb, "%s%.1f,%.1f", pen, float64(i)/float64(n-1)*chartW, chartH-float64(v)/top*chartH)
				pen = "L"
			}
			return sb.String()
		}
		out = append(out, overTime{Endpoint: name, A: path(pa), B: path(pb), MaxMs: top, Seconds: n})
	}
	return out
}

// niceCeil rounds up to 1, 2 or 5 × a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
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
		return fmt.Sprintf("%d kettles, %s %s, interval %g s, hatch %g/s, %g s, batch %d, %s connections",
			p.Devices, p.API, p.Protocol, p.IntervalS, p.HatchRate, p.DurationS, p.Batch, p.ConnMode)
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
func (c *Comparison) WriteFile(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := c.WriteHTML(&buf); err != nil {
		return err
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write comparison: %w", err)
	}
	return nil
}

// JSON is the comparison as indented JSON: kettle report --baseline's
// machine-readable verdict.
func (c *Comparison) JSON() ([]byte, error) { return json.MarshalIndent(c, "", " ") }

// Summary prints the comparison for a terminal: one line a figure, then
// the verdict.
func (c *Comparison) Summary(w io.Writer) {
	fmt.Fprintf(w, "\ncomparison against the baseline (%s, %d steady seconds) — B: %d steady seconds, %.0f%% intervals, %d resamples in %d s blocks\n",
		c.Baseline.Start.UTC().Format("2006-01-02 15:04:05"), c.Baseline.Seconds, c.Candidate.Seconds, 100*c.Confidence, c.Resamples, c.BlockS)
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
