package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/blackhole"
	"github.com/kettlefleet/kettlefleet/sim"
)

// Outage: PostgreSQL is stopped (pg_ctl stop -m fast) for 30 s while a
// swarm runs. Probes on their own connections measure what a kettle and an
// orchestrator see before, during and after.
func partOutage(ctx context.Context, e *env) *Result { return outage(ctx, e, false) }

// Blackhole outage: the same, but PostgreSQL stays up and becomes
// unreachable: a proxy between kettle serve and it stops forwarding
// (packets dropped, nothing closed), so only --store-timeout ends a call.
func partOutageBlackhole(ctx context.Context, e *env) *Result { return outage(ctx, e, true) }

// outageStoreTimeout is the --store-timeout the outage parts run with (the
// default): uploads must be answered within twice it.
const outageStoreTimeout = 5 * time.Second

// The outage's fleet and clock: the swarm runs outageDuration; PostgreSQL
// goes away outageBefore into it, for outageFor.
const (
	outageDevices  = 1000
	outageInterval = 2 * time.Second
	outageBefore   = 20 * time.Second
	outageFor      = 30 * time.Second
	outageDuration = 90 * time.Second
)

func outage(ctx context.Context, e *env, blackholed bool) *Result {
	name, how := "outage", "PostgreSQL stopped with `pg_ctl stop -m fast`"
	if blackholed {
		name, how = "outage-blackhole", "PostgreSQL made unreachable (a TCP proxy between kettle serve and it stops forwarding: packets dropped, no connection closed)"
	}
	r := &Result{Pass: true, Done: fmt.Sprintf("kettle serve (--store-timeout %s) on PostgreSQL under kettle swarm (%d v1 kettles, every %s, %s); %s in, %s "+
		"for %s, then back. Probes on their own keep-alive connections: GET /v1/command 10/s, POST /v1/measurements 4/s, GET /readyz and /healthz 2/s; "+
		"then the swarm audits every acknowledged reading.", outageStoreTimeout, outageDevices, outageInterval, outageDuration, outageBefore, how, outageFor)}
	o := &outageRun{r: r, blackholed: blackholed}
	var err error
	if o.pg, err = startPG(); err != nil {
		return r.fail("start PostgreSQL: %v", err)
	}
	defer o.pg.close()
	dsn, err := o.pg.createDB("chaos_" + strings.ReplaceAll(name, "-", "_"))
	if err != nil {
		return r.fail("create database: %v", err)
	}
	if blackholed {
		network, target := blackhole.Target(dsn)
		if o.proxy, err = blackhole.Listen("127.0.0.1:0", network, target); err != nil {
			return r.fail("blackhole proxy: %v", err)
		}
		defer o.proxy.Close()
		dsn = blackhole.Via(dsn, o.proxy.Addr())
	}
	if o.srv, o.dir, o.data, err = startPartServe(ctx, e, name, dsn, "--store-timeout", outageStoreTimeout.String()); err != nil {
		return r.fail("%v", err)
	}
	defer o.srv.stop()
	if err := o.run(ctx, e); err != nil {
		return r.fail("%v", err)
	}
	sb, sd := o.judgePolls()
	o.judgeIngest()
	o.judgeReadiness()
	o.judgeSwarm()
	if r.Pass {
		r.Verdict = fmt.Sprintf("polls p99 %s during vs %s before, ingest 503+Retry-After, /readyz 503, no crash; drained, audit clean", ms(sd.p99), ms(sb.p99))
	}
	return r
}

// outageRun is one outage part: what it runs against, and what its probes
// and swarm saw around the outage, for the judges.
type outageRun struct {
	r          *Result
	blackholed bool
	pg         *pgCluster
	proxy      *blackhole.Proxy
	srv        *serveProc
	dir, data  string

	cmdP, ingP, readyP, healthP *probe
	// The run's moments: warm is the end of the swarm's start; the
	// database goes away from stopBegin (gone at stopped) and comes back
	// from startBegin (back at started).
	warm, stopBegin, stopped, startBegin, started time.Time
	cpuBefore, cpuDuring                          float64 // of one core
	res                                           *sim.Results
	code                                          int
	swarmLog                                      string
	alive                                         bool
}

// run starts the probes and the swarm, takes the database away for
// outageFor and brings it back, and waits for the swarm's end.
func (o *outageRun) run(ctx context.Context, e *env) error {
	dev := newProbeDevice(readSecret(o.data, "secret"))
	pctx, pcancel := context.WithTimeout(ctx, outageDuration+2*time.Minute)
	defer pcancel()
	url := o.srv.url
	o.cmdP = newProbe("command", 2, 5*time.Second, dev.commandReq(url))
	// Enough connections that a request never waits for one while the
	// ones before it wait out --store-timeout (4/s and 2/s for 2 × 5 s):
	// the probe times the server, not its own connection pool.
	o.ingP = newProbe("ingest", 48, 15*time.Second, dev.readingReq(url, time.Now().Add(-time.Hour)))
	o.readyP = newProbe("readyz", 24, 3*outageStoreTimeout, getReq(url+"/readyz"))
	o.healthP = newProbe("healthz", 1, 5*time.Second, getReq(url+"/healthz"))
	o.ingP.once(0) // registers the probe kettle

	sw, err := startSwarm(e, url, filepath.Join(o.dir, "swarm"), "--devices", fmt.Sprint(outageDevices), "--interval", outageInterval.String(),
		"--duration", outageDuration.String(), "--api", "v1", "--data-dir", o.data, "--conns", "per-device")
	if err != nil {
		return err
	}
	o.swarmLog = sw.logPath
	n := int((outageDuration + time.Minute) / (100 * time.Millisecond))
	wgs := []interface{ Wait() }{
		o.cmdP.run(pctx, 100*time.Millisecond, n),
		o.ingP.run(pctx, 250*time.Millisecond, n),
		o.readyP.run(pctx, 500*time.Millisecond, n),
		o.healthP.run(pctx, 500*time.Millisecond, n),
	}
	o.cutOff(ctx, e)
	res, code, err := sw.wait(ctx, outageDuration+5*time.Minute)
	pcancel()
	for _, w := range wgs {
		w.Wait()
	}
	o.alive = o.srv.alive()
	if err != nil {
		return fmt.Errorf("swarm: %v", err)
	}
	o.res, o.code = res, code
	return nil
}

// cutOff waits outageBefore, takes the database away for outageFor, and
// brings it back, noting the moments and the server's CPU around them.
func (o *outageRun) cutOff(ctx context.Context, e *env) {
	pid := o.srv.pid()
	t0 := time.Now()
	o.warm = t0.Add(5 * time.Second)
	sleep(ctx, 5*time.Second)
	cpuWarm, warmAt := cpuSeconds(pid), time.Now()
	sleep(ctx, outageBefore-5*time.Second)
	cpuStop := cpuSeconds(pid)
	o.stopBegin = time.Now()
	o.database(e, false)
	o.stopped = time.Now()
	cpuStopped := cpuSeconds(pid)
	sleep(ctx, outageFor-o.stopped.Sub(o.stopBegin))
	cpuStart := cpuSeconds(pid)
	o.startBegin = time.Now()
	o.database(e, true)
	o.started = time.Now()
	e.logf("outage: PostgreSQL back (stop took %.1fs, start %.1fs)", o.stopped.Sub(o.stopBegin).Seconds(), o.started.Sub(o.startBegin).Seconds())
	o.cpuBefore = (cpuStop - cpuWarm) / o.stopBegin.Sub(warmAt).Seconds()
	o.cpuDuring = (cpuStart - cpuStopped) / o.startBegin.Sub(o.stopped).Seconds()
}

// database takes PostgreSQL away (stopped, or blackholed) or brings it back.
func (o *outageRun) database(e *env, up bool) {
	switch {
	case o.blackholed && !up:
		e.logf("outage: the proxy to PostgreSQL stops forwarding")
		o.proxy.Block(true)
	case o.blackholed:
		e.logf("outage: the proxy forwards again")
		o.proxy.Block(false)
	case !up:
		e.logf("outage: pg_ctl stop -m fast")
		if err := o.pg.stop(); err != nil {
			o.r.fail("stop PostgreSQL: %v", err)
		}
	default:
		e.logf("outage: pg_ctl start")
		if err := o.pg.start(); err != nil {
			o.r.fail("start PostgreSQL again: %v", err)
		}
	}
}

// judgedUntil is the end of the outage's judged window: unreachable, a
// request sent less than --store-timeout before the database is back is
// still waiting for it then, and rightly succeeds: those are not judged.
func (o *outageRun) judgedUntil() time.Time {
	if o.blackholed {
		return o.startBegin.Add(-outageStoreTimeout - time.Second)
	}
	return o.startBegin
}

// judgePolls holds the command polls during the outage to their latency
// before it; it returns the probe's latency before and during.
func (o *outageRun) judgePolls() (sb, sd latStats) {
	r := o.r
	// Windows: before = the steady run before the stop, during = from the
	// moment the stop completed to the start command, after = PostgreSQL up.
	cb, cd := o.cmdP.between(o.warm, o.stopBegin), o.cmdP.between(o.stopped, o.startBegin)
	sb, sd = stats(cb, nil), stats(cd, nil)
	r.measure("probe GET /v1/command before the outage: %s (%s); during: %s (%s)", sb, fmtCounts(byStatus(cb)), sd, fmtCounts(byStatus(cd)))
	wb, wd := swarmLatency(o.res, "command", o.warm, o.stopBegin), swarmLatency(o.res, "command", o.stopped, o.startBegin)
	r.measure("swarm's 1,000 kettles, GET /v1/command before: %s; during: %s", wb, wd)
	r.measure("server CPU before the outage %.0f%%, during %.0f%% of one core", 100*o.cpuBefore, 100*o.cpuDuring)
	if n := countNot(cd, 200); n > 0 || len(cd) == 0 {
		r.fail("%d of %d command polls during the outage were not 200", n, len(cd))
	}
	// "Within its normal latency": the SLO (100 ms), or, on a machine whose
	// noise already puts the p99 near it before the outage, 1.5× that p99.
	normal := max(100*time.Millisecond, sb.p99*3/2)
	if sd.p99 > normal {
		r.fail("command poll p99 during the outage %s > %s (p99 before %s)", ms(sd.p99), ms(normal), ms(sb.p99))
	}
	return sb, sd
}

// judgeIngest: uploads during the outage are answered 503 with
// Retry-After within twice --store-timeout; never 500.
func (o *outageRun) judgeIngest() {
	r := o.r
	id := o.ingP.between(o.stopped.Add(time.Second), o.judgedUntil())
	noRA, slow := 0, 0
	for _, s := range id {
		if s.status == 503 && s.retryAfter == "" {
			noRA++
		}
		if s.lat > 2*outageStoreTimeout {
			slow++
		}
	}
	if slow > 0 {
		r.fail("%d of %d ingest requests during the outage took longer than 2 × --store-timeout (%s)", slow, len(id), 2*outageStoreTimeout)
	}
	r.measure("POST /v1/measurements during the outage: %s, latency %s, 503s without Retry-After: %d", fmtCounts(byStatus(id)), stats(id, nil), noRA)
	if n := countNot(id, 503); n > 0 || len(id) == 0 {
		r.fail("%d of %d ingest requests during the outage were not 503", n, len(id))
	}
	if noRA > 0 {
		r.fail("%d 503s without Retry-After", noRA)
	}
}

// judgeReadiness: /readyz ready before, not ready during, ready again
// after (and how soon); the process up and /healthz 200 throughout.
func (o *outageRun) judgeReadiness() {
	r := o.r
	rb, rd := o.readyP.between(o.warm, o.stopBegin), o.readyP.between(o.stopped.Add(time.Second), o.judgedUntil())
	r.measure("/readyz before: %s; during: %s", fmtCounts(byStatus(rb)), fmtCounts(byStatus(rd)))
	if countNot(rb, 200) > 0 || countNot(rd, 503) > 0 || len(rd) == 0 {
		r.fail("/readyz did not say ready before and not ready (503) during the outage")
	}
	readyAgain := firstAfter(o.readyP.all(), o.started, 200)
	ingestAgain := firstAfter(o.ingP.all(), o.started, 200)
	if readyAgain.IsZero() || ingestAgain.IsZero() {
		r.fail("after PostgreSQL returned: /readyz ready again %v, ingest 200 again %v", !readyAgain.IsZero(), !ingestAgain.IsZero())
	} else {
		r.measure("after PostgreSQL was back: /readyz 200 again after %.1fs, probe ingest 200 again after %.1fs", readyAgain.Sub(o.started).Seconds(), ingestAgain.Sub(o.started).Seconds())
	}
	hs := o.healthP.all()
	r.measure("server process alive throughout: %v; /healthz answers %s", o.alive, fmtCounts(byStatus(hs)))
	if !o.alive || countNot(hs, 200) > 0 || o.srv.panicked() {
		r.fail("the server did not stay up (alive %v, /healthz %s, panic in log %v)", o.alive, fmtCounts(byStatus(hs)), o.srv.panicked())
	}
}

// judgeSwarm: no 500s to the swarm, its backlog drained, its audit clean.
func (o *outageRun) judgeSwarm() {
	r, res := o.r, o.res
	var five00 int64
	for _, s := range res.Seconds {
		for _, ep := range s.Endpoints {
			five00 += ep.Status["500"]
		}
	}
	if five00 > 0 {
		r.fail("%d answers 500 to the swarm", five00)
	}
	// Backlog: readings generated but not yet acknowledged, per second.
	peak, drained, drainedAt := backlog(res, o.started)
	r.measure("swarm: %d requests, %s; backlog (readings generated − acknowledged) peaked at %d, back to its pre-outage level %s",
		res.Totals.Requests, fmtCounts(kindsInt(res.Totals.ErrorsByKind)), peak, drainedText(drained, drainedAt, o.started))
	if !drained {
		r.fail("the backlog did not drain before the end of the run")
	}
	if a := res.Audit; a == nil {
		r.fail("no audit (swarm exit %d): %s", o.code, tail(o.swarmLog, 2))
	} else {
		r.measure("audit: %s", a.Line())
		if a.Lost > 0 || a.Duplicated > 0 {
			r.fail("audit: %d lost, %d duplicated (e.g. %v)", a.Lost, a.Duplicated, a.Examples)
		}
	}
}

func countNot(ss []sample, status int) int {
	n := 0
	for _, s := range ss {
		if s.status != status {
			n++
		}
	}
	return n
}

func firstAfter(ss []sample, t time.Time, status int) time.Time {
	var best time.Time
	for _, s := range ss {
		if s.at.After(t) && s.status == status {
			if done := s.at.Add(s.lat); best.IsZero() || done.Before(best) {
				best = done
			}
		}
	}
	return best
}

func kindsInt(m map[string]int64) map[string]int {
	out := map[string]int{}
	for k, v := range m {
		out[k] = int(v)
	}
	return out
}

// backlog follows readings generated minus acknowledged over the run: its
// peak, and whether (and when) after `from` it fell back to the level it had
// before the outage (the median of the seconds before it, plus one interval's
// worth of slack for requests in flight).
func backlog(res *sim.Results, from time.Time) (peak int64, drained bool, at time.Time) {
	var cum int64
	levels := make([]int64, len(res.Seconds))
	for i, s := range res.Seconds {
		cum += s.Readings - s.Acked
		levels[i] = cum
		peak = max(peak, cum)
	}
	// Normal level: the largest backlog in the steady seconds 5..15.
	var normal int64
	for i := 5; i < min(15, len(levels)); i++ {
		normal = max(normal, levels[i])
	}
	slack := normal + normal/2 + 10
	for i, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.After(from) && levels[i] <= slack {
			return peak, true, t
		}
	}
	return peak, false, time.Time{}
}

func drainedText(ok bool, at, from time.Time) string {
	if !ok {
		return "never"
	}
	return fmt.Sprintf("%.0fs after PostgreSQL returned", at.Sub(from).Seconds())
}
