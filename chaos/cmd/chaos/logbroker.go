package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// A Kafka broker lost under the fleet (issue 53, scenario e): killed -9,
// or paused with SIGSTOP (a machine that neither answers nor refuses).
// Besides the swarm, 30 foreign kettles post one reading every 50 ms each
// (the case study's client), whose answers are timed one by one: two
// brokers of three (min ISR 2) stay up, so no upload may be answered more
// than 1 s later than the usual p99, and no more than that may pass
// without an acknowledgement.

const (
	faultKettles = 30
	faultEvery   = 50 * time.Millisecond
	faultSlack   = time.Second // the bound over the usual p99
)

// kettleProbes are n foreign kettles, each its own v1 device on its own
// connection, posting readings on a fixed schedule (open model).
type kettleProbes struct {
	probes []*probe
	devs   []probeDevice
	wgs    []*sync.WaitGroup
	cancel context.CancelFunc
}

func startKettleProbes(ctx context.Context, url, secret string, n int, every, d time.Duration) *kettleProbes {
	ctx, cancel := context.WithCancel(ctx)
	k := &kettleProbes{cancel: cancel}
	start := time.Now().Add(-time.Hour)
	for range n {
		dev := newProbeDevice(secret)
		// Connections enough that a send never queues behind a slow
		// answer in the client (20 a second, each answered in up to a
		// couple of seconds during a fault): the time is the server's.
		p := newProbe("kettle", 64, 30*time.Second, dev.readingReq(url, start))
		k.devs = append(k.devs, dev)
		k.probes = append(k.probes, p)
		k.wgs = append(k.wgs, p.run(ctx, every, int(d/every)))
	}
	return k
}

// stop ends the sends and waits for every answer (each bounded by the
// probe's 30 s timeout).
func (k *kettleProbes) stop() []sample {
	k.cancel()
	var all []sample
	for i, wg := range k.wgs {
		wg.Wait()
		all = append(all, k.probes[i].all()...)
	}
	return all
}

// faultCost is what a fault at faultAt cost the probe kettles.
type faultCost struct {
	usualP99         time.Duration // uploads sent in the 10 s before the fault and answered before it
	slowest, gap     time.Duration // from 1 s before the fault on
	slowestAt, gapAt time.Duration // after the fault
	n, ok            int
	refused          map[string]int
}

func measureFault(ss []sample, faultAt time.Time) faultCost {
	c := faultCost{refused: map[string]int{}}
	var usual []time.Duration
	var acks []time.Time
	from := faultAt.Add(-time.Second)
	for _, s := range ss {
		c.n++
		if s.status != http.StatusOK {
			c.refused[fmt.Sprint(byStatusKey(s))]++
			continue
		}
		c.ok++
		done := s.at.Add(s.lat)
		acks = append(acks, done)
		if done.Before(faultAt) && s.at.After(faultAt.Add(-10*time.Second)) {
			usual = append(usual, s.lat)
		}
		if !s.at.Before(from) && s.lat > c.slowest {
			c.slowest, c.slowestAt = s.lat, s.at.Sub(faultAt)
		}
	}
	if len(usual) > 0 {
		slices.Sort(usual)
		c.usualP99 = usual[len(usual)*99/100]
	}
	slices.SortFunc(acks, func(a, b time.Time) int { return a.Compare(b) })
	for i := 1; i < len(acks); i++ {
		if acks[i].After(from) && acks[i].Sub(acks[i-1]) > c.gap {
			c.gap, c.gapAt = acks[i].Sub(acks[i-1]), acks[i-1].Sub(faultAt)
		}
	}
	return c
}

func byStatusKey(s sample) string {
	for k := range byStatus([]sample{s}) {
		return k
	}
	return "?"
}

// judge adds the cost's findings to r and fails it past the bounds.
func (c faultCost) judge(r *Result, what string) {
	r.measure("%d foreign kettles (a reading every %s each): %d uploads, %d answered 200, refused or failed: %s; usual p99 (sent in the 10 s before the %s and answered before it) %s",
		faultKettles, faultEvery, c.n, c.ok, fmtCounts(c.refused), what, ms(c.usualP99))
	r.measure("from 1 s before the %s on: longest time without an acknowledgement %s (from %.2fs after it), slowest upload %s (sent %.2fs after it)",
		what, ms(c.gap), c.gapAt.Seconds(), ms(c.slowest), c.slowestAt.Seconds())
	if c.usualP99 == 0 {
		r.fail("no upload answered before the %s: nothing to compare with", what)
		return
	}
	if n := c.n - c.ok; n > 0 {
		r.fail("%d uploads of the foreign kettles not answered 200 (%s)", n, fmtCounts(c.refused))
	}
	if c.gap > c.usualP99+faultSlack {
		r.fail("%s without an acknowledgement after the %s, more than 1 s over the usual p99 (%s)", ms(c.gap), what, ms(c.usualP99))
	}
	if c.slowest > c.usualP99+faultSlack {
		r.fail("an upload took %s after the %s, more than 1 s over the usual p99 (%s)", ms(c.slowest), what, ms(c.usualP99))
	}
}

// probesStored fails r unless the store holds every reading a probe kettle
// was answered 200 for.
func probesStored(r *Result, dsn, writer string, k *kettleProbes) {
	// The probes' last readings may be acknowledged after the swarm's
	// audit found the log drained: drained again first.
	hc := &http.Client{Timeout: 5 * time.Second}
	for end := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		if res, err := hc.Get(writer + "/drained"); err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(end) {
			r.fail("the writers did not drain the log within 2 min of the run's end")
			return
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		r.fail("count the foreign kettles' rows: %v", err)
		return
	}
	defer conn.Close(ctx)
	var acked, stored int64
	for i, dev := range k.devs {
		for _, s := range k.probes[i].all() {
			if s.status == http.StatusOK {
				acked++
			}
		}
		var n int64
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM measurements WHERE device = $1`, dev.id).Scan(&n); err != nil {
			r.fail("count the foreign kettles' rows: %v", err)
			return
		}
		stored += n
	}
	r.measure("foreign kettles: %d readings acknowledged, %d stored", acked, stored)
	if stored < acked {
		r.fail("the foreign kettles' readings: %d acknowledged, %d stored", acked, stored)
	}
}

// partLogBrokerFault: one Kafka node killed -9 or paused (SIGSTOP) under
// the fleet, brought back 30 s later. which is "broker" (a node that is
// not the active controller) or "controller" (the KRaft quorum's leader,
// whose loss adds a controller election).
func partLogBrokerFault(fault, which string) func(ctx context.Context, e *env) *Result {
	return func(ctx context.Context, e *env) *Result {
		const before, down, duration = 20 * time.Second, 30 * time.Second, 90 * time.Second
		verb := map[string]string{"kill": "killed with SIGKILL, started again", "pause": "paused with SIGSTOP, resumed with SIGCONT"}[fault]
		name := "log-" + which
		if fault == "pause" {
			name += "-pause"
		}
		r := &Result{Pass: true, Done: fmt.Sprintf("kettle serve --log with 2 writers; kettle swarm (%d v1 kettles every %s, %s) and %d foreign kettles posting a reading every %s each, timed one by one; %s in, one Kafka node (%s) %s %s later; audit after the writers drained the log, and every acknowledged reading of the foreign kettles looked up in the store.",
			logDevices, logInterval, duration, faultKettles, faultEvery, before, map[string]string{"broker": "not the active controller", "controller": "the active controller"}[which], verb, down)}
		rig, err := startLogRig(ctx, e, name, 2)
		defer rig.close()
		if err != nil {
			return r.fail("%v", err)
		}
		sw, err := rig.swarm(e, duration, rig.writers[0].url)
		if err != nil {
			return r.fail("%v", err)
		}
		kp := startKettleProbes(ctx, rig.front.url, readSecret(rig.data, "secret"), faultKettles, faultEvery, duration)
		sleep(ctx, before)
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		leader, err := rig.kafka.QuorumLeader(qctx)
		cancel()
		if err != nil {
			kp.stop()
			return r.fail("%v", err)
		}
		node := leader
		if which == "broker" {
			node = leader%3 + 1
		}
		e.logf("%s: %s Kafka node %d (the active controller: node %d)", name, fault, node, leader)
		faultAt := time.Now()
		if fault == "kill" {
			err = rig.kafka.Kill(node)
		} else {
			err = rig.kafka.Pause(node)
		}
		if err != nil {
			r.fail("%v", err)
		}
		sleep(ctx, down)
		if fault == "kill" {
			err = rig.kafka.StartNode(node)
		} else {
			err = rig.kafka.Resume(node)
		}
		if err != nil {
			r.fail("%v", err)
		}
		back := time.Now()
		e.logf("%s: node %d back after %.1fs", name, node, back.Sub(faultAt).Seconds())
		res, code, err := sw.wait(ctx, duration+6*time.Minute)
		probes := kp.stop()
		if err != nil {
			return r.fail("swarm: %v", err)
		}
		cost := measureFault(probes, faultAt)
		cost.judge(r, fmt.Sprintf("%s of node %d", fault, node))
		refused, kinds := ingestRefused(res)
		var ackedDown, offeredDown int64
		for _, s := range res.Seconds {
			t := res.Start.Add(time.Duration(s.T) * time.Second)
			if t.After(faultAt) && t.Before(back) {
				ackedDown += s.Acked
				offeredDown += s.Readings
			}
		}
		r.measure("swarm, while node %d was down: %d readings acknowledged of %d generated; whole run: %d acknowledged, %d uploads refused or failed %v", node, ackedDown, offeredDown, res.Totals.Acked, refused, kinds)
		if ackedDown == 0 || float64(ackedDown) < 0.5*float64(offeredDown) {
			r.fail("producing did not go on with one broker down (%d of %d acknowledged)", ackedDown, offeredDown)
		}
		if refused > 0 {
			r.fail("%d swarm uploads refused or failed with two brokers of three up", refused)
		}
		auditAndCount(r, rig, res, code, sw.logPath)
		probesStored(r, rig.dsn, rig.writers[0].url, kp)
		if r.Pass {
			r.Verdict = fmt.Sprintf("node %d %s: longest without an acknowledgement %s, slowest upload %s (usual p99 %s); 0 refused, 0 lost", node, map[string]string{"kill": "killed", "pause": "paused"}[fault], ms(cost.gap), ms(cost.slowest), ms(cost.usualP99))
		}
		return r
	}
}
