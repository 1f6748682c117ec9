package sim

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/internal/liar"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
)

const labToken = "lab-test-token-0123456789"

// labWorkers are in-process workers on 127.0.45.11.. (this helper's
// address block), each sending its shard from its own address.
type testWorker struct {
	addr string
	ip   string
	w    *Worker
	srv  *http.Server
}

// kill stops a worker abruptly: its control listener and its run.
func (tw *testWorker) kill() {
	tw.srv.Close()
	tw.w.Close()
}

func startWorkers(t *testing.T, n int) []*testWorker {
	t.Helper()
	var out []*testWorker
	for i := range n {
		ip := net.IPv4(127, 0, 45, byte(11+i))
		l, err := net.Listen("tcp", net.JoinHostPort(ip.String(), "0"))
		if err != nil {
			t.Fatal(err)
		}
		w, err := NewWorker(WorkerConfig{Token: labToken, SourceAddrs: []net.IP{ip}, ReserveFDs: 1000})
		if err != nil {
			t.Fatal(err)
		}
		srv := NewWorkerServer(w.Handler())
		go srv.Serve(l)
		tw := &testWorker{addr: l.Addr().String(), ip: ip.String(), w: w, srv: srv}
		t.Cleanup(tw.kill)
		out = append(out, tw)
	}
	return out
}

func labConfig(srv *server.Server, target string, ws []*testWorker) LabConfig {
	lc := LabConfig{Config: Config{
		TargetConfig:    TargetConfig{Target: target, Secret: srv.Secret(), Operator: srv.OperatorToken()},
		FleetConfig:     FleetConfig{Devices: 30, Seed: 3},
		ScheduleConfig:  ScheduleConfig{Interval: 500 * time.Millisecond, Jitter: 20 * time.Millisecond, Duration: 3 * time.Second},
		TransportConfig: TransportConfig{Timeout: 2 * time.Second},
		OutputConfig:    OutputConfig{Log: io.Discard},
	}, Token: labToken, LostAfter: 2 * time.Second}
	for _, w := range ws {
		lc.Workers = append(lc.Workers, w.addr)
	}
	return lc
}

// TestLabThreeWorkers drives one fleet from three workers against a real
// server behind a proxy that counts each worker's requests, holds the third
// worker's for 150 ms, and acknowledges one upload of the second worker
// without storing it. The merged run must count what the proxy counted,
// show the slow third in its p99 (merged histograms, not averaged
// percentiles), and its audit must find the one lost reading in the second
// worker's shard.
func TestLabThreeWorkers(t *testing.T) {
	srv := startServer(t, mqttapi.Config{})
	ws := startWorkers(t, 3)
	p := liar.Start(t, srv.URL(), &liar.Proxy{
		Delay: func(from string) time.Duration {
			if from == ws[2].ip {
				return 150 * time.Millisecond
			}
			return 0
		},
		Lose: func(from string, _ int64) bool { return from == ws[1].ip },
	})
	// Only the second worker's first upload is lost.
	lost := false
	p.Lose = func(from string, _ int64) bool {
		if from != ws[1].ip || lost {
			return false
		}
		lost = true
		return true
	}
	var progress bytes.Buffer
	lc := labConfig(srv, p.URL(), ws)
	lc.Progress, lc.ProgressEvery = &progress, time.Second
	res, err := RunLab(t.Context(), lc)
	if err != nil {
		t.Fatal(err)
	}
	var sum bytes.Buffer
	res.Summary(&sum)
	t.Log(sum.String())

	if len(res.Workers) != 3 {
		t.Fatalf("workers %+v", res.Workers)
	}
	// Shards: disjoint and covering the fleet (kettle i on worker i mod 3).
	for i, w := range res.Workers {
		if w.State != "done" || w.First != i || w.Stride != 3 || w.Devices != 10 {
			t.Errorf("worker %d: %+v, want done, 10 kettles from #%d every 3", i, w, i)
		}
	}
	// Counts: each worker's = what the proxy saw from its address; the
	// merged = their sum.
	var sumReq, seenMeas int64
	for i, w := range res.Workers {
		seen := p.Seen(ws[i].ip, "measurement") + p.Seen(ws[i].ip, "command")
		if w.Requests != seen || w.Requests == 0 {
			t.Errorf("worker %d: %d requests, the proxy saw %d from %s", i, w.Requests, seen, ws[i].ip)
		}
		sumReq += w.Requests
		seenMeas += p.Seen(ws[i].ip, "measurement")
	}
	tot := res.Totals
	if tot.Requests != sumReq || tot.Endpoints[EPMeasurement].Requests != seenMeas {
		t.Errorf("merged %d requests (%d uploads), workers' sum %d (proxy saw %d uploads)", tot.Requests, tot.Endpoints[EPMeasurement].Requests, sumReq, seenMeas)
	}
	var secReq int64
	for _, s := range res.Seconds {
		for _, e := range s.Endpoints {
			secReq += e.Requests
		}
		if len(s.Workers) != 3 {
			t.Fatalf("second %d: %d worker entries", s.T, len(s.Workers))
		}
	}
	if secReq != tot.Requests {
		t.Errorf("seconds sum to %d requests, totals %d", secReq, tot.Requests)
	}
	// Every upload of the third worker took ≥ 150 ms: the merged
	// histogram holds each of them (a union, not an average of the
	// workers' percentiles), so the fleet's p99 is at least that.
	m := tot.Endpoints[EPMeasurement]
	h, err := hdrhistogram.Decode([]byte(m.Histogram))
	if err != nil {
		t.Fatal(err)
	}
	var slow int64
	for _, b := range h.Distribution() {
		if b.From >= 149_000 { // the bucket that holds 150 ms starts below it
			slow += b.Count
		}
	}
	if slow3 := p.Seen(ws[2].ip, "measurement"); slow < slow3 || h.TotalCount() != m.Requests || m.P99Ms < 150 {
		t.Errorf("merged uploads: %d of %d took ≥ 150 ms, the slow worker sent %d; p99 %.1f ms", slow, h.TotalCount(), slow3, m.P99Ms)
	}
	// One audit over all shards: the one lost reading, in worker 1's.
	a := res.Audit
	if a == nil || a.Lost != 1 || a.Duplicated != 0 || a.Acked != tot.Acked {
		t.Fatalf("audit %+v, want lost=1 of acked %d", a, tot.Acked)
	}
	for i, w := range res.Workers {
		want := int64(0)
		if i == 1 {
			want = 1
		}
		if w.Audit == nil || w.Audit.Lost != want {
			t.Errorf("worker %d audit %+v, want lost=%d", i, w.Audit, want)
		}
	}
	if !strings.Contains(progress.String(), "workers "+ws[0].addr) {
		t.Errorf("progress lacks the workers:\n%s", progress.String())
	}
}

// TestLabWorkerLost kills one of three workers mid-run: the run still ends
// with results, the lost worker's share marked, the others audited.
func TestLabWorkerLost(t *testing.T) {
	srv := startServer(t, mqttapi.Config{})
	ws := startWorkers(t, 3)
	lc := labConfig(srv, srv.URL(), ws)
	lc.Duration = 4 * time.Second
	go func() {
		// Killed once it has reported two seconds of its run.
		for range 200 {
			time.Sleep(50 * time.Millisecond)
			w := ws[1].w
			w.mu.Lock()
			n := 0
			if w.cur != nil {
				n = len(w.cur.seconds)
			}
			w.mu.Unlock()
			if n >= 2 {
				break
			}
		}
		ws[1].kill()
	}()
	res, err := RunLab(t.Context(), lc)
	if err != nil {
		t.Fatal(err)
	}
	var sum bytes.Buffer
	res.Summary(&sum)
	t.Log(sum.String())
	lost := res.LostWorkers()
	if len(lost) != 1 || lost[0].Addr != ws[1].addr || !strings.Contains(lost[0].Error, "lost at t=") {
		t.Fatalf("lost workers %+v, want %s", lost, ws[1].addr)
	}
	if lost[0].Requests == 0 || lost[0].LastT == 0 {
		t.Errorf("the lost worker's seconds before it died are missing: %+v", lost[0])
	}
	if !strings.Contains(sum.String(), "LOST: its share (10 of 30 kettles, 33.3%)") {
		t.Errorf("summary does not mark the lost share:\n%s", sum.String())
	}
	a := res.Audit
	if a == nil || a.Lost != 0 || a.Acked == 0 || res.Workers[1].Audit != nil {
		t.Errorf("audit %+v (lost worker's %+v): want the two live shards audited clean", a, res.Workers[1].Audit)
	}
}

// TestMergeExact: the merged p99 is the p99 of the union of every worker's
// latencies, and the counts are their sums; averaging the workers' p99s
// would be far off.
func TestMergeExact(t *testing.T) {
	lat := [][]int64{ // µs, per worker
		repeat(1000, 990, 5000, 10),   // p99 1 ms
		repeat(2000, 990, 8000, 10),   // p99 2 ms
		repeat(3000, 500, 90000, 500), // p99 90 ms
	}
	union := NewHistogram()
	var ws []*labWorker
	for i, vals := range lat {
		w := &labWorker{addr: "w" + string(rune('0'+i)), plan: Plan{First: i * 10, Devices: 10}, res: &Results{}}
		// Spread each worker's values over two seconds.
		for sec := 1; sec <= 2; sec++ {
			h := NewHistogram()
			part := vals[(sec-1)*len(vals)/2 : sec*len(vals)/2]
			for _, v := range part {
				h.RecordValue(v)
				union.RecordValue(v)
			}
			enc, _ := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
			w.seconds = append(w.seconds, Second{T: sec, Kettles: 10, Endpoints: map[string]*EndpointSecond{
				EPMeasurement: {Offered: int64(len(part)), Requests: int64(len(part)), Histogram: string(enc)}}})
		}
		ws = append(ws, w)
	}
	res := mergeLab(ws, &Config{FleetConfig: FleetConfig{Devices: 30}}, time.Now(), time.Now())
	m := res.Totals.Endpoints[EPMeasurement]
	if want := float64(union.ValueAtQuantile(99)) / 1000; m.P99Ms != want {
		t.Errorf("merged p99 %.3f ms, union p99 %.3f ms", m.P99Ms, want)
	}
	if want := float64(union.ValueAtQuantile(50)) / 1000; m.P50Ms != want {
		t.Errorf("merged p50 %.3f ms, union p50 %.3f ms", m.P50Ms, want)
	}
	if m.Requests != union.TotalCount() || res.Totals.Requests != 3000 {
		t.Errorf("merged %d requests, union %d", m.Requests, union.TotalCount())
	}
	if avg := (1.0 + 2.0 + 90.0) / 3; m.P99Ms < 2*avg {
		t.Errorf("merged p99 %.1f ms is near the mean of the workers' p99s (%.1f ms): not a merge", m.P99Ms, avg)
	}
	if len(res.Seconds) != 2 || res.Seconds[0].Kettles != 30 || len(res.Seconds[1].Workers) != 3 {
		t.Errorf("seconds %+v", res.Seconds)
	}
}

func repeat(a int64, na int, b int64, nb int) []int64 {
	var out []int64
	for range na {
		out = append(out, a)
	}
	for range nb {
		out = append(out, b)
	}
	// Interleave, so each second has both.
	for i := range out {
		j := (i * 7919) % len(out)
		out[i], out[j] = out[j], out[i]
	}
	return out
}

// TestShardPlans: every kettle of the fleet is in exactly one shard, and a
// shard's kettles are the ones one process would run at those indexes.
func TestShardPlans(t *testing.T) {
	f := func(devices, workers int) {
		t.Helper()
		lc := &LabConfig{Config: Config{FleetConfig: FleetConfig{Devices: devices}, TransportConfig: TransportConfig{Conns: 100}}, Targets: []string{"http://127.0.0.1:1"}}
		for i := range workers {
			lc.Workers = append(lc.Workers, fmt.Sprintf("127.0.45.%d:1", 11+i))
		}
		seen := make([]int, devices)
		conns := 0
		for _, p := range shardPlans(lc, "r") {
			s := &Swarm{cfg: Config{FleetConfig: FleetConfig{First: p.First, Stride: p.Stride}}}
			for i := range p.Devices {
				g := s.fleetIndex(i)
				if g < 0 || g >= devices {
					t.Fatalf("%d kettles over %d workers: index %d outside the fleet", devices, workers, g)
				}
				seen[g]++
			}
			conns += p.Conns
		}
		for g, n := range seen {
			if n != 1 {
				t.Fatalf("%d kettles over %d workers: kettle %d in %d shards", devices, workers, g, n)
			}
		}
		if conns > 100 || conns < 100-workers {
			t.Errorf("%d kettles over %d workers: %d connections in all, want ≈ 100", devices, workers, conns)
		}
	}
	f(30, 3)
	f(31, 3)
	f(1000, 7)
	f(5, 5)
	f(100001, 6)
}

// TestLabGuards: the target guard on both sides, the token, the bounds.
func TestLabGuards(t *testing.T) {
	f := func(target string, allow []string, ok bool) {
		t.Helper()
		if _, err := CheckTarget(target, allow); (err == nil) != ok {
			t.Errorf("CheckTarget(%q, %v): %v, want ok=%v", target, allow, err, ok)
		}
	}
	f("http://127.0.0.1:8080", nil, true)
	f("http://10.1.2.3:8080", nil, false)
	f("http://kettles.example:8080", nil, false)
	f("http://kettles.example:8080", []string{"kettles.example"}, true)
	f("http://kettles.example.evil:8080", []string{"kettles.example"}, false)
	f("http://10.1.2.3:8080", []string{"10.1.2.4"}, false)
	if _, err := CheckTargetAddr("10.1.2.3:1883", []string{"10.1.2.3"}); err != nil {
		t.Error(err)
	}
	if _, err := CheckTargetAddr("10.1.2.3:1883", nil); err == nil {
		t.Error("CheckTargetAddr let a non-loopback MQTT target through")
	}
	if _, err := NewWorker(WorkerConfig{Token: "short"}); err == nil {
		t.Error("a worker took a 5-character token")
	}

	srv := startServer(t, mqttapi.Config{})
	ws := startWorkers(t, 2)
	run := func(mod func(*LabConfig), want string) {
		t.Helper()
		lc := labConfig(srv, srv.URL(), ws)
		mod(&lc)
		_, err := RunLab(t.Context(), lc)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("RunLab: %v, want an error with %q", err, want)
		}
	}
	// The controller allows a host the workers do not: they refuse.
	run(func(lc *LabConfig) {
		lc.Target, lc.AllowHosts = "http://kettles.example:8080", []string{"kettles.example"}
	}, "refusing --target http://kettles.example:8080")
	run(func(lc *LabConfig) { lc.Token = "wrong-token-0123456789" }, "401 Unauthorized: wrong or missing worker token")
	run(func(lc *LabConfig) { lc.Duration = 48 * time.Hour }, "duration 48h0m0s: want (0, 24h]")
	// A worker that refused has nothing running: a good run follows.
	lc := labConfig(srv, srv.URL(), ws)
	lc.Duration = time.Second
	if res, err := RunLab(t.Context(), lc); err != nil || res.Totals.Requests == 0 {
		t.Errorf("after the refusals: %v", err)
	}
}

// TestShardsAreTheFleet: kettle g set up in a shard has the phase and the
// physics it has in one process running the whole fleet, with or without a
// hatch rate, so the workers' schedules stay in step with each other.
func TestShardsAreTheFleet(t *testing.T) {
	at := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	setup := func(cfg Config) *Swarm {
		t.Helper()
		cfg.defaults()
		s := &Swarm{cfg: cfg, clock: func() time.Time { return at }}
		s.tr = &httpTransport{Swarm: s}
		if err := s.setup(t.Context()); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, hatch := range []float64{0, 3} {
		base := Config{TargetConfig: TargetConfig{Secret: []byte("s")}, FleetConfig: FleetConfig{Devices: 10, Seed: 5}, ScheduleConfig: ScheduleConfig{Interval: 30 * time.Second, HatchRate: hatch}}
		whole := setup(base)
		for i := range 3 {
			c := base
			c.First, c.Stride, c.Devices = i, 3, (10-i+2)/3
			shard := setup(c)
			for j := range shard.kettles {
				g := shard.fleetIndex(j)
				a, b := &whole.kettles[g], &shard.kettles[j]
				am, bm := a.model, b.model
				am.Last, bm.Last = time.Time{}, time.Time{}
				if a.phase != b.phase || am != bm {
					t.Errorf("hatch %g: kettle %d: phase %d model %+v in one process, phase %d model %+v in shard %d", hatch, g, a.phase, am, b.phase, bm, i)
				}
			}
		}
	}
}

// TestLabInterrupted: the operator's interrupt stops every worker, and the
// run still ends with every worker's results (none lost) and the audit.
func TestLabInterrupted(t *testing.T) {
	srv := startServer(t, mqttapi.Config{})
	ws := startWorkers(t, 2)
	lc := labConfig(srv, srv.URL(), ws)
	lc.Duration = time.Minute
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	time.AfterFunc(4*time.Second, cancel) // setup, the start delay, then ~2 s of run
	res, err := RunLab(ctx, lc)
	if err != nil {
		t.Fatal(err)
	}
	if lost := res.LostWorkers(); len(lost) != 0 || res.Totals.WallSeconds > 30 || res.Totals.Requests == 0 {
		t.Errorf("lost %+v, wall %.1fs, requests %d: want every worker's results, well before the minute", lost, res.Totals.WallSeconds, res.Totals.Requests)
	}
	if a := res.Audit; a == nil || a.Acked == 0 || a.Lost != 0 {
		t.Errorf("audit %+v", a)
	}
}

// TestPlansCarryOnlyTheSecretsTheyUse: the device secret goes to workers
// only when they derive v1 tokens (HTTP v1, MQTT), the operator token only
// when there is no secret to derive them with; v0 kettles log in and need
// neither. The audit is the controller's.
func TestPlansCarryOnlyTheSecretsTheyUse(t *testing.T) {
	f := func(api, protocol string, secret []byte, op string, wantSecret bool, wantOp bool) {
		t.Helper()
		lc := &LabConfig{Workers: []string{"127.0.0.1:1", "127.0.0.1:2"}, Targets: []string{"http://127.0.0.1:8080"}, MQTTTargets: []string{"127.0.0.1:1883"}}
		lc.Config = Config{TargetConfig: TargetConfig{Secret: secret, Operator: op}, FleetConfig: FleetConfig{Devices: 4},
			TransportConfig: TransportConfig{API: api, Protocol: protocol}}
		for _, p := range shardPlans(lc, "run") {
			if (len(p.Secret) > 0) != wantSecret || (p.Operator != "") != wantOp {
				t.Errorf("api %s %s: plan carries secret %v, operator token %v; want %v, %v", api, protocol, len(p.Secret) > 0, p.Operator != "", wantSecret, wantOp)
			}
		}
	}
	f("v1", ProtocolHTTP, []byte("secret-0123456789"), "operator-0123456789", true, false)
	f("v1", ProtocolHTTP, nil, "operator-0123456789", false, true)
	f("v0", ProtocolHTTP, []byte("secret-0123456789"), "operator-0123456789", false, false)
	f("v1", ProtocolMQTT, []byte("secret-0123456789"), "operator-0123456789", true, false)
}
