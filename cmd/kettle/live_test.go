package main_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kettlefleet/kettlefleet/internal/browsertest"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/sim"
)

var liveAt = regexp.MustCompile(`swarm: live view at (\S+)`)

// liveSwarm starts kettle swarm --ui with args and returns the page's
// address; the process's exit arrives on done.
func liveSwarm(t *testing.T, args ...string) (url string, log *syncbuf.Buffer, done chan error) {
	t.Helper()
	p := start(t, liveAt, append([]string{"swarm", "--ui", "127.0.0.1:0", "--slo-p99", "0", "--max-error-rate", "-1"}, args...)...)
	return p.url, p.log, p.done
}

// TestLiveInBrowser: kettle swarm --ui against a kettle serve process,
// watched in Chromium. The page receives an update a second with growing
// counts, draws its charts with the stages marked, and its stop button
// ends the run early: the results and the report are written, the page
// shows the verdict, the console stays clean. The screenshot goes to
// $KETTLE_TEST_OUT (make screenshots: docs/img/live.png).
func TestLiveInBrowser(t *testing.T) {
	out := browsertest.OutDir(t)
	dir := t.TempDir()
	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"))
	res := filepath.Join(dir, "out")
	url, log, done := liveSwarm(t, "--target", p.url, "--data-dir", dir, "--interval", "500ms", "--jitter", "50ms",
		"--stages", "4s:60,6s:60,0s:20,4s:20,0s:80,40s:80", "--out", res)

	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	bctx := browsertest.New(t, ctx, 1400, 1000)
	var mu sync.Mutex
	var problems []string
	if err := chromedp.Listen(bctx, func(ev any) {
		if p := browsertest.Problem(ev); p != "" {
			mu.Lock()
			problems = append(problems, p)
			mu.Unlock()
		}
	}); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v\n%s", what, err, log)
		}
	}
	eval := func(expr string, v any) {
		t.Helper()
		raw, err := chromedp.Run(bctx, chromedp.Evaluate[[]byte](expr))
		must(expr, err)
		must("decode "+expr, json.Unmarshal(raw, v))
	}
	wait := func(cond string) {
		t.Helper()
		_, err := chromedp.Run(bctx, chromedp.Poll[chromedp.Void](cond, chromedp.WithPollingTimeout(40*time.Second)))
		must("wait for "+cond, err)
	}
	const requests = `(() => { const s = window.kettleReport.data().series || {}; let n = 0;
		for (const e of Object.values(s.endpoints || {})) for (const v of e.completed) n += v || 0; return n; })()`
	must("open the live view", chromedp.Do(bctx, chromedp.Navigate(url)))
	var counts []int
	for _, n := range []int{2, 4, 6, 17} {
		wait(fmt.Sprintf("window.liveUpdates >= %d", n))
		var c int
		eval(requests, &c)
		counts = append(counts, c)
	}
	for i := 1; i < len(counts); i++ {
		if counts[i] <= counts[i-1] {
			t.Errorf("requests on the page after 2, 4, 6, 17 updates: %v, want them growing", counts)
		}
	}
	var page struct {
		Charts, Marks, VLines int
		State, Line, Sub      string
	}
	eval(`({Charts: document.querySelectorAll('figure.chart[data-drawn=lines]').length,
		Marks: document.querySelectorAll('#chart-kettles rect.band.stage').length,
		VLines: document.querySelectorAll('line.vline').length, Sub: document.querySelector('header .sub').textContent,
		State: window.liveState, Line: document.getElementById('live-line').textContent})`, &page)
	if page.Charts < 6 || page.Marks < 3 || page.State != "running" || !strings.Contains(page.Line, "of 80 kettles") {
		t.Errorf("live page: %+v, want its charts drawn, the stages marked (3 changes), running", page)
	}
	// No verdict yet: its time is not marked, and the header gives the start only.
	if page.VLines != 0 || !strings.HasPrefix(page.Sub, "started ") {
		t.Errorf("live page while running: %d verdict lines, header %q", page.VLines, page.Sub)
	}
	// The top of the page: the live panel and the first charts.
	png, err := chromedp.Run(bctx, chromedp.CaptureScreenshot())
	must("screenshot", err)
	must("write screenshot", os.WriteFile(filepath.Join(out, "live.png"), png, 0o644))
	t.Logf("screenshot: %s", filepath.Join(out, "live.png"))

	must("stop", chromedp.Do(bctx, chromedp.Click(chromedp.CSS("#live-stop"))))
	wait(`window.liveState === 'ended'`)
	var verdict, line string
	eval(`document.getElementById('verdict').style.display === '' ? document.getElementById('verdict-text').textContent : ''`, &verdict)
	eval(`document.getElementById('live-line').textContent`, &line)
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("kettle swarm after the stop: %v\n%s", err, log)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("kettle swarm still running after the stop\n%s", log)
	}
	r, err := sim.ReadResults(filepath.Join(res, "results.json"))
	must("results written", err)
	if wall := r.End.Sub(r.Start); wall > 30*time.Second || r.Audit == nil || r.Audit.Lost != 0 {
		t.Errorf("stopped run: %s of the stages' 54 s, audit %+v", wall, r.Audit)
	}
	if _, err := os.Stat(filepath.Join(res, "report.html")); err != nil {
		t.Errorf("report: %v", err)
	}
	if verdict == "" || !strings.Contains(line, "report.html") || !strings.Contains(log.String(), "stopped from the live view") {
		t.Errorf("after the stop the page shows verdict %q, line %q\n%s", verdict, line, log)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(problems) > 0 {
		t.Errorf("the page complained: %s", strings.Join(problems, "; "))
	}
}

// TestLiveOverWorkers: the live view of a run over two kettle swarm worker
// processes streams the controller's merged seconds (both shards' kettles
// in each), and a POST /stop as the page sends it ends the run over every
// worker with its merged results written.
func TestLiveOverWorkers(t *testing.T) {
	dir := t.TempDir()
	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"))
	const token = "live-lab-token-0123456789"
	var addrs []string
	for range 2 {
		_, a := startWorker(t, "127.0.0.1", token)
		addrs = append(addrs, a)
	}
	res := filepath.Join(dir, "out")
	url, log, done := liveSwarm(t, "--target", p.url, "--data-dir", dir, "--workers", strings.Join(addrs, ","), "--worker-token", token,
		"--devices", "20", "--interval", "500ms", "--jitter", "50ms", "--duration", "60s", "--sample=false", "--out", res)

	r, err := http.Get(url + "events")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	sc := bufio.NewScanner(r.Body)
	sc.Buffer(nil, 1<<20)
	type tick struct {
		T      int `json:"t"`
		Series struct {
			Kettles []float64 `json:"kettles"`
		} `json:"series"`
	}
	var ticks []tick
	for len(ticks) < 4 && sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok && strings.Contains(d, `"series"`) {
			var tk tick
			if err := json.Unmarshal([]byte(d), &tk); err != nil {
				t.Fatal(err)
			}
			ticks = append(ticks, tk)
		}
	}
	if len(ticks) < 4 {
		t.Fatalf("%d ticks from the controller's live view\n%s", len(ticks), log)
	}
	for i, tk := range ticks {
		if i > 0 && tk.T <= ticks[i-1].T {
			t.Errorf("tick %d at t=%d after t=%d", i, tk.T, ticks[i-1].T)
		}
		if k := tk.Series.Kettles; len(k) == 0 || k[len(k)-1] != 20 {
			t.Errorf("tick at t=%d: kettles %v, want both shards' 20", tk.T, k)
		}
	}
	stop, _ := http.NewRequest("POST", url+"stop", nil)
	stop.Header.Set("X-Kettle-Stop", "1")
	sr, err := http.DefaultClient.Do(stop)
	if err != nil || sr.StatusCode != http.StatusAccepted {
		t.Fatalf("POST /stop: %v %v", sr, err)
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the lab still runs after the stop\n%s", log)
	}
	rr, err := sim.ReadResults(filepath.Join(res, "results.json"))
	if err != nil {
		t.Fatalf("results: %v\n%s", err, log)
	}
	if wall := rr.End.Sub(rr.Start); wall > 40*time.Second || len(rr.Workers) != 2 || rr.Audit == nil || rr.Audit.Lost != 0 {
		t.Errorf("stopped lab run: %s of 60 s, %d workers, audit %+v", wall, len(rr.Workers), rr.Audit)
	}
}
