package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
	"github.com/kettlefleet/kettlefleet/sim"
)

func init() {
	parts = append(parts, part{"nem-worker-cut", "10h. The lab's workers on machines of their own, one cut from the controller mid-run", partWorkerCut})
}

// partWorkerCut: three kettle swarm workers, each on a machine of its own
// (cluster.sh workers 3), load the nodes through HAProxy for a controller
// on this host; 30 s in, worker2 is cut from the controller (partition
// worker2 host) until 75 s. The run must end on its own, with one merged
// audit of what the other workers acknowledged, and say what it could not
// measure: the cut worker's share.
func partWorkerCut(ctx context.Context, e *env) *Result {
	const d = 100 * time.Second
	r := &Result{Pass: true, Command: "go run ./chaos/cmd/chaos nem-worker-cut",
		Done: fmt.Sprintf("deploy/cluster.sh up and workers 3 (netns: each worker a machine); kettle swarm --workers (the controller on this host), 300 HTTP v1 kettles every 2 s through HAProxy for %s; "+
			"worker2 cut from the controller (cluster.sh partition worker2 host) from +30 s to +75 s", d)}
	if haMode() != "netns" {
		return r.fail("needs every member on a machine of its own: run with KETTLE_HA_MODE=netns")
	}
	t, err := upTopo(ctx, e, 2, false)
	if err != nil {
		return r.fail("%v", err)
	}
	defer t.down()
	out := filepath.Join(e.out, "nem-worker-cut")
	os.RemoveAll(out)
	t.keep = out // the members' logs, the workers' too, also when they do not start
	list, err := t.cmd(ctx, 2*time.Minute, "workers", "3")
	if err != nil {
		return r.fail("cluster.sh workers 3: %v: %s", err, lastLines(list, 3))
	}
	list = lastLines(list, 1)
	token, err := t.cmd(ctx, 30*time.Second, "worker-token")
	if err != nil {
		return r.fail("cluster.sh worker-token: %v", err)
	}
	// Off loopback the workers listen with TLS, certificates from the
	// topology's CA.
	ca, err := t.cmd(ctx, 30*time.Second, "ca")
	if err != nil {
		return r.fail("cluster.sh ca: %v: %s", err, ca)
	}
	// The workers' token travels in the environment (kettle swarm's
	// KETTLE_WORKER_TOKEN), never in argv.
	os.Setenv("KETTLE_WORKER_TOKEN", token)
	sw, err := startSwarm(e, t.balancer, out, append([]string{"--workers", list, "--worker-ca", ca, "--api", "v1", "--devices", "300", "--interval", "2s",
		"--duration", d.String(), "--hatch-rate", "0"}, t.swarmArgs()...)...)
	os.Unsetenv("KETTLE_WORKER_TOKEN")
	if err != nil {
		return r.fail("swarm: %v", err)
	}
	s := &nemesis.Schedule{Duration: d, HealedBy: d, Faults: []nemesis.Fault{fault(nemesis.Partition, "worker2 cut from the controller", 30*time.Second, 75*time.Second,
		[]string{"partition", "worker2", "host"}, []string{"unpartition", "worker2", "host"})}}
	iv := nemesis.Run(ctx, s, sw.started, t, e.logf)
	v := nemesis.Verdict{Pass: true}
	v.Add(nemesis.Faults(iv))
	// Bounded: the run's length, the controller's wait for a silent
	// worker, and the audit.
	res, code, err := sw.wait(ctx, d+5*time.Minute)
	if err != nil {
		v.Add(nemesis.Check{Name: "the run ends on its own with its results", Detail: err.Error()})
	} else {
		v.Add(nemesis.Check{Name: "the run ends on its own with its results", Pass: true, Detail: fmt.Sprintf("exit %d after %.0fs", code, time.Since(sw.started).Seconds())})
		lost := res.LostWorkers()
		var names []string
		for _, w := range lost {
			names = append(names, fmt.Sprintf("%s (%d kettles, measured until +%ds: %s)", w.Addr, w.Devices, w.LastT, w.Error))
		}
		v.Add(nemesis.Check{Name: "it names the worker it lost and what it could not measure", Pass: len(lost) == 1 && strings.Contains(lost[0].Addr, ".102:") && code != 0,
			Detail: fmt.Sprintf("%d of %d workers lost: %s; swarm exit %d: %s", len(lost), len(res.Workers), strings.Join(names, "; "), code, tail(sw.logPath, 1))})
		a := nemesis.Audits(map[string]*sim.Results{"merged (the workers still answering)": res})
		v.Add(a[0])
	}
	return judged(r, v, "a worker cut from the controller: the run ends with a merged audit (lost=0 duplicated=0) and names the share it could not measure")
}

func init() {
	parts = append(parts, part{"nem-clock", "10g. A node's clock an hour ahead or behind, beside one on the true clock", partClock})
}

// partClock runs scenario g as the Go test it is (chaos/nemesis
// TestNodeClockSkew): deploy/cluster.sh's clock verb cannot move a Go
// program's clock (faketime does not reach the vDSO), so the skewed node
// runs in-process with the skew in its clock field.
func partClock(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Command: "KETTLE_CHAOS=1 go test -count=1 -v -run ^TestNodeClockSkew$ ./chaos/nemesis/",
		Done: "two kettle serve nodes on one PostgreSQL, 30 days of retention, one on the true clock (the database's), the second's clock +1 h, then −1 h: " +
			"a reading 10 minutes inside retention stored before the skewed node starts (it expires at start) must stay; the skewed node either refuses clearly " +
			"(/readyz 503 naming its clock, a reading 30 minutes inside retention 503 + Retry-After, never 400, statistics 503) or serves unharmed " +
			"(a v1 token and a v0 login on both nodes, readings of three hours of day through both, statistics of both against the rows, the reading 30 minutes inside accepted)"}
	os.Setenv("KETTLE_CHAOS", "1")
	defer os.Unsetenv("KETTLE_CHAOS")
	out, err := goTest(ctx, e, 5*time.Minute, "-count=1", "-v", "-run", "^TestNodeClockSkew$", "./chaos/nemesis/")
	r.Rows = testRows(out, "TestNodeClockSkew")
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "clock_test.go") {
			r.measure("%s", strings.TrimSpace(l))
		}
	}
	if err != nil {
		return r.fail("go test: %v %s", err, failureExcerpt(out))
	}
	r.Verdict = "a node an hour ahead or behind: retention unharmed, and the node refuses to serve with a clear error (--max-clock-skew) or serves statistics and credentials unharmed"
	return r
}
