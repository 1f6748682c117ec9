package sim

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/mqttapi"
)

func TestParseStages(t *testing.T) {
	f := func(in string, base int, want []Stage, wantErr string) {
		t.Helper()
		got, err := ParseStages(in, base)
		if wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), wantErr) {
				t.Errorf("ParseStages(%q) error %v, want one containing %q", in, err, wantErr)
			}
			return
		}
		if err != nil || len(got) != len(want) {
			t.Fatalf("ParseStages(%q) = %v, %v; want %v", in, got, err, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Errorf("ParseStages(%q)[%d] = %v, want %v", in, i, got[i], want[i])
			}
		}
	}
	f("2m:20000,5m:20000,30s:40000,5m:40000", 0, []Stage{{2 * time.Minute, 20000}, {5 * time.Minute, 20000}, {30 * time.Second, 40000}, {5 * time.Minute, 40000}}, "")
	f("1m:30%, 0s:100%", 2000, []Stage{{time.Minute, 600}, {0, 2000}}, "")
	f("2m", 0, nil, "want DURATION:KETTLES")
	f("2x:10", 0, nil, "duration")
	f("2m:-1", 0, nil, "target")
	f("", 0, nil, "at least one")
}

func TestConfigValidatesStages(t *testing.T) {
	f := func(mod func(c *Config), want string) {
		t.Helper()
		c := quick("http://127.0.0.1:1")
		c.Duration, c.Devices = 0, 0
		mod(&c)
		var msgs []string
		for _, e := range c.Validate() {
			msgs = append(msgs, e.Error())
		}
		got := strings.Join(msgs, "; ")
		if want == "" && got != "" || want != "" && !strings.Contains(got, want) {
			t.Errorf("Validate: %q, want %q", got, want)
		}
	}
	f(func(c *Config) { c.Stages = []Stage{{time.Second, 10}} }, "")
	f(func(c *Config) {}, "--devices must be > 0")
	f(func(c *Config) { c.Stages, c.HatchRate = []Stage{{time.Second, 10}}, 5 }, "drop --hatch-rate")
	f(func(c *Config) { c.Stages = []Stage{{0, 10}} }, "last 0 s")
	f(func(c *Config) { c.Stages = []Stage{{time.Second, 0}} }, "no stage has a kettle")
	f(func(c *Config) { c.Stages, c.Duration = []Stage{{time.Minute, 1}}, time.Second }, "--duration 1s is shorter than the stages")
	f(func(c *Config) { c.Devices, c.Rollout = 5, &Rollout{Share: 0.5, Batch: 5000} }, "rollout: batch 5000")
	f(func(c *Config) { c.Devices, c.API, c.Rollout = 5, "v0", &Rollout{Share: 0.5, Batch: 5} }, "needs v1")
}

// The shape's joins and leaves: kettles join in index order on the way up,
// the last to join leave first on the way down, a step moves them all at
// one instant, and a kettle that left joins again when the fleet regrows.
func TestShapeJoinsAndLeaves(t *testing.T) {
	s := time.Second.Nanoseconds()
	sh := newShape([]Stage{{10 * time.Second, 100}, {10 * time.Second, 100}, {10 * time.Second, 50}, {0, 0}, {5 * time.Second, 0}, {0, 100}, {5 * time.Second, 100}})
	if n := sh.at(5 * s); n != 50 {
		t.Errorf("N(5s) = %g, want 50", n)
	}
	if n := sh.at(25 * s); n != 75 {
		t.Errorf("N(25s) = %g, want 75", n)
	}
	if n := sh.at(30 * s); n != 0 {
		t.Errorf("N(30s) = %g, want 0 (right after the step)", n)
	}
	join := func(g int, from int64, wantAt int64, wantHow int) {
		t.Helper()
		at, how, ok := sh.nextJoin(g, from)
		if !ok || math.Abs(float64(at-wantAt)) > 1e6 || how != wantHow {
			t.Errorf("nextJoin(%d, %d) = %d %d %v; want %d %d", g, from, at, how, ok, wantAt, wantHow)
		}
	}
	leave := func(g int, from int64, wantAt int64) {
		t.Helper()
		at, ok := sh.nextLeave(g, from)
		if !ok || math.Abs(float64(at-wantAt)) > 1e6 {
			t.Errorf("nextLeave(%d, %d) = %d %v; want %d", g, from, at, ok, wantAt)
		}
	}
	join(0, 0, 0, joinRamp)
	join(50, 0, 5*s, joinRamp)
	leave(99, 5*s, 20*s+s/5)       // the last to join leaves first (N = 99 at 20.2 s)
	leave(60, 5*s, 28*s)           // 100 → 50 over 10 s: N = 60 at 28 s
	leave(10, 1*s, 30*s)           // the step to 0
	join(10, 30*s, 35*s, joinStep) // the power is back: a step
	if _, ok := sh.nextLeave(10, 35*s); ok {
		t.Error("a kettle in the last stage leaves")
	}
	st := newShape([]Stage{{0, 10}, {time.Second, 10}})
	if at, how, ok := st.nextJoin(9, 0); !ok || at != 0 || how != joinSpread {
		t.Errorf("a step at the start: %d %d %v, want 0, spread", at, how, ok)
	}
	if _, _, ok := st.nextJoin(10, 0); ok {
		t.Error("kettle 10 of a fleet of 10 joins")
	}
}

// A slow server does not lower the load of a shaped fleet: the offered
// requests of each second follow the fleet size the stages give, whether
// the server answers in 1 ms or 300 ms, and latency counts from the
// intended send times.
func TestShapeOpenModelSlowServer(t *testing.T) {
	stages := []Stage{{2 * time.Second, 40}, {time.Second, 40}, {time.Second, 10}, {time.Second, 10}}
	run := func(delay time.Duration) *Results {
		f, srv := newFake(t)
		f.delay = delay
		cfg := quick(srv.URL)
		cfg.Devices, cfg.Duration, cfg.Jitter = 0, 0, 0
		cfg.Interval = 200 * time.Millisecond
		cfg.Stages = stages
		cfg.Secret, cfg.Operator = f.secret, f.operator
		res, err := Run(context.Background(), cfg)
		if err != nil {
			t.Error(err)
			return &Results{}
		}
		if a := res.Audit; a == nil || a.Lost != 0 || a.Duplicated != 0 {
			t.Errorf("delay %s: audit %+v", delay, a)
		}
		return res
	}
	// Side by side: the two runs take the stages' 5 s once.
	var fast, slow *Results
	var wg sync.WaitGroup
	wg.Go(func() { fast = run(0) })
	wg.Go(func() { slow = run(300 * time.Millisecond) })
	wg.Wait()
	if t.Failed() {
		return
	}
	// The sends due in each second, counted from the shape by hand:
	// kettle g joins at g/20 s (0 → 40 over 2 s), sends then and every
	// 200 ms, and, from g = 10 up, leaves at 3 + (40−g)/30 s (40 → 10 over
	// the 4th second).
	due := make([]float64, 6)
	for g := range 40 {
		leave := 5.0
		if g >= 10 {
			leave = 3 + float64(40-g)/30
		}
		for at := float64(g) / 20; at < leave; at += 0.2 {
			due[min(int(math.Ceil(at)), 5)]++ // second T covers (T−1, T]
		}
	}
	due[1] += due[0]
	// Counted by the second they came due in; a collector starved of CPU
	// closes a second late and moves some into the next, so the run so far
	// is compared, second by second.
	totals := [2]float64{}
	for j, res := range []*Results{fast, slow} {
		var got, want float64
		for _, sec := range res.Seconds {
			if sec.T > 5 {
				continue
			}
			got += float64(sec.Endpoints[EPMeasurement].Offered)
			want += due[sec.T]
			if math.Abs(got-want) > 0.1*want+10 {
				t.Errorf("by second %d: %.0f uploads offered, want %.0f (the fleet %d kettles at its end)", sec.T, got, want, sec.Kettles)
			}
		}
		totals[j] = got
	}
	if math.Abs(totals[1]-totals[0]) > 0.05*totals[0]+5 {
		t.Errorf("uploads offered: %.0f against a fast server, %.0f against a slow one: a slow server lowered the load", totals[0], totals[1])
	}
	if p := slow.Totals.Endpoints[EPMeasurement].P50Ms; p < 300 {
		t.Errorf("slow server: upload p50 %.1f ms, want ≥ its 300 ms (from the intended send time)", p)
	}
	if slow.Totals.LateStarts == 0 {
		t.Error("slow server: no late starts, want the sends due while one was outstanding counted")
	}
	if len(slow.Params.Stages) != len(stages) || slow.Params.Stages[2].From != 40 || slow.Params.Stages[2].To != 10 {
		t.Errorf("params stages %+v", slow.Params.Stages)
	}
}

// Each example scenario in contrib/scenarios, played in a tiny form (a few
// dozen kettles, its durations compressed to seconds) against a real
// server, does what its file says, and the audit finds every acknowledged
// reading stored once.
func TestScenarioExamples(t *testing.T) {
	files, _ := filepath.Glob("../contrib/scenarios/*.yaml")
	if len(files) < 4 {
		t.Fatalf("%d example scenarios, want the four", len(files))
	}
	run := func(t *testing.T, srv interface {
		URL() string
		Secret() []byte
		OperatorToken() string
		MQTTAddr() string
	}, file string, speed float64, protocol string) *Results {
		sc, err := ReadScenario(file)
		if err != nil {
			t.Fatal(err)
		}
		cfg := Config{
			TargetConfig:    TargetConfig{Target: srv.URL(), Secret: srv.Secret(), Operator: srv.OperatorToken()},
			FleetConfig:     FleetConfig{Seed: 3},
			ScheduleConfig:  ScheduleConfig{Interval: 500 * time.Millisecond, Jitter: 20 * time.Millisecond},
			TransportConfig: TransportConfig{Protocol: protocol, Timeout: 5 * time.Second, ReserveFDs: 1000},
		}
		if protocol == ProtocolMQTT {
			cfg.MQTTTarget = srv.MQTTAddr()
		}
		if err := sc.Scaled(speed).Apply(&cfg, 40); err != nil {
			t.Fatal(err)
		}
		res, err := Run(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if a := res.Audit; a == nil || a.Acked == 0 || a.Lost != 0 || a.Duplicated != 0 {
			t.Errorf("audit %+v", a)
		}
		if res.Params.Scenario != sc.Name || len(res.Params.Stages) != len(sc.Stages) {
			t.Errorf("params: scenario %q, %d stages", res.Params.Scenario, len(res.Params.Stages))
		}
		return res
	}
	kettles := func(res *Results, t int) int {
		for _, s := range res.Seconds {
			if s.T == t {
				return s.Kettles
			}
		}
		return -1
	}
	t.Run("morning-peak", func(t *testing.T) {
		t.Parallel()
		srv := startServer(t, mqttapi.Config{})
		res := run(t, srv, "../contrib/scenarios/morning-peak.yaml", 700, ProtocolHTTP) // 70 min in 6 s
		// The fleet follows the shape: 30 % at night (12 of 40), rising to
		// all 40 at the peak, down to 20 at the end.
		var st []Stage
		for _, m := range res.Params.Stages {
			st = append(st, Stage{Duration: time.Duration((m.EndS - m.StartS) * 1e9), Target: m.To})
		}
		sh := newShape(st)
		for _, s := range res.Seconds {
			if n := sh.at(int64(s.T) * 1e9); math.Abs(float64(s.Kettles)-n) > 2 {
				t.Errorf("t=%ds: %d kettles, want %.0f", s.T, s.Kettles, n)
			}
		}
		if k := kettles(res, 3); k != 40 {
			t.Errorf("t=3s: %d kettles, want the peak's 40", k)
		}
		if k := res.Seconds[len(res.Seconds)-1].Kettles; k < 19 || k > 22 {
			t.Errorf("end: %d kettles, want ~20", k)
		}
	})
	for _, protocol := range []string{ProtocolHTTP, ProtocolMQTT} {
		t.Run("power-cut-"+protocol, func(t *testing.T) {
			t.Parallel()
			srv := startServer(t, mqttapi.Config{Addr: "127.0.0.1:0"})
			// 7.5 min in 10.7 s: the cut from 5.71 s to 6.43 s.
			res := run(t, srv, "../contrib/scenarios/power-cut.yaml", 42, protocol)
			if k := kettles(res, 5); k != 40 {
				t.Errorf("t=5s: %d kettles, want 40", k)
			}
			if k := kettles(res, 6); k != 0 {
				t.Errorf("t=6s: %d kettles, want none (the power is off)", k)
			}
			// Power back at 6.43 s: every kettle sends at that instant, then
			// again on its own phase. The second (6, 7] holds the storm (40)
			// on top of 0.57 s of the steady 80 a second (46); without the
			// storm it would hold the 46 alone.
			ep, con := EPMeasurement, int64(-1)
			if protocol == ProtocolMQTT {
				ep = EPMQTTPublish
			}
			var storm int64
			for _, s := range res.Seconds {
				if s.T == 7 {
					if e := s.Endpoints[ep]; e != nil {
						storm = e.Offered
					}
					if e := s.Endpoints[EPMQTTConnect]; e != nil {
						con = e.Offered
					}
				}
			}
			if storm < 70 {
				t.Errorf("t=7s: %d %s offered, want ≥ 70 (the storm's 40 on the steady 46)", storm, ep)
			}
			if protocol == ProtocolMQTT && con != 40 {
				t.Errorf("t=7s: %d MQTT connects, want every kettle's 40 at once", con)
			}
			if d := res.Totals.Dials; d < 80 {
				t.Errorf("%d connections dialed, want every kettle's twice (80)", d)
			}
			if k := res.Seconds[len(res.Seconds)-1].Kettles; k != 40 {
				t.Errorf("end: %d kettles, want 40", k)
			}
		})
	}
	t.Run("firmware-rollout", func(t *testing.T) {
		t.Parallel()
		srv := startServer(t, mqttapi.Config{})
		// 10 min in 10 s: half the fleet moves to batches of 10 from 3 to 5 s.
		res := run(t, srv, "../contrib/scenarios/firmware-rollout.yaml", 60, ProtocolHTTP)
		rate := func(from, to int) (uploads, readings float64) {
			n := 0
			for _, s := range res.Seconds {
				if s.T > from && s.T <= to {
					uploads += float64(s.Endpoints[EPMeasurement].Requests)
					readings += float64(s.Readings)
					n++
				}
			}
			return uploads / float64(n), readings / float64(n)
		}
		ub, rb := rate(1, 3)
		ua, ra := rate(6, 10)
		t.Logf("before: %.0f uploads/s, %.0f readings/s; after: %.0f uploads/s, %.0f readings/s", ub, rb, ua, ra)
		if ua > 0.7*ub || ra < 0.8*rb {
			t.Errorf("uploads/s %.0f → %.0f, readings/s %.0f → %.0f: want uploads to fall by ~45 %% and readings to stay", ub, ua, rb, ra)
		}
		if r := res.Params.Rollout; r == nil || r.Batch != 10 || r.Share != 0.5 {
			t.Errorf("params rollout %+v", r)
		}
	})
	t.Run("soak", func(t *testing.T) {
		t.Parallel()
		srv := startServer(t, mqttapi.Config{})
		res := run(t, srv, "../contrib/scenarios/soak.yaml", 1470, ProtocolHTTP) // 4 h 5 min in 10 s
		for _, s := range res.Seconds[1:] {
			if s.Kettles != 12 {
				t.Errorf("t=%ds: %d kettles, want 30 %% of 40 (12) throughout", s.T, s.Kettles)
			}
		}
	})
}

func TestParseScenario(t *testing.T) {
	f := func(doc, wantErr string) {
		t.Helper()
		_, err := ParseScenario([]byte(doc))
		if wantErr == "" && err != nil || wantErr != "" && (err == nil || !strings.Contains(err.Error(), wantErr)) {
			t.Errorf("ParseScenario(%q): %v, want %q", doc, err, wantErr)
		}
	}
	f("stages: [{duration: 1m, target: 10}]", "")
	f(`{"devices": 100, "stages": [{"duration": "1m", "target": "50%"}]}`, "") // JSON
	f("stages: [{duration: 1m, target: 50%}]", "say what 100 % is")
	f("stages: [{duration: 1m, target: ten}]", "stages[0]: target")
	f("stages: [{duration: 1m, targte: 10}]", "field targte not found")
	f("stage: []", "field stage not found")
	f("", "empty file")
	f("devices: -1\nstages: [{duration: 1m, target: 10}]", "none negative")
	if _, err := ReadScenario(filepath.Join(t.TempDir(), "none.yaml")); err == nil || !strings.Contains(err.Error(), "--scenario") {
		t.Errorf("missing file: %v", err)
	}
	big := filepath.Join(t.TempDir(), "big.yaml")
	_ = os.WriteFile(big, make([]byte, maxScenarioBytes+2), 0o644)
	if _, err := ReadScenario(big); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("big file: %v", err)
	}
}

// A shaped fleet over two lab workers: the plans carry the stages, each
// shard's kettles join and leave by their index in the whole fleet, and
// the controller's merged seconds — also those handed to OnSecond, the
// live view's feed — follow the fleet's size.
func TestLabStages(t *testing.T) {
	srv := startServer(t, mqttapi.Config{})
	ws := startWorkers(t, 2)
	lc := labConfig(srv, srv.URL(), ws)
	lc.Devices, lc.Duration = 0, 0
	lc.Stages = []Stage{{time.Second, 20}, {1500 * time.Millisecond, 20}, {0, 7}, {1500 * time.Millisecond, 7}}
	var mu sync.Mutex
	var fed []Second
	lc.OnSecond = func(s Second) { mu.Lock(); fed = append(fed, s); mu.Unlock() }
	res, err := RunLab(t.Context(), lc)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]int{2: 20, 3: 7}
	for _, s := range res.Seconds {
		if w, ok := want[s.T]; ok && s.Kettles != w {
			t.Errorf("t=%ds: %d kettles over the workers, want %d", s.T, s.Kettles, w)
		}
	}
	if a := res.Audit; a == nil || a.Lost != 0 || a.Duplicated != 0 || a.Acked == 0 {
		t.Errorf("audit %+v", a)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(fed) != len(res.Seconds) {
		t.Fatalf("OnSecond saw %d seconds, the results hold %d", len(fed), len(res.Seconds))
	}
	for i := range fed {
		if fed[i].T != res.Seconds[i].T || fed[i].Kettles != res.Seconds[i].Kettles {
			t.Errorf("OnSecond second %d: t=%d %d kettles; results t=%d %d kettles", i, fed[i].T, fed[i].Kettles, res.Seconds[i].T, res.Seconds[i].Kettles)
		}
	}
}
