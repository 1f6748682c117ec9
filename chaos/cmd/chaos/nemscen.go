package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
	"github.com/kettlefleet/kettlefleet/sim"
)

// The named scenarios of the nemesis: each a fixed schedule on the
// topology of deploy/cluster.sh, the same fleet and checker as the seeded
// nemesis, and checks of its own.
func init() {
	for _, s := range scenarios {
		s := s
		parts = append(parts, part{s.name, s.title, func(ctx context.Context, e *env) *Result { return runScenario(ctx, e, s) }})
	}
}

// scenario is one named fault on the topology.
type scenario struct {
	name, title string
	nodes       int
	log         bool
	duration    time.Duration
	faults      []nemesis.Fault
	// watch samples what the scenario judges while the run goes on (every
	// second, until ctx ends); judge adds its checks after the run.
	watch func(ctx context.Context, t *haTopo, w *watchLog)
	judge func(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check
}

// watchLog is what a scenario's watch saw, one line a second.
type watchLog struct {
	mu      sync.Mutex
	samples []watchSample
}

type watchSample struct {
	at    time.Time
	key   string
	value string
}

func (w *watchLog) add(key, value string) {
	w.mu.Lock()
	w.samples = append(w.samples, watchSample{time.Now(), key, value})
	w.mu.Unlock()
}

// during is the values of key sampled in [from, to).
func (w *watchLog) during(key string, from, to time.Time) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, s := range w.samples {
		if s.key == key && !s.at.Before(from) && s.at.Before(to) {
			out = append(out, s.value)
		}
	}
	return out
}

func fault(kind, name string, from, to time.Duration, inject, heal []string) nemesis.Fault {
	return nemesis.Fault{Kind: kind, Name: name, Start: from, End: to, Inject: inject, Heal: heal}
}

var etcdAndStandbys = "etcd1,etcd2,etcd3," + nemesis.Standbys

var scenarios = []scenario{
	{
		name: "nem-primary-cut", title: "10a. The primary cut from etcd and both standbys, the nodes still reaching it (40 s)",
		nodes: 2, duration: 150 * time.Second,
		faults: []nemesis.Fault{fault(nemesis.Partition, "primary cut from etcd and both standbys (nodes still reach it)", 30*time.Second, 70*time.Second,
			[]string{"partition", nemesis.Primary, etcdAndStandbys}, []string{"unpartition", nemesis.Primary, etcdAndStandbys})},
		watch: watchLeader,
		judge: judgePrimaryCut,
	},
	{
		name: "nem-primary-pause", title: "10b. The primary paused (SIGSTOP, 35 s, past the ttl) on its machine, then the new primary killed -9",
		nodes: 2, duration: 200 * time.Second,
		faults: []nemesis.Fault{
			fault(nemesis.Pause, "pause @primary 35s", 30*time.Second, 65*time.Second, []string{"pause", nemesis.Primary}, []string{"resume", nemesis.Primary}),
			fault(nemesis.Kill, "kill -9 @primary", 110*time.Second, 125*time.Second, []string{"kill", nemesis.Primary}, []string{"start", nemesis.Primary}),
		},
		watch: watchLeader,
		judge: judgePrimaryPause,
	},
	{
		name: "nem-node-cut", title: "10c. A node cut from the database, the balancer still reaching it (40 s)",
		nodes: 2, duration: 120 * time.Second,
		faults: []nemesis.Fault{fault(nemesis.Partition, "kettle1 cut from pg1-3", 30*time.Second, 70*time.Second,
			[]string{"partition", "kettle1", "pg1,pg2,pg3"}, []string{"unpartition", "kettle1", "pg1,pg2,pg3"})},
		watch: watchReady("kettle1"),
		judge: judgeNodeCut,
	},
	{
		name: "nem-wal-full", title: "10d. The primary's WAL disk full (30 s), then freed",
		nodes: 2, duration: 150 * time.Second,
		faults: []nemesis.Fault{fault(nemesis.Disk, "the primary's WAL disk full", 30*time.Second, 60*time.Second,
			[]string{"fill-disk", nemesis.Primary}, []string{"free-disk", nemesis.Primary})},
		watch: watchLeader,
		judge: judgeDisk(true),
	},
	{
		name: "nem-broker-disk-full", title: "10d. With --log: a Kafka broker's log disk full (30 s), then freed",
		nodes: 2, log: true, duration: 150 * time.Second,
		faults: []nemesis.Fault{fault(nemesis.Disk, "kafka1's log disk full", 30*time.Second, 60*time.Second,
			[]string{"fill-disk", "kafka1"}, []string{"free-disk", "kafka1"})},
		// Two brokers of three still make min ISR 2: uploads need not be
		// refused at all.
		judge: judgeDisk(false),
	},
}

// runScenario brings the topology up, runs the fleet under the scenario's
// schedule, then the checker and the scenario's own checks.
func runScenario(ctx context.Context, e *env, sc scenario) *Result {
	r := &Result{Pass: true, Command: "go run ./chaos/cmd/chaos " + sc.name}
	s := &nemesis.Schedule{Duration: sc.duration, HealedBy: sc.duration, Faults: sc.faults}
	var what []string
	for _, f := range sc.faults {
		what = append(what, fmt.Sprintf("%s from +%.0fs to +%.0fs (cluster.sh %s; %s)", f.Name, f.Start.Seconds(), f.End.Seconds(), strings.Join(f.Inject, " "), strings.Join(f.Heal, " ")))
	}
	r.Done = fmt.Sprintf("deploy/cluster.sh up%s (%s mode, %d nodes); swarms through HAProxy for %s (%d HTTP v1, %d v0, %d MQTT kettles every 2 s) and an operator's overrides; %s; then the checker.",
		map[bool]string{true: " --log", false: ""}[sc.log], haMode(), sc.nodes, sc.duration, 150, 50, 50, strings.Join(what, "; "))
	if haMode() != "netns" {
		return r.fail("needs every member on a machine of its own: run with KETTLE_HA_MODE=netns (deploy/cluster.sh's partitions and disks are netns mode only)")
	}
	t, err := upTopo(ctx, e, sc.nodes, sc.log)
	if err != nil {
		return r.fail("%v", err)
	}
	defer t.down()
	out := filepath.Join(e.out, sc.name)
	os.RemoveAll(out)
	t.keep = out
	run := &fleetRun{v1: 150, v0: 50, mqtt: 50, log: sc.log}
	if err := run.start(ctx, e, t, out, sc.duration); err != nil {
		return r.fail("%v", err)
	}
	w := &watchLog{}
	wctx, stopWatch := context.WithCancel(ctx)
	var wg sync.WaitGroup
	if sc.watch != nil {
		wg.Add(1)
		go func() { defer wg.Done(); sc.watch(wctx, t, w) }()
	}
	iv := nemesis.Run(ctx, s, run.began, t, e.logf)
	// The recovery is watched too: a standby catching up, a node ready again.
	sleep(ctx, time.Until(run.began.Add(sc.duration)))
	stopWatch()
	wg.Wait()
	v := run.finish(ctx, e, t, 0, iv)
	if sc.judge != nil {
		for _, c := range sc.judge(ctx, t, w, iv, run.results) {
			v.Add(c)
		}
	}
	b, _ := json.MarshalIndent(struct {
		Faults  []nemesis.Interval `json:"faults"`
		Verdict nemesis.Verdict    `json:"verdict"`
	}{iv, v}, "", " ")
	os.WriteFile(filepath.Join(out, "nemesis.json"), b, 0o644)
	var costs []string
	for _, c := range v.Costs {
		costs = append(costs, c.Line())
	}
	return judged(r, v, "0 lost, 0 duplicated, statistics equal to the rows, members equal; "+strings.Join(costs, "; "))
}

// judged is a part's result from the checker's verdict: each line a
// finding, each failed check in the verdict, pass the verdict otherwise.
func judged(r *Result, v nemesis.Verdict, pass string) *Result {
	for _, l := range v.Lines() {
		r.measure("%s", strings.TrimSuffix(l, " (seed 0)"))
	}
	for _, c := range v.Checks {
		if !c.Pass && !c.Skipped {
			r.fail("%s: %s", c.Name, c.Detail)
		}
	}
	if r.Pass {
		r.Verdict = pass
	}
	return r
}

// watchLeader samples the Patroni leader, and whether the cluster is
// healthy (a leader and two streaming standbys), every second.
func watchLeader(ctx context.Context, t *haTopo, w *watchLog) {
	for ctx.Err() == nil {
		if l, err := t.cmd(ctx, 5*time.Second, "leader"); err == nil {
			w.add("leader", l)
		} else {
			w.add("leader", "")
		}
		_, err := t.cmd(ctx, 5*time.Second, "healthy")
		w.add("healthy", fmt.Sprint(err == nil))
		sleep(ctx, time.Second)
	}
}

// rejoinBound is how long after the heal the old primary may take to
// stream from the new one again (a leader and two streaming standbys):
// Patroni's next loop reaches etcd, pg_rewind and a start as a standby
// take seconds; its demotion, begun during the cut, is over by then
// (primary_stop_timeout, deploy/patroni/patroni.yml).
const rejoinBound = 60 * time.Second

// rejoined is when, after at, the watch first saw the cluster healthy
// (zero: not within what it watched).
func (w *watchLog) rejoined(at time.Time) time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range w.samples {
		if s.key == "healthy" && s.value == "true" && !s.at.Before(at) {
			return s.at
		}
	}
	return time.Time{}
}

// watchReady samples a node's /readyz every second (from this host, which
// no partition cuts).
func watchReady(node string) func(ctx context.Context, t *haTopo, w *watchLog) {
	return func(ctx context.Context, t *haTopo, w *watchLog) {
		hc := &http.Client{Timeout: 2 * time.Second}
		for ctx.Err() == nil {
			addr := t.machines(ctx)[node]
			code := "no answer"
			if r, err := hc.Get("http://" + addr + ":8080/readyz"); err == nil {
				code = fmt.Sprint(r.StatusCode)
				r.Body.Close()
			}
			w.add("ready", code)
			sleep(ctx, time.Second)
		}
	}
}

func counts(xs []string) map[string]int {
	m := map[string]int{}
	for _, x := range xs {
		m[x]++
	}
	return m
}

// judgePrimaryCut: a standby took over while the old primary was cut off,
// and the old primary is a member again (the checker's members and health).
func judgePrimaryCut(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
	f := iv[0]
	if f.Start.IsZero() || len(f.Inject) < 2 {
		return []nemesis.Check{{Name: "a standby takes over", Detail: "the fault did not start"}}
	}
	old := f.Inject[1]
	c := tookOver(w, "a standby takes over", "old primary "+old+"; leaders seen during the cut", old, f.Start, f.End)
	after := w.during("leader", f.End, time.Now())
	rewind := nemesis.Check{Name: fmt.Sprintf("the old primary rejoins within %s of the heal", rejoinBound)}
	if at := w.rejoined(f.End); at.IsZero() {
		rewind.Detail = fmt.Sprintf("not streaming again %.0fs after the heal (leaders after the heal: %v)", time.Since(f.End).Seconds(), counts(after))
	} else {
		rewind.Pass = at.Sub(f.End) <= rejoinBound
		rewind.Detail = fmt.Sprintf("a leader and two streaming standbys %.1fs after the heal (leaders after the heal: %v)", at.Sub(f.End).Seconds(), counts(after))
	}
	b, _ := os.ReadFile(filepath.Join(t.dir, old+".log"))
	if strings.Contains(string(b), "pg_rewind") || strings.Contains(string(b), "rewind") {
		rewind.Detail += "; " + old + "'s Patroni log mentions pg_rewind"
	}
	return []nemesis.Check{c, rewind}
}

// leaderRaceTimeout is what a paused primary costs beyond a dead one in
// Patroni itself: in the leader race each standby asks every member it
// knows, the old leader too, for its WAL position with a fixed 2 s
// timeout (patroni/ha.py fetch_node_status), which a dead machine's
// refusal ends at once and a paused one's silence does not.
const leaderRaceTimeout = 2 * time.Second

// judgePrimaryPause (scenario b on machines): a standby took over while
// the primary was paused, the resumed primary rejoined, and the pause cost
// the kettles no more seconds without an acknowledgement than the kill of
// the next primary (beyond Patroni's leader race; the checker counts
// whole seconds). A commit the resumed stale leader took would be lost
// in the checker's audit.
func judgePrimaryPause(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
	if len(iv) < 2 || iv[0].Start.IsZero() || iv[1].Start.IsZero() || len(iv[0].Inject) < 2 {
		return []nemesis.Check{{Name: "a standby takes over the paused primary", Detail: "the faults did not start"}}
	}
	p := iv[0]
	old := p.Inject[1]
	c := tookOver(w, "a standby takes over the paused primary", "paused "+old+"; leaders seen during the pause", old, p.Start, p.End)
	rejoin := nemesis.Check{Name: fmt.Sprintf("the resumed primary rejoins within %s", rejoinBound)}
	if at := w.rejoined(p.End); at.IsZero() || !at.Before(iv[1].Start) {
		rejoin.Detail = "not a leader and two streaming standbys between the resume and the kill"
	} else {
		rejoin.Pass = at.Sub(p.End) <= rejoinBound
		rejoin.Detail = fmt.Sprintf("a leader and two streaming standbys %.1fs after the resume", at.Sub(p.End).Seconds())
	}
	cost := nemesis.Check{Name: fmt.Sprintf("a paused primary costs no more than a dead one (+%s, Patroni's leader race, +1 s)", leaderRaceTimeout)}
	if cs := nemesis.Costs(iv, res); len(cs) < 2 {
		cost.Detail = "no cost measured"
	} else {
		cost.Detail = fmt.Sprintf("paused: %ds without an acknowledgement; killed: %ds", cs[0].NoAckS, cs[1].NoAckS)
		cost.Pass = time.Duration(cs[0].NoAckS)*time.Second <= time.Duration(cs[1].NoAckS)*time.Second+leaderRaceTimeout+time.Second
	}
	return []nemesis.Check{c, rejoin, cost}
}

// tookOver passes when the watch saw a leader other than old in [from, to).
func tookOver(w *watchLog, name, detail, old string, from, to time.Time) nemesis.Check {
	leaders := w.during("leader", from, to)
	c := nemesis.Check{Name: name, Detail: fmt.Sprintf("%s: %v", detail, counts(leaders))}
	for _, l := range leaders {
		if l != "" && l != old {
			c.Pass = true
		}
	}
	return c
}

// judgeNodeCut: the cut node said not-ready while cut and ready after, and
// the kettles never went a second without an acknowledgement (the other
// node served them).
func judgeNodeCut(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
	f := iv[0]
	during := counts(w.during("ready", f.Start.Add(5*time.Second), f.End))
	after := w.during("ready", f.End.Add(10*time.Second), time.Now())
	// Not ready is a 503, or no answer within the 2 s HAProxy's check
	// gives it (the node's ping of a database whose packets are dropped
	// waits for --store-timeout): either takes it out of rotation.
	nr := nemesis.Check{Name: "the cut node says not-ready, then ready", Detail: fmt.Sprintf("/readyz while cut: %v; after: %v", during, counts(after))}
	nr.Pass = during["503"]+during["no answer"] > 0 && during["200"] == 0 && len(after) > 0 && after[len(after)-1] == "200"
	cost := nemesis.Costs(iv, res)
	rc := nemesis.Check{Name: "the balancer routes around it", Detail: "no cost measured"}
	if len(cost) > 0 {
		rc.Detail = cost[0].Line()
		rc.Pass = cost[0].NoAckS == 0
	}
	return []nemesis.Check{nr, rc}
}

// judgeDisk: uploads refused with 503 (never another 5xx; with
// mustRefuse, some 503) while the disk is full, polls answered, and
// readings acknowledged again after the free.
func judgeDisk(mustRefuse bool) func(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
	return func(ctx context.Context, t *haTopo, w *watchLog, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
		return judgeDiskFull(mustRefuse, iv, res)
	}
}

func judgeDiskFull(mustRefuse bool, iv []nemesis.Interval, res map[string]*sim.Results) []nemesis.Check {
	f := iv[0]
	var up, polls, after = map[string]int64{}, map[string]int64{}, int64(0)
	for _, r := range res {
		if r == nil {
			continue
		}
		for _, s := range r.Seconds {
			at := r.Start.Add(time.Duration(s.T) * time.Second)
			if !at.Before(f.Start) && at.Before(f.End.Add(nemesis.Grace)) {
				for name, ep := range s.Endpoints {
					dst := up
					if name == sim.EPCommand {
						dst = polls
					}
					for k, n := range ep.Status {
						dst[k] += n
					}
					for k, n := range ep.Errors {
						dst["error "+k] += n
					}
				}
			}
			if at.After(f.End.Add(nemesis.Grace)) {
				after += s.Acked
			}
		}
	}
	// A refusal is a 503 (Retry-After); any other 5xx is a failure.
	bad := func(m map[string]int64) int64 {
		var n int64
		for k, v := range m {
			code := strings.TrimPrefix(strings.TrimPrefix(k, "error "), "http_")
			if len(code) == 3 && code[0] == '5' && code != "503" {
				n += v
			}
		}
		return n
	}
	var pollErrs int64
	for k, v := range polls {
		if strings.HasPrefix(k, "error ") {
			pollErrs += v
		}
	}
	return []nemesis.Check{
		{Name: "uploads while full: 503, never another 5xx", Pass: bad(up) == 0 && (up["503"] > 0 || !mustRefuse), Detail: fmt.Sprintf("uploads by status: %v", up)},
		{Name: "polls answered while full", Pass: pollErrs == 0, Detail: fmt.Sprintf("polls by status: %v", polls)},
		{Name: "freeing the disk resumes ingest", Pass: after > 0, Detail: fmt.Sprintf("%d readings acknowledged after the free", after)},
	}
}
