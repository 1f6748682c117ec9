package report

import (
	"bytes"
	"embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"os"
	"strings"

	"github.com/kettlefleet/kettlefleet/sim"
)

//go:embed assets/report.html assets/report.css assets/report.js assets/live.js
var assets embed.FS

var page = template.Must(template.New("report.html").Funcs(template.FuncMap{
	"join":   strings.Join,
	"mul100": func(n int) int { return 100 * n },
}).ParseFS(assets, "assets/report.html"))

// WriteHTML writes the page: one self-contained HTML document.
func (s *Summary) WriteHTML(w io.Writer) error { return s.writeHTML(w, false) }

// writeHTML writes the page, in its live form (live.go) when live is set.
func (s *Summary) writeHTML(w io.Writer, live bool) error {
	js, _ := assets.ReadFile("assets/report.js")
	css, _ := assets.ReadFile("assets/report.css")
	data, err := json.Marshal(s) // escapes <, > and &: safe inside <script>
	if err != nil {
		return err
	}
	p := s.Params
	conns := p.ConnMode
	if p.ConnMode == "shared" {
		conns = fmt.Sprintf("shared pool of %d", p.Conns)
	} else {
		conns = fmt.Sprintf("one per kettle (%d slots)", p.Conns)
	}
	slo := "—"
	if p.SLOP99Ms > 0 {
		slo = fmt.Sprintf("p99 ≤ %g ms, error rate ≤ %g", p.SLOP99Ms, p.MaxErrorRate)
	}
	params := [][2]string{
		{"target", p.Target}, {"protocol", p.API + " (" + p.Provisioning + ")"},
		{"kettles", fmt.Sprint(p.Devices)}, {"interval", fmt.Sprintf("%g s ± %g s", p.IntervalS, p.JitterS)},
		{"hatch rate", hatch(p.HatchRate)}, {"duration", fmt.Sprintf("%g s", p.DurationS)},
		{"batch", fmt.Sprint(p.Batch)}, {"connections", conns}, {"timeout", fmt.Sprintf("%g s", p.TimeoutS)},
		{"seed", fmt.Sprint(p.Seed)}, {"SLO", slo},
		{"simulator", fmt.Sprintf("%.1f CPU-s, %.3f CPU-s per 10k kettles per minute, max RSS %d MiB", s.Sim.CPUSeconds, s.Sim.CPUPer10kPerMin, s.Sim.MaxRSSBytes>>20)},
		{"readings", fmt.Sprintf("%d generated, %d acknowledged, %d still buffered, %d dropped", s.Sim.Readings, s.Sim.Acked, s.Sim.Unacked, s.Sim.Dropped)},
	}
	if p.InProcessNote != "" {
		params = append(params, [2]string{"note", p.InProcessNote})
	}
	var buf bytes.Buffer
	err = page.Execute(&buf, map[string]any{
		"S": s, "JSON": template.JS(data), "JS": template.JS(js), "CSS": template.CSS(css),
		"Params": params, "Sustain": sustainS, "Live": live, "LiveJS": liveJS(live),
	})
	if err != nil {
		return err
	}
	_, err = w.Write(buf.Bytes())
	return err
}

func liveJS(live bool) template.JS {
	if !live {
		return ""
	}
	js, _ := assets.ReadFile("assets/live.js")
	return template.JS(js)
}

func hatch(r float64) string {
	if r <= 0 {
		return "all at once (phases spread over one interval)"
	}
	return fmt.Sprintf("%g kettles/s", r)
}

// WriteFile writes the page to path.
func (s *Summary) WriteFile(path string) error { return writePage(path, "report", s.WriteHTML) }

// WriteJSON writes the summary's JSON to path; the error names the file.
func (s *Summary) WriteJSON(path string) error {
	b, err := s.JSON()
	if err != nil {
		return fmt.Errorf("encode %s: %w", path, err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// FromFile reads a results.json and writes its report to out; it returns
// the summary (for its verdict).
func FromFile(results, out string) (*Summary, error) {
	r, err := sim.ReadResults(results)
	if err != nil {
		return nil, err
	}
	s, err := Build(r, Options{})
	if err != nil {
		return nil, err
	}
	return s, s.WriteFile(out)
}
