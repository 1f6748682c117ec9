package report

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/browsertest"

	"github.com/chromedp/chromedp"

	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// recorded is a real kettle demo run on this project's 2-core machine,
// with its system section (see testdata/README).
const recorded = "testdata/demo.results.json"

func loadRecorded(t *testing.T) *sim.Results {
	t.Helper()
	r, err := sim.ReadResults(recorded)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// capacityFixture adds capacity steps to a run, as kettle capacity does.
func capacityFixture(r *sim.Results) *Capacity {
	return &Capacity{Command: "kettle capacity --target http://127.0.0.1:8080 --start 2000 --step 4000", SLOP99Ms: 100, MaxErrorRate: 0.001,
		Holds: 6000, BreaksAt: 10000, Line: "holds 6000 kettles at p99 ≤ 100ms (breaks at 10000: …)",
		Steps: []Step{
			{Kettles: 2000, OfferedPerS: 133, DonePerS: 133, P50Ms: 1.2, P99Ms: 14, Held: true},
			{Kettles: 6000, OfferedPerS: 400, DonePerS: 399, P50Ms: 2.5, P99Ms: 61, Held: true},
			{Kettles: 10000, OfferedPerS: 666, DonePerS: 590, P50Ms: 40, P99Ms: 850, ErrorRate: 0.004, Why: "p99 850 ms > 100 ms"},
		}}
}

// TestSummaryGolden pins the report's JSON summary of the recorded run;
// -update rewrites it.
func TestSummaryGolden(t *testing.T) {
	s, err := Build(loadRecorded(t), Options{Title: "golden"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.JSON()
	if err != nil {
		t.Fatal(err)
	}
	checkGolden(t, filepath.Join("testdata", "demo.summary.golden.json"), got, "Golden")
	// What the summary must say whatever the golden holds.
	if len(s.USE) != 8 || s.Verdict.Text == "" || len(s.Series.T) != len(loadRecorded(t).Seconds) {
		t.Errorf("USE rows %d, verdict %q, %d seconds", len(s.USE), s.Verdict.Text, len(s.Series.T))
	}
}

// TestOldResultsReadable: results written before the system section existed
// still make a report (simulator signals only).
func TestOldResultsReadable(t *testing.T) {
	r := loadRecorded(t)
	r.System = nil
	s, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := s.WriteHTML(&buf); err != nil {
		t.Fatal(err)
	}
	if s.Verdict.Class == "" || !strings.Contains(buf.String(), "report-data") {
		t.Fatalf("verdict %+v", s.Verdict)
	}
}

// TestReportInBrowser opens generated reports in Chromium: every chart
// draws, the console stays clean, the percentile selector redraws, and a
// screenshot is kept ($KETTLE_TEST_OUT or a temp dir).
func TestReportInBrowser(t *testing.T) {
	out := browsertest.OutDir(t)
	r := loadRecorded(t)
	plain, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}
	capa, _ := Build(r, Options{Title: "kettle capacity (fixture)"})
	capa.Capacity = capacityFixture(r)
	pages := map[string]*Summary{"report": plain, "capacity-report": capa}

	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	bctx := browsertest.New(t, ctx, 1400, 1000)
	problems := browsertest.Watch(t, bctx)
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	eval := func(expr string, v any) { t.Helper(); browsertest.Eval(t, bctx, expr, v) }
	for _, name := range []string{"report", "capacity-report"} {
		path := filepath.Join(out, name+".html")
		must("write", pages[name].WriteFile(path))
		must("open "+name, chromedp.Do(bctx, chromedp.EmulateViewport(1400, 1000), chromedp.Navigate("file://"+path)))
		_, err := chromedp.Run(bctx, chromedp.Poll[chromedp.Void](`window.reportCharts > 0`, chromedp.WithPollingTimeout(10*time.Second)))
		must("charts drawn", err)
		// Every chart: an svg with drawn lines (or, where the run has no such
		// data, an explicit "no data" note).
		var charts []struct {
			ID, Drawn string
			Paths     int
		}
		eval(`Array.from(document.querySelectorAll('figure.chart')).map(f => ({ID: f.id, Drawn: f.dataset.drawn || '',
			Paths: Array.from(f.querySelectorAll('svg path.line')).filter(p => (p.getAttribute('d') || '').length > 10).length}))`, &charts)
		want := 2 + 10 // two latency charts (command, measurement) + the others
		if name == "capacity-report" {
			want += 2
		}
		if len(charts) != want {
			t.Errorf("%s: %d charts, want %d: %+v", name, len(charts), want, charts)
		}
		for _, c := range charts {
			if c.Drawn != "lines" || c.Paths == 0 {
				t.Errorf("%s: chart %s not drawn (%q, %d lines)", name, c.ID, c.Drawn, c.Paths)
			}
		}
		var verdict string
		eval(`document.getElementById('verdict-text').textContent`, &verdict)
		if verdict != pages[name].Verdict.Text {
			t.Errorf("verdict on the page %q, want %q", verdict, pages[name].Verdict.Text)
		}
		// The percentile selector redraws the latency charts.
		var lines [2]int
		eval(`document.querySelectorAll('#chart-latency-command path.line').length`, &lines[0])
		must("tick p99.9", chromedp.Do(bctx, chromedp.Click(chromedp.CSS(`#pct input[value="p99.9"]`))))
		eval(`document.querySelectorAll('#chart-latency-command path.line').length`, &lines[1])
		if lines[1] != lines[0]+1 {
			t.Errorf("%s: ticking p99.9 drew %d → %d lines", name, lines[0], lines[1])
		}
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		must("screenshot", err)
		must("write screenshot", os.WriteFile(filepath.Join(out, name+".png"), png, 0o644))
		t.Logf("screenshot: %s", filepath.Join(out, name+".png"))
	}
	if p := problems(); len(p) > 0 {
		t.Errorf("the page complained:\n%s", strings.Join(p, "\n"))
	}
}

// TestSamplesAfterRunIgnored: system samples taken after the run ended
// (the audit reads every stored row, at full CPU) are not the run's and
// must not become its peak.
func TestSamplesAfterRunIgnored(t *testing.T) {
	r := loadRecorded(t)
	before, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}
	r = loadRecorded(t)
	hot := r.System.Samples[len(r.System.Samples)-1]
	hot.Time = r.End.Add(500 * time.Millisecond)
	hot.Procs = map[string]*sysstat.Proc{sysstat.RoleServer: {Count: 1, CPUPct: 190}}
	hot.CPU.User, hot.CPU.Idle = 195, 5
	r.System.Samples = append(r.System.Samples, hot)
	after, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if after.Verdict.Text != before.Verdict.Text {
		t.Fatalf("a sample after the run's end changed the verdict:\n%s\n%s", before.Verdict.Text, after.Verdict.Text)
	}
	tl, err := TimelineOf(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range tl.ServerCPU {
		if float64(v) >= 190 {
			t.Fatalf("server CPU series holds the post-run sample: %v", tl.ServerCPU)
		}
	}
}

// TestPostgresCountersBecomeRates: PostgreSQL's WAL counters, sampled raw,
// become per-second series between consecutive scraped samples (the
// checkpoint verdict and the WAL chart read them).
func TestPostgresCountersBecomeRates(t *testing.T) {
	r := loadRecorded(t)
	var fpi, wal float64
	for k := range r.System.Samples {
		smp := &r.System.Samples[k]
		fpi += 100
		if k == 10 {
			fpi += 5000 // a checkpoint began
		}
		wal += 1 << 20
		cps := float64(k / 10)
		// WAL segment files: one switch every 4 samples; 3 files ready at
		// first, one used at each switch (samples 4, 8, 12: nothing
		// created), then none (each switch creates one); at sample 30 a
		// checkpoint recycles 5, used from sample 32 on.
		seg := float64(k / 4)
		ready := max(0, 3-seg)
		if k >= 30 {
			ready = 5 - (seg - 7)
		}
		smp.Server = &sysstat.ServerGauges{Up: true, PGWALFullPageImages: &[]float64{fpi}[0], PGWALBytes: &[]float64{wal}[0], PGCheckpoints: &cps,
			PGWALSegment: &seg, PGWALSegmentsReady: &ready}
	}
	tl, err := TimelineOf(r)
	if err != nil {
		t.Fatal(err)
	}
	var surge, steady int
	for i, v := range tl.FPIPerS {
		switch f := float64(v); {
		case f > 4000:
			surge++
		case f > 50 && f < 200:
			steady++
			if w := float64(tl.WALMiBPerS[i]); w < 0.5 || w > 2 {
				t.Errorf("second %d: WAL %v MiB/s, want ~1", i, w)
			}
		}
	}
	if surge != 1 || steady < len(r.System.Samples)/2 {
		t.Errorf("full-page images per second: %d surges (want 1), %d steady seconds of %d samples: %v", surge, steady, len(r.System.Samples), tl.FPIPerS)
	}
	if peak(tl.CheckpointsPerS) <= 0 {
		t.Errorf("no checkpoint rate: %v", tl.CheckpointsPerS)
	}
	// Created: the switches at samples 16, 20, 24 and 28 (none ready before
	// or after); not those that used a ready file (4, 8, 12, 32, …).
	var created []int
	for i, v := range tl.WALSegmentsPerS {
		if v > 0 {
			created = append(created, i)
		}
	}
	if want := []int{16, 20, 24, 28}; len(r.System.Samples) < 40 || !slices.Equal(created, want) {
		t.Errorf("new WAL segment files in seconds %v, want %v (of %d samples): %v", created, want, len(r.System.Samples), tl.WALSegmentsPerS)
	}
}
