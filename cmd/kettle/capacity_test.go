package main

import (
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestCapacityAndReport steps a tiny fleet against a real in-process server
// (SQLite) and checks the answer, the steps, and that kettle report reads
// what a step wrote.
func TestCapacityAndReport(t *testing.T) {
	dir := t.TempDir()
	srv, err := server.Start(t.Context(), server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + filepath.Join(dir, "k.db"), DataDir: dir,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	var f swarmFlags
	f.cfg.Target, f.cfg.Operator, f.secret = srv.URL(), srv.OperatorToken(), string(srv.Secret())
	f.cfg.Interval, f.cfg.Timeout, f.cfg.Batch, f.conns = time.Second, 5*time.Second, 1, "20"
	f.sloP99, f.maxErrorRate, f.sample, f.serverPID, f.postgresPID = 10*time.Second, 0.5, true, os.Getpid(), -1
	f.seed = new(uint64)
	f.out = filepath.Join(dir, "cap")
	f.command = "kettle capacity (test)"
	if err := f.resolve(); err != nil {
		t.Fatal(err)
	}
	err = f.capacity(t.Context(), io.Discard, capacityPlan{start: 20, step: 20, max: 40, dur: 3 * time.Second, warmup: time.Second, pause: 100 * time.Millisecond})
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
	c := s.Capacity
	if c == nil || len(c.Steps) != 2 || c.Holds != 40 || c.BreaksAt != 0 || !strings.HasPrefix(c.Line, "holds 40 kettles at p99 ≤ 10s") {
		t.Fatalf("capacity %+v", c)
	}
	for _, st := range c.Steps {
		if st.DonePerS <= 0 || st.OfferedPerS <= 0 || st.P99Ms <= 0 || st.Verdict.Text == "" {
			t.Errorf("step %+v", st)
		}
		// 40 kettles for 3 s stage far fewer rows than a merge needs.
		if p := st.Periodic; p == nil || p.Store != "sqlite" || p.Merges != 0 || p.JudgedS <= 0 {
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
