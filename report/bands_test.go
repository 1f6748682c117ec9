package report

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kettlefleet/kettlefleet/internal/browsertest"
	"github.com/kettlefleet/kettlefleet/sim"
)

// withFaults is the recorded run with two faults written in, as chaos
// nemesis writes them.
func withFaults(t *testing.T) *sim.Results {
	r := loadRecorded(t)
	r.Faults = []sim.FaultInterval{
		{Name: "kill -9 pg1", Kind: "kill", Start: r.Start.Add(10 * time.Second), End: r.Start.Add(20 * time.Second)},
		{Name: "isolate etcd2", Kind: "partition", Start: r.Start.Add(30 * time.Second), End: r.Start.Add(45 * time.Second)},
	}
	return r
}

func TestFaultBands(t *testing.T) {
	s, err := Build(withFaults(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := []Band{{Name: "kill -9 pg1", Kind: "kill", T0: 10, T1: 20}, {Name: "isolate etcd2", Kind: "partition", T0: 30, T1: 45}}
	if len(s.Faults) != 2 || s.Faults[0] != want[0] || s.Faults[1] != want[1] {
		t.Errorf("bands %+v, want %+v", s.Faults, want)
	}
	plain, _ := Build(loadRecorded(t), Options{})
	if plain.Faults != nil {
		t.Errorf("a run without faults has bands: %+v", plain.Faults)
	}
}

// TestFaultBandsInBrowser: every time-series chart shades both faults, and
// the page lists them.
func TestFaultBandsInBrowser(t *testing.T) {
	s, err := Build(withFaults(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "faults.html")
	if err := s.WriteFile(path); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	bctx := browsertest.New(t, ctx, 1400, 1000)
	if err := chromedp.Do(bctx, chromedp.EmulateViewport(1400, 1000), chromedp.Navigate("file://"+path)); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Poll[chromedp.Void](`window.reportCharts > 0`, chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		t.Fatal(err)
	}
	var charts []struct {
		ID     string
		Drawn  string
		Bands  int
		Titles []string
	}
	raw, err := chromedp.Run(bctx, chromedp.Evaluate[[]byte](`Array.from(document.querySelectorAll('figure.chart')).map(f => ({ID: f.id, Drawn: f.dataset.drawn || '',
		Bands: f.querySelectorAll('svg rect.band').length, Titles: Array.from(f.querySelectorAll('svg rect.band title')).map(t => t.textContent)}))`))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &charts); err != nil {
		t.Fatal(err)
	}
	if len(charts) < 10 {
		t.Fatalf("%d charts", len(charts))
	}
	for _, c := range charts {
		if c.Drawn != "lines" {
			continue // a chart with no data in this run draws no axis, nor bands
		}
		if c.Bands != 2 || len(c.Titles) != 2 || !strings.HasPrefix(c.Titles[0], "kill -9 pg1 (") {
			t.Errorf("chart %s: %d bands %q, want the two faults", c.ID, c.Bands, c.Titles)
		}
	}
	var rows int
	raw, err = chromedp.Run(bctx, chromedp.Evaluate[[]byte](`document.querySelectorAll('#faults tr').length`))
	if err != nil || json.Unmarshal(raw, &rows) != nil || rows != 3 {
		t.Errorf("the faults table has %d rows (%v), want a header and two faults", rows, err)
	}
}
