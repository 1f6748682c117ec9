package main

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sim"
)

// TestCapacityAndReport steps a tiny fleet against a real in-process server
// (SQLite) and checks the answer, the steps, and that kettle report reads
// what a step wrote.
func TestCapacityAndReport(t *testing.T) {
	dir, srv := sqliteServer(t)
	f := testCapacityFlags(srv)
	f.sloP99, f.maxErrorRate, f.sample, f.serverPID, f.postgresPID = 10*time.Second, 0.5, true, os.Getpid(), -1
	f.out = filepath.Join(dir, "cap")
	f.command = "kettle capacity (test)"
	s := stepCapacity(t, &f)
	c := s.Capacity
	if c == nil || len(c.Steps) != 2 || c.Holds != 40 || c.BreaksAt != 0 || !strings.HasPrefix(c.Line, "holds 40 kettles at p99 ≤ 10s") {
		t.Fatalf("capacity %+v", c)
	}
	for _, st := range c.Steps {
		if st.DonePerS <= 0 || st.OfferedPerS <= 0 || st.P99Ms <= 0 || st.Verdict.Text == "" {
			t.Errorf("step %+v", st)
		}
		// 40 kettles for 3 s stage far fewer rows than a merge needs.
		// One sample in the judged window (a starved sampler on a loaded
		// machine) is a window of 0 s, not an error.
		if p := st.Periodic; p == nil || p.Store != "sqlite" || p.Merges != 0 || p.JudgedS < 0 {
			t.Errorf("step %d: periodic work %+v, want SQLite with no merge", st.Kettles, p)
		}
	}
	if !strings.HasPrefix(c.Caveat, "the 40-kettle step: no merge of the embedded store's staged rows") {
		t.Errorf("caveat %q", c.Caveat)
	}
	if h, err := os.ReadFile(filepath.Join(f.out, "report.html")); err != nil || !strings.Contains(string(h), `id="capacity-caveat"`) || !strings.Contains(string(h), "SQLite: 0 merges of staged rows") {
		t.Errorf("report.html without the caveat or the steps' periodic work (err %v)", err)
	}
	if s.Series.CPU["server"] == nil || s.Series.Queue["capacity"] == nil {
		t.Errorf("the step's system samples are missing from the report: cpu %v queue %v", s.Series.CPU, s.Series.Queue)
	}
	out := filepath.Join(dir, "r.html")
	if err := runReport(t.Context(), []string{c.Steps[0].Results, "-o", out}); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(out); err != nil || st.Size() < 10000 {
		t.Fatalf("report %v %v", st, err)
	}
}

// TestCapacityJSONUnwritable: a capacity run that cannot write
// capacity.json fails, naming the file, instead of ending as if it had.
func TestCapacityJSONUnwritable(t *testing.T) {
	dir, srv := sqliteServer(t)
	f := testCapacityFlags(srv)
	f.sloP99, f.maxErrorRate = 10*time.Second, 0.5
	f.out = filepath.Join(dir, "cap")
	f.command = "kettle capacity (test)"
	// A directory where the file goes: the write fails as on a full or
	// read-only disk.
	if err := os.MkdirAll(filepath.Join(f.out, "capacity.json"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := f.resolve(); err != nil {
		t.Fatal(err)
	}
	err := f.capacity(t.Context(), io.Discard, capacityPlan{start: 20, step: 20, max: 20, dur: 2 * time.Second, warmup: time.Second})
	if err == nil || !strings.Contains(err.Error(), filepath.Join(f.out, "capacity.json")) {
		t.Fatalf("capacity with an unwritable capacity.json: err %v, want one naming the file", err)
	}
}

// TestCapacityMQTT: kettle capacity --protocol mqtt steps a fleet of
// connected MQTT kettles (one connection each) against the embedded
// listener and judges their PUBACKs.
func TestCapacityMQTT(t *testing.T) {
	dir, srv := sqliteServer(t, func(c *server.Config) { c.MQTT.Addr = "127.0.0.1:0" })
	f := testCapacityFlags(srv)
	f.cfg.Protocol, f.cfg.MQTTTarget, f.cfg.MQTTInflight, f.cfg.API = sim.ProtocolMQTT, srv.MQTTAddr(), 1, "v1"
	f.sloP99, f.maxErrorRate, f.sample, f.serverPID, f.postgresPID = 10*time.Second, 0.5, false, os.Getpid(), -1
	f.out = filepath.Join(dir, "cap")
	f.command = "kettle capacity --protocol mqtt (test)"
	s := stepCapacity(t, &f)
	c := s.Capacity
	if c == nil || len(c.Steps) != 2 || c.Holds != 40 || !strings.HasPrefix(c.Line, "holds 40 kettles at p99 ≤ 10s") {
		t.Fatalf("capacity %+v", c)
	}
	res, err := os.ReadFile(c.Steps[1].Results)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(res), `"`+sim.EPMQTTPublish+`"`) || !strings.Contains(string(res), "--protocol mqtt --mqtt-target "+srv.MQTTAddr()) {
		t.Errorf("the step's results.json has no %s endpoint or no --protocol mqtt in its command", sim.EPMQTTPublish)
	}
	if st := c.Steps[1]; st.DonePerS <= 0 || st.P99Ms <= 0 {
		t.Errorf("step %+v", st)
	}
}

// TestCapacityOverWorkers steps a fleet split over two swarm workers: each
// step is one merged run of the same workers.
func TestCapacityOverWorkers(t *testing.T) {
	dir, srv := sqliteServer(t)
	const token = "capacity-lab-token-0123"
	var addrs []string
	for i := range 2 {
		ip := net.IPv4(127, 0, 45, byte(41+i))
		l, err := net.Listen("tcp", ip.String()+":0")
		if err != nil {
			t.Fatal(err)
		}
		w, err := sim.NewWorker(sim.WorkerConfig{Token: token, SourceAddrs: []net.IP{ip}, ReserveFDs: 1000})
		if err != nil {
			t.Fatal(err)
		}
		hs := sim.NewWorkerServer(w.Handler())
		go hs.Serve(l)
		defer w.Close()
		defer hs.Close()
		addrs = append(addrs, l.Addr().String())
	}
	f := testCapacityFlags(srv)
	f.sloP99, f.maxErrorRate, f.sample = 10*time.Second, 0.5, false
	f.workers, f.workerToken = strings.Join(addrs, ","), token
	f.out = filepath.Join(dir, "cap")
	f.command = "kettle capacity --workers (test)"
	stepCapacity(t, &f)
	for _, n := range []int{20, 40} {
		r, err := sim.ReadResults(filepath.Join(f.out, fmt.Sprintf("step-%07d", n), "results.json"))
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Workers) != 2 || r.Params.Devices != n || r.Workers[0].Devices+r.Workers[1].Devices != n || r.Workers[1].First != 1 || r.Workers[1].Stride != 2 {
			t.Errorf("step %d: params %+v workers %+v", n, r.Params, r.Workers)
		}
		if r.Workers[0].Requests == 0 || r.Workers[1].Requests == 0 || r.Workers[0].Requests+r.Workers[1].Requests != r.Totals.Requests {
			t.Errorf("step %d: workers' requests %d + %d, merged %d", n, r.Workers[0].Requests, r.Workers[1].Requests, r.Totals.Requests)
		}
	}
}

// sqliteServer starts a real kettle serve in this process on a fresh SQLite
// store in a temporary data dir, stopped when the test ends.
func sqliteServer(t *testing.T, opts ...func(*server.Config)) (string, *server.Server) {
	t.Helper()
	dir := t.TempDir()
	cfg := server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + filepath.Join(dir, "k.db"), DataDir: dir,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	for _, o := range opts {
		o(&cfg)
	}
	srv, err := server.Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return dir, srv
}

// testCapacityFlags are the flags the capacity tests share: srv's target and
// credentials, a 1 s interval, batches of 1, 20 connections.
func testCapacityFlags(srv *server.Server) swarmFlags {
	var f swarmFlags
	f.cfg.Target, f.cfg.Operator, f.secret = srv.URL(), srv.OperatorToken(), string(srv.Secret())
	f.cfg.Interval, f.cfg.Timeout, f.cfg.Batch, f.conns = time.Second, 5*time.Second, 1, "20"
	f.seed = new(uint64)
	return f
}

// stepCapacity resolves f and steps 20 then 40 kettles, 3 s a step; it
// returns the summary (capacity.json) the run wrote.
func stepCapacity(t *testing.T, f *swarmFlags) report.Summary {
	t.Helper()
	if err := f.resolve(); err != nil {
		t.Fatal(err)
	}
	err := f.capacity(t.Context(), io.Discard, capacityPlan{start: 20, step: 20, max: 40, dur: 3 * time.Second, warmup: time.Second, pause: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(f.out, "capacity.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s report.Summary
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return s
}
