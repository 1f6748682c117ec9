package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sim"
)

// Crash: a swarm runs against kettle serve; the server is killed with
// SIGKILL mid-run and restarted on the same port; the kettles retry; the
// swarm's audit must find every acknowledged reading stored exactly once.
// Once on PostgreSQL (v1 kettles) and once on the embedded store (case-study
// v0 kettles, which log in first).
func partCrash(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "kettle swarm (1,000 kettles, one reading + one poll every 2 s, 45 s) against kettle serve, both real processes; " +
		"SIGKILL to the server 15 s in, restarted 2 s later on the same port and data; the swarm's kettles retry with backoff; " +
		"then the swarm audits every acknowledged reading through the operator API. Once on PostgreSQL (v1 API), once on the embedded SQLite store (case-study v0 protocol)."}
	pg, err := startPG()
	if err != nil {
		return r.fail("start PostgreSQL: %v", err)
	}
	defer pg.close()
	dsn, err := pg.createDB("chaos_crash")
	if err != nil {
		return r.fail("create database: %v", err)
	}
	dir := filepath.Join(e.out, "crash")
	os.RemoveAll(dir)
	for _, c := range []struct{ store, db, api string }{
		{"postgres", dsn, "v1"},
		{"sqlite", "sqlite:" + filepath.Join(dir, "sqlite", "data", "kettle.db"), "v0"},
	} {
		line, ok := crashOnce(ctx, e, filepath.Join(dir, c.store), c.store, c.db, c.api)
		r.measure("%s", line)
		if !ok {
			r.fail("%s", line)
		}
		if ctx.Err() != nil {
			return r.fail("interrupted")
		}
	}
	if r.Pass {
		r.Verdict = "0 acknowledged readings lost, 0 duplicated after kill -9 on PostgreSQL and SQLite"
	}
	return r
}

func crashOnce(ctx context.Context, e *env, dir, store, db, api string) (string, bool) {
	data := filepath.Join(dir, "data")
	os.MkdirAll(data, 0o755)
	addr, err := freeAddr()
	if err != nil {
		return store + ": " + err.Error(), false
	}
	logPath := filepath.Join(dir, "serve.log")
	srv, err := startServe(ctx, e, addr, data, db, logPath)
	if err != nil {
		return store + ": " + err.Error(), false
	}
	defer func() { srv.stop() }()
	const (
		duration = 45 * time.Second
		killAt   = 15 * time.Second
		down     = 2 * time.Second
	)
	sw, err := startSwarm(e, srv.url, filepath.Join(dir, "swarm"), "--devices", "1000", "--interval", "2s", "--duration", duration.String(),
		"--api", api, "--data-dir", data, "--conns", "per-device")
	if err != nil {
		return store + ": " + err.Error(), false
	}
	sleep(ctx, killAt)
	e.logf("%s: kill -9 kettle serve (pid %d)", store, srv.pid())
	killed := time.Now()
	srv.kill9()
	sleep(ctx, down)
	if err := srv.start(ctx, e); err != nil {
		sw.cmd.Process.Kill()
		return fmt.Sprintf("%s: restart after kill -9 failed: %v", store, err), false
	}
	back := time.Now()
	e.logf("%s: kettle serve back after %.1fs (pid %d)", store, back.Sub(killed).Seconds(), srv.pid())
	res, code, err := sw.wait(ctx, duration+5*time.Minute)
	if err != nil {
		return fmt.Sprintf("%s: swarm: %v", store, err), false
	}
	a := res.Audit
	if a == nil {
		return fmt.Sprintf("%s: the swarm ran no audit (exit %d): %s", store, code, tail(sw.logPath, 2)), false
	}
	// The kill must have been felt, and the kettles must have come back.
	errsDown := errorsBetween(res, killed, back.Add(time.Second))
	ackedAfter := ackedBetween(res, back.Add(time.Second), res.End)
	ackedBefore := ackedBetween(res, res.Start, killed)
	line := fmt.Sprintf("%s (%s): acked=%d stored=%d lost=%d duplicated=%d; acked before the kill %d, after the restart %d; "+
		"down %.1fs (kill → listening again), %d failed requests meanwhile (%s), retried readings answered as duplicates %d, stored but never acked %d",
		store, api, a.Acked, a.Stored, a.Lost, a.Duplicated, ackedBefore, ackedAfter, back.Sub(killed).Seconds(), errsDown.n, fmtCounts(errsDown.kinds),
		res.Totals.DuplicatesReported, a.Unacked)
	ok := true
	switch {
	case a.Lost > 0 || a.Duplicated > 0:
		ok = false
		line += fmt.Sprintf(" — AUDIT FAILED (e.g. %v)", a.Examples)
	case code != 0:
		ok = false
		line += fmt.Sprintf(" — swarm exit %d: %s", code, tail(sw.logPath, 1))
	case ackedBefore == 0 || ackedAfter == 0:
		ok = false
		line += " — the run did not ingest on both sides of the kill: proves nothing"
	case srv.panicked():
		ok = false
		line += " — the server log shows a panic"
	}
	return line, ok
}

type errCount struct {
	n     int64
	kinds map[string]int
}

// errorsBetween sums the swarm's failed requests in seconds overlapping
// [from, to).
func errorsBetween(res *sim.Results, from, to time.Time) errCount {
	ec := errCount{kinds: map[string]int{}}
	for _, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.Add(time.Second).Before(from) || !t.Before(to) {
			continue
		}
		for _, ep := range s.Endpoints {
			for k, v := range ep.Errors {
				ec.n += v
				ec.kinds[k] += int(v)
			}
		}
	}
	return ec
}

func ackedBetween(res *sim.Results, from, to time.Time) int64 {
	var n int64
	for _, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.Before(from) || !t.Before(to) {
			continue
		}
		n += s.Acked
	}
	return n
}

// swarmLatency merges the swarm's per-second histograms of one endpoint
// over the seconds that start in [from, to): latency from the intended send
// time, as every kettle saw it.
func swarmLatency(res *sim.Results, ep string, from, to time.Time) latStats {
	h := sim.NewHistogram()
	for _, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.Before(from) || !t.Before(to) {
			continue
		}
		e := s.Endpoints[ep]
		if e == nil || e.Histogram == "" {
			continue
		}
		if sh, err := hdrhistogram.Decode([]byte(e.Histogram)); err == nil {
			h.Merge(sh)
		}
	}
	if h.TotalCount() == 0 {
		return latStats{}
	}
	us := func(q float64) time.Duration { return time.Duration(h.ValueAtQuantile(q)) * time.Microsecond }
	return latStats{n: int(h.TotalCount()), p50: us(50), p99: us(99), max: time.Duration(h.Max()) * time.Microsecond}
}

// cpuSeconds is a process's user+system CPU time so far.
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	return (u + k) / 100 // USER_HZ
}
