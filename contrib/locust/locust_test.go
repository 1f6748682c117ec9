// Package locust_test holds locustfile.py to what the rest of kettlefleet
// promises: its kettles are sim's kettles (same physics, step for step), and
// a short headless Locust run over each protocol against a real kettle serve
// finishes with 0 failures and every acknowledged reading stored.
package locust_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sim"
)

const (
	users    = 20
	runTime  = "10s"
	interval = "1s"
)

// locust finds the Locust CLI and the Python that runs it. CI installs it
// (make deps); a missing Locust is a failure, not a skip, so the locustfile
// cannot rot unnoticed.
func locust(t *testing.T) (cli, python string) {
	t.Helper()
	cli, err := exec.LookPath("locust")
	if err != nil {
		t.Fatal("locust not on PATH: apt-get install -y python3-locust (or make deps)")
	}
	python = "python3"
	if f, err := os.Open(cli); err == nil {
		line, _ := bufio.NewReader(f).ReadString('\n')
		f.Close()
		if sh, ok := strings.CutPrefix(strings.TrimSpace(line), "#!"); ok {
			if fs := strings.Fields(sh); len(fs) == 1 {
				python = fs[0]
			} else if len(fs) > 1 && strings.HasSuffix(fs[0], "/env") {
				python = fs[1]
			}
		}
	}
	return cli, python
}

// env is this process's environment without KETTLE_* (a developer's
// KETTLE_API or KETTLE_SECRET must not change the test), with no
// __pycache__ left in the source tree, plus extra.
func env(extra ...string) []string {
	out := []string{"PYTHONDONTWRITEBYTECODE=1"}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KETTLE_") {
			out = append(out, kv)
		}
	}
	return append(out, extra...)
}

type seqRand struct {
	vals []float64
	i    int
}

func (r *seqRand) Float64() float64 {
	v := r.vals[r.i%len(r.vals)]
	r.i++
	return v
}

// The Python kettle and sim.Model, fed the same random numbers and the same
// commands, must agree step for step (to float rounding: Go and libm may
// differ in the last bits of exp and cos).
func TestModelMatchesSim(t *testing.T) {
	_, python := locust(t)
	rands := []float64{0.37, 0.91, 0.002, 0.55, 0.73, 0.18, 0.64, 0.001, 0.82, 0.45, 0.29, 0.96, 0.08}
	type command struct {
		Charge, Fill bool
		Flush        float64
	}
	cmds := []command{{Charge: true}, {Fill: true}, {Flush: 3}, {}, {Charge: true, Fill: true}, {Flush: 40}, {Fill: true}}
	t0 := time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)

	m := sim.NewModel(&seqRand{vals: rands}, t0)
	r := &seqRand{vals: rands, i: 7} // NewModel draws 7 numbers
	var steps [][4]any
	var want [][5]float64
	at := t0
	for i := range 300 { // 300 × 37 s ≈ 3 h: heating, charging, filling, flushing, cups
		at = at.Add(37 * time.Second)
		c := cmds[(i/20)%len(cmds)]
		m.Obey(r, at, sim.Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.Flush})
		steps = append(steps, [4]any{at.Unix(), c.Charge, c.Fill, c.Flush})
		want = append(want, [5]float64{m.ChargeMWh, m.LevelML, m.WaterC, m.AmbientC, m.RateMW})
	}

	in, _ := json.Marshal(map[string]any{"t0": t0.Unix(), "rands": rands, "steps": steps})
	cmd := exec.Command(python, "-c", `
import json, sys
sys.path.insert(0, ".")
from locustfile import Model
job = json.load(sys.stdin)
vals, n = job["rands"], [0]
class Seq:
    def random(self):
        v = vals[n[0] % len(vals)]; n[0] += 1; return v
r = Seq()
m = Model(r, float(job["t0"]))
out = []
for t, c, f, fl in job["steps"]:
    m.obey(r, float(t), c, f, fl)
    out.append([m.charge_mwh, m.level_ml, m.water_c, m.ambient_c, m.rate_mw])
json.dump(out, sys.stdout)
`)
	cmd.Env = env()
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python model: %v\n%s", err, stderr.String())
	}
	var got [][5]float64
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("python model output: %v: %.200s", err, out)
	}
	if len(got) != len(want) {
		t.Fatalf("python model: %d steps, want %d", len(got), len(want))
	}
	names := [5]string{"charge_mwh", "level_ml", "water_c", "ambient_c", "rate_mw"}
	var cups, sawCharge, sawFill, sawFlush, sawHeat bool
	for i := range want {
		for j := range want[i] {
			if g, w := got[i][j], want[i][j]; math.Abs(g-w) > 1e-6*math.Max(1, math.Abs(w)) {
				t.Fatalf("step %d (%+v): %s python %v, sim %v", i, steps[i], names[j], g, w)
			}
		}
		if i == 0 {
			continue
		}
		d := func(j int) float64 { return want[i][j] - want[i-1][j] }
		c := cmds[(i/20)%len(cmds)]
		cups = cups || d(1) < -200
		sawCharge = sawCharge || c.Charge && d(0) > 0
		sawFill = sawFill || c.Fill && d(1) > 0
		sawFlush = sawFlush || c.Flush > 0 && d(1) < 0
		sawHeat = sawHeat || !c.Charge && d(0) < 0 && d(2) > 0
	}
	// The scenario must exercise what it claims to compare.
	if !cups || !sawCharge || !sawFill || !sawFlush || !sawHeat {
		t.Errorf("scenario too tame: cups=%v charge=%v fill=%v flush=%v heat=%v", cups, sawCharge, sawFill, sawFlush, sawHeat)
	}
}

// endpoint is one row of Locust's final summary.
type endpoint struct{ reqs, fails int }

// summaryRow matches "POST     /measurement    100     0(0.00%) | …".
var summaryRow = regexp.MustCompile(`^(GET|POST|PUT|DELETE)?\s+(\S+)\s+(\d+)\s+(\d+)\(`)

// runLocust runs a short headless Locust against url and returns its final
// per-endpoint counts, or why the run failed: Locust exits non-zero on any
// failure, and its summary and CSV must both show 0 failures.
func runLocust(ctx context.Context, cli, url, dir string, extraEnv ...string) (map[string]endpoint, error) {
	csvBase := filepath.Join(dir, "locust")
	cmd := exec.CommandContext(ctx, cli, "-f", "locustfile.py", "--headless",
		"-u", strconv.Itoa(users), "-r", strconv.Itoa(users), "-t", runTime,
		"--host", url, "--csv", csvBase, "--only-summary")
	cmd.Env = env(append([]string{"KETTLE_INTERVAL=" + interval}, extraEnv...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("locust: %v\n%s", err, out.String())
	}

	// The final summary, printed after the users stopped: exact counts.
	got := map[string]endpoint{}
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(line, "Response time percentiles") {
			break
		}
		if m := summaryRow.FindStringSubmatch(line); m != nil {
			r, _ := strconv.Atoi(m[3])
			f, _ := strconv.Atoi(m[4])
			got[m[2]] = endpoint{r, f}
		}
	}
	if got["Aggregated"].reqs == 0 || got["Aggregated"].fails != 0 {
		return nil, fmt.Errorf("summary: %d requests, %d failures; want some and 0\n%s", got["Aggregated"].reqs, got["Aggregated"].fails, out.String())
	}

	// The CSV (Locust 2.12 rewrites it once a second, so it may miss the
	// last second) must agree: no failures.
	f, err := os.Open(csvBase + "_stats.csv")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil || len(rows) < 2 {
		return nil, fmt.Errorf("CSV %s: %v, %d rows", f.Name(), err, len(rows))
	}
	col := map[string]int{}
	for i, name := range rows[0] {
		col[name] = i
	}
	for _, row := range rows[1:] {
		if n, _ := strconv.Atoi(row[col["Failure Count"]]); n != 0 {
			return nil, fmt.Errorf("CSV: %s %s: %d failures\n%s", row[col["Type"]], row[col["Name"]], n, out.String())
		}
	}
	return got, nil
}

type stats struct {
	Measurements int64 `json:"measurement_count"`
	Registered   int64 `json:"devices_registered"`
	Reporting    int64 `json:"devices_reporting"`
}

func statistics(t *testing.T, srv *server.Server) stats {
	t.Helper()
	req, _ := http.NewRequest("GET", srv.URL()+"/v1/statistics", nil)
	req.Header.Set("Authorization", "Bearer "+srv.OperatorToken())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var s stats
	if resp.StatusCode != 200 {
		t.Fatalf("GET /v1/statistics: %s", resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// Locust drives a real kettle serve over v0 (login + cookie), v1 with tokens
// derived from the secret, and v1 with devices provisioned through the
// operator API, all at once: 0 failures, and the server stored every reading
// Locust saw acknowledged (plus at most one per kettle that was in flight
// when Locust stopped its users).
func TestLocustAgainstServer(t *testing.T) {
	cli, _ := locust(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	dir := t.TempDir()
	srv, err := server.Start(ctx, server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + dir + "/k.db", DataDir: dir,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	runs := []struct {
		name, upload, poll, setup string // setup: the credential endpoint, and how often it is called
		setups                    int
		env                       []string
	}{
		{"v0", "/measurement", "/command", "/login", users, nil},
		{"v1-secret", "/v1/measurements", "/v1/command", "", 0, []string{"KETTLE_API=v1", "KETTLE_SECRET=" + string(srv.Secret())}},
		{"v1-operator", "/v1/measurements", "/v1/command", "/v1/devices", 1, // one bulk provisioning call
			[]string{"KETTLE_API=v1", "KETTLE_OPERATOR_TOKEN=" + srv.OperatorToken()}},
	}
	// The three runs go at once (not as parallel subtests: -parallel is
	// GOMAXPROCS, 2 on a small machine, and would serialise the third).
	results := make([]map[string]endpoint, len(runs))
	errs := make([]error, len(runs))
	var wg sync.WaitGroup
	for i, r := range runs {
		wg.Go(func() { results[i], errs[i] = runLocust(ctx, cli, srv.URL(), t.TempDir(), r.env...) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s: %v", runs[i].name, err)
		}
	}
	if t.Failed() {
		return
	}

	var acked int64
	for i, r := range runs {
		got := results[i]
		up, poll := got[r.upload], got[r.poll]
		if r.setup != "" && got[r.setup].reqs != r.setups {
			t.Errorf("%s: %d requests to %s, want %d", r.name, got[r.setup].reqs, r.setup, r.setups)
		}
		// 20 kettles, 1 s interval, 10 s: about 9 exchanges each on a quiet
		// machine. Throughput is not what this test is about (a loaded CI
		// box may manage far fewer): ask for one per kettle on average.
		if up.reqs < users || poll.reqs < users {
			t.Errorf("%s: %d uploads, %d polls; want ≥ %d each", r.name, up.reqs, poll.reqs, users)
		}
		acked += int64(up.reqs) // 0 failures: no backlog, one reading per request
	}
	s := statistics(t, srv)
	if s.Measurements < acked || s.Measurements > acked+int64(len(runs)*users) {
		t.Errorf("stored %d measurements; Locust saw %d acknowledged (want stored = acked, + at most %d in flight at the stop)",
			s.Measurements, acked, len(runs)*users)
	}
	if want := int64(len(runs) * users); s.Registered != want || s.Reporting != want {
		t.Errorf("devices registered %d, reporting %d; want %d each", s.Registered, s.Reporting, want)
	}
	t.Logf("stored %d measurements from %d kettles; Locust acked %d", s.Measurements, s.Registered, acked)
}
