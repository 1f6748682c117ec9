package report

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kettlefleet/kettlefleet/internal/browsertest"
	"github.com/kettlefleet/kettlefleet/sim"
)

// Two real runs of bench/compare.sh on this project's 2-core machine (2,000
// kettles, 60 s each, SQLite): A against the tree's kettle serve, B against
// a build that sleeps 5 ms in every upload.
const (
	compareA = "testdata/compare.a.results.json"
	compareB = "testdata/compare.b.results.json"
)

func loadComparison(t *testing.T) *Comparison {
	t.Helper()
	a, err := sim.ReadResults(compareA)
	if err != nil {
		t.Fatal(err)
	}
	b, err := sim.ReadResults(compareB)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Compare(a, b, nil, CompareOptions{Title: "kettle report: a build that sleeps 5 ms in every upload (B) against the tree's (A)", BaselinePath: "A/results.json", CandidatePath: "B/results.json"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestComparisonGolden pins the comparison's JSON verdict of the recorded
// pair; -update rewrites it. Whatever the golden holds, the slowed build's
// upload latency regressed and the comparison failed.
func TestComparisonGolden(t *testing.T) {
	c := loadComparison(t)
	got, err := c.JSON()
	if err != nil {
		t.Fatal(err)
	}
	checkGolden(t, filepath.Join("testdata", "compare.golden.json"), got, "ComparisonGolden")
	for _, name := range []string{"measurement.p50", "measurement.p99"} {
		if f := figure(t, c, name); f.Status != Regressed {
			t.Errorf("%s: %s", name, f.Text)
		}
	}
	if !c.Failed {
		t.Errorf("not failed: %s", c.Line)
	}
}

// checkGolden compares got with the golden file (rewritten with -update),
// naming the first line that differs; test is the -run pattern that
// rewrites it.
func checkGolden(t *testing.T, golden string, got []byte, test string) {
	t.Helper()
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./report -run %s -update)", err, test)
	}
	if bytes.Equal(got, want) {
		return
	}
	gl, wl := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
	for i := range min(len(gl), len(wl)) {
		if gl[i] != wl[i] {
			t.Fatalf("%s differs at line %d:\n got: %s\nwant: %s\n(go test ./report -run %s -update if intended)", golden, i+1, gl[i], wl[i], test)
		}
	}
	t.Fatalf("%s differs in length: %d vs %d lines", golden, len(gl), len(wl))
}

// TestCompareInBrowser opens the comparison page in Chromium: one row per
// figure with its status, every measured figure's interval drawn, the
// over-time charts drawn, the console clean; a screenshot is kept
// ($KETTLE_TEST_OUT or a temp dir; make screenshots copies it to docs/img).
func TestCompareInBrowser(t *testing.T) {
	out := os.Getenv("KETTLE_TEST_OUT")
	if out == "" {
		out = t.TempDir()
	} else if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	c := loadComparison(t)
	path := filepath.Join(out, "compare.html")
	if err := c.WriteFile(path); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	bctx := browsertest.New(t, ctx, 1400, 900)
	problems := browsertest.Watch(t, bctx)
	if err := chromedp.Do(bctx, chromedp.EmulateViewport(1400, 900), chromedp.Navigate("file://"+path)); err != nil {
		t.Fatal(err)
	}
	eval := func(expr string, v any) { t.Helper(); browsertest.Eval(t, bctx, expr, v) }
	var rows []struct {
		Figure, Status string
		Est, W         float64
		Drawn          bool
	}
	eval(`Array.from(document.querySelectorAll('#figures tr[data-figure]')).map(tr => {
		const c = tr.querySelector('svg.forest circle.est'), svg = tr.querySelector('svg.forest');
		return {Figure: tr.dataset.figure, Status: tr.querySelector('.badge').textContent,
			Est: c ? c.cx.baseVal.value : -1, W: svg ? svg.width.baseVal.value : 0, Drawn: !!c};
	})`, &rows)
	if len(rows) != len(c.Figures) {
		t.Fatalf("%d rows on the page, %d figures", len(rows), len(c.Figures))
	}
	for i, r := range rows {
		f := c.Figures[i]
		if r.Figure != f.Name || r.Status != f.Status {
			t.Errorf("row %d: %s %q, figure %s %q", i, r.Figure, r.Status, f.Name, f.Status)
		}
		measured := f.Kind != "check" && f.Status != NotMeasured
		if r.Drawn != measured || (measured && (r.Est < 0 || r.Est > r.W)) {
			t.Errorf("%s: interval drawn %v at %v of %v", f.Name, r.Drawn, r.Est, r.W)
		}
	}
	var line string
	var paths int
	eval(`document.getElementById('comparison-line').textContent`, &line)
	eval(`Array.from(document.querySelectorAll('#over-time path.line')).filter(p => (p.getAttribute('d') || '').length > 10).length`, &paths)
	if line != c.Line {
		t.Errorf("line on the page %q, want %q", line, c.Line)
	}
	if paths < 8 { // A and B, p50 and p99, for each of the two endpoints
		t.Errorf("%d over-time lines drawn", paths)
	}
	png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "compare.png"), png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", filepath.Join(out, "compare.png"))
	if p := problems(); len(p) > 0 {
		t.Errorf("the page complained:\n%s", strings.Join(p, "\n"))
	}
}
