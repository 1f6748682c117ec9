package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sim"
)

// The seeded nemesis (`chaos nemesis`) and the named scenarios built on it
// (nemscen.go) are parts like the others; they add themselves to the table.
func init() {
	parts = append(parts, part{"nemesis", "10. Seeded nemesis (3 seeds × 10 min: partitions, pauses, kills, full disks, clocks, slow links) and its checker", partNemesis})
}

// nemOpts are the nemesis's flags.
type nemOpts struct {
	seeds    []uint64
	duration time.Duration
	kinds    []string
	nodes    int
	log      bool
	v1, v0   int // HTTP kettles of each API
	mqtt     int // MQTT kettles (v1)
	dryRun   bool
}

const nemUsage = `usage: chaos nemesis [flags]

A seeded random nemesis on the whole topology of deploy/cluster.sh: the
schedule (a function of --seed, --duration, --faults and the topology) is
printed, then carried out under a fleet of kettle swarms (HTTP v1 and v0, MQTT)
and an operator setting overrides, every fault healed; then the checker: the
audits, the statistics recomputed from the rows, the overrides, every database
member's rows, and what each fault cost the kettles. A run that loses or
duplicates anything fails and prints its seed. Every member runs on a machine
of its own (deploy/cluster.sh's netns mode); KETTLE_HA_MODE=loopback runs them
as processes on 127.0.44.x, where only pause and kill can be injected.

Flags (each has an env twin, KETTLE_NEMESIS_<FLAG>):
`

// envDefault is a flag's default from its env twin.
func envDefault(name, def string) string {
	if v := os.Getenv("KETTLE_NEMESIS_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))); v != "" {
		return v
	}
	return def
}

// defaultKinds leaves out clock: deploy/cluster.sh moves a member's clock
// with faketime, which cannot reach a Go program's (the runtime reads the
// vDSO); scenario 10g (nem-clock) skews a node's clock in-process instead.
const defaultKinds = "partition,pause,kill,disk,slow,toxic"

// loopbackKinds are the faults deploy/cluster.sh can inject without
// machines (KETTLE_HA_MODE=loopback).
var loopbackKinds = []string{nemesis.Pause, nemesis.Kill}

func parseNemesis(args []string) (nemOpts, error) {
	fs := flag.NewFlagSet("chaos nemesis", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprint(os.Stderr, nemUsage); fs.PrintDefaults() }
	seeds := fs.String("seed", envDefault("seed", "1,2,3"), "the schedule's seed; a comma-separated list runs one full run per seed")
	dur := fs.String("duration", envDefault("duration", "10m"), "each run's length; faults are all healed by its last fifth (at least 30 s of recovery)")
	faults := fs.String("faults", envDefault("faults", defaultKinds), "fault kinds to draw from, comma-separated: "+strings.Join(nemesis.Kinds, ",")+", or all")
	nodes := fs.String("nodes", envDefault("nodes", "2"), "kettle serve nodes behind HAProxy")
	logDef, _ := strconv.ParseBool(envDefault("log", "false"))
	log := fs.Bool("log", logDef, "the readings log in front (Kafka × 3 and a writer: cluster.sh up --log)")
	v1 := fs.String("kettles", envDefault("kettles", "300"), "HTTP v1 kettles (and a third as many each of v0 HTTP and MQTT kettles)")
	dryDef, _ := strconv.ParseBool(envDefault("dry-run", "false"))
	dry := fs.Bool("dry-run", dryDef, "print the schedule and exit")
	if err := fs.Parse(args); err != nil {
		return nemOpts{}, err
	}
	if fs.NArg() > 0 {
		return nemOpts{}, fmt.Errorf("chaos nemesis: unexpected %q", fs.Args())
	}
	var o nemOpts
	var err error
	for _, s := range strings.Split(*seeds, ",") {
		n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
		if err != nil {
			return o, fmt.Errorf("--seed: %q is not a number", s)
		}
		o.seeds = append(o.seeds, n)
	}
	if o.duration, err = time.ParseDuration(*dur); err != nil {
		return o, fmt.Errorf("--duration: %v", err)
	}
	if o.kinds, err = nemesis.ParseKinds(*faults); err != nil {
		return o, err
	}
	if haMode() == "loopback" {
		for _, k := range o.kinds {
			if !slices.Contains(loopbackKinds, k) {
				return o, fmt.Errorf("--faults %s: needs machines (KETTLE_HA_MODE=netns, the default); on loopback only %s", k, strings.Join(loopbackKinds, ","))
			}
		}
	}
	if o.nodes, err = strconv.Atoi(*nodes); err != nil || o.nodes < 1 || o.nodes > 9 {
		return o, fmt.Errorf("--nodes: between 1 and 9, got %q", *nodes)
	}
	o.log = *log
	if o.v1, err = strconv.Atoi(*v1); err != nil || o.v1 < 10 {
		return o, fmt.Errorf("--kettles: at least 10, got %q", *v1)
	}
	o.v0, o.mqtt = o.v1/3, o.v1/3
	o.dryRun = *dry
	return o, nil
}

func (o nemOpts) topology() nemesis.Topology {
	return nemesis.Topology{Nodes: o.nodes, Log: o.log, TTL: 20 * time.Second}
}

// nemesisMain is `chaos nemesis [flags]`, with its own flags.
func nemesisMain(args []string) int {
	o, err := parseNemesis(args)
	if err == flag.ErrHelp {
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%v\n", err)
		return 2
	}
	if o.dryRun {
		for _, seed := range o.seeds {
			s, err := nemesis.Generate(seed, o.duration, o.kinds, o.topology())
			if err != nil {
				fmt.Fprintf(os.Stderr, "chaos nemesis: %v\n", err)
				return 2
			}
			fmt.Print(s)
		}
		return 0
	}
	e, closeEnv, err := newEnv(true)
	if err != nil {
		fmt.Fprintf(os.Stderr, "chaos nemesis: %v\n", err)
		return 1
	}
	defer closeEnv()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	r := runNemesisSeeds(ctx, e, o)
	r.Part, r.Title, r.Start, r.Seconds = "nemesis", find("nemesis").title, start, time.Since(start).Seconds()
	verdict := "PASS"
	if !r.Pass {
		verdict = "FAIL"
	}
	fmt.Printf("chaos nemesis: %s — %s (%.0fs)\n", verdict, r.Verdict, r.Seconds)
	// Seeds run one at a time (each holds the machine's lock for one run)
	// add up to one result: the page shows every seed of the same options.
	path := filepath.Join(e.out, "nemesis.json")
	if b, err := os.ReadFile(path); err == nil {
		var prev Result
		if json.Unmarshal(b, &prev) == nil {
			r = mergeNemesis(&prev, r, o)
		}
	}
	b, _ := json.MarshalIndent(r, "", " ")
	os.WriteFile(path, b, 0o644)
	if !r.Pass {
		return 1
	}
	return 0
}

// partNemesis is the part of make chaos: three seeds of ten minutes each.
func partNemesis(ctx context.Context, e *env) *Result {
	o, err := parseNemesis(nil)
	if err != nil {
		return (&Result{}).fail("%v", err)
	}
	return runNemesisSeeds(ctx, e, o)
}

func runNemesisSeeds(ctx context.Context, e *env, o nemOpts) *Result {
	r := &Result{Pass: true, Done: nemDone(o)}
	var failed []string
	for _, seed := range o.seeds {
		if ctx.Err() != nil {
			return r.fail("interrupted before seed %d", seed)
		}
		ok := runNemesisOnce(ctx, e, o, seed, r)
		if !ok {
			failed = append(failed, fmt.Sprint(seed))
		}
	}
	return nemVerdict(r, o, failed)
}

// nemDone is what a run of the seeds of o does.
func nemDone(o nemOpts) string {
	return fmt.Sprintf("deploy/cluster.sh up (%s mode: etcd × 3, PostgreSQL × 3 under Patroni, %d kettle serve nodes, HAProxy%s); "+
		"kettle swarm through HAProxy: %d HTTP v1, %d HTTP v0 and %d MQTT kettles every 2 s, and an operator setting an override every 2 s; "+
		"a seeded schedule of faults (%s) over %s, each healed; then the checker. One fresh topology per seed (%s).",
		haMode(), o.nodes, map[bool]string{true: ", Kafka × 3 and a writer (--log)", false: ""}[o.log], o.v1, o.v0, o.mqtt,
		strings.Join(o.kinds, ", "), o.duration, joinSeeds(o.seeds))
}

// nemVerdict sets r's command and verdict for the seeds of o, of which
// failed failed.
func nemVerdict(r *Result, o nemOpts, failed []string) *Result {
	r.Command = fmt.Sprintf("go run ./chaos/cmd/chaos nemesis --seed %s --duration %s --faults %s --nodes %d --log=%v --kettles %d",
		joinSeeds(o.seeds), o.duration, strings.Join(o.kinds, ","), o.nodes, o.log, o.v1)
	if len(failed) > 0 {
		return r.fail("seed(s) %s failed; rerun one with %s", strings.Join(failed, ","), strings.Replace(r.Command, joinSeeds(o.seeds), failed[0], 1))
	}
	r.Verdict = fmt.Sprintf("%d seed(s) × %s: every acknowledged reading stored once, statistics equal to the rows, overrides delivered, members equal", len(o.seeds), o.duration)
	return r
}

// mergeNemesis adds the earlier result prev to r when prev ran other seeds
// with the same options (a seed of both: r's run counts).
func mergeNemesis(prev, r *Result, o nemOpts) *Result {
	cmd := func(seeds []uint64) string {
		q := o
		q.seeds = seeds
		return nemVerdict(&Result{}, q, nil).Command
	}
	var ps []uint64
	m := regexp.MustCompile(`--seed ([0-9,]+) `).FindStringSubmatch(prev.Command)
	if m == nil {
		return r
	}
	for _, f := range strings.Split(m[1], ",") {
		n, _ := strconv.ParseUint(f, 10, 64)
		ps = append(ps, n)
	}
	if prev.Command != cmd(ps) {
		return r // other options: not the same experiment
	}
	var failed []string
	if m := regexp.MustCompile(`seed\(s\) ([0-9,]+) failed`).FindStringSubmatch(prev.Verdict); m != nil {
		failed = strings.Split(m[1], ",")
	}
	seeds := slices.Clone(o.seeds)
	var lines []string
	for _, n := range ps {
		if slices.Contains(o.seeds, n) {
			failed = slices.DeleteFunc(failed, func(f string) bool { return f == fmt.Sprint(n) })
			continue
		}
		seeds = append(seeds, n)
		for _, l := range prev.Measured {
			if strings.HasPrefix(l, fmt.Sprintf("seed %d: ", n)) {
				lines = append(lines, l)
			}
		}
	}
	if m := regexp.MustCompile(`seed\(s\) ([0-9,]+) failed`).FindStringSubmatch(r.Verdict); m != nil {
		failed = append(failed, strings.Split(m[1], ",")...)
	}
	slices.Sort(seeds)
	all := o
	all.seeds = seeds
	out := &Result{Part: r.Part, Title: r.Title, Pass: true, Done: nemDone(all), Start: prev.Start, Seconds: prev.Seconds + r.Seconds,
		Measured: append(lines, r.Measured...)}
	if r.Start.Before(out.Start) {
		out.Start = r.Start
	}
	// Each seed's lines in seed order.
	slices.SortStableFunc(out.Measured, func(a, b string) int {
		var x, y uint64
		fmt.Sscanf(a, "seed %d:", &x)
		fmt.Sscanf(b, "seed %d:", &y)
		return int(x) - int(y)
	})
	return nemVerdict(out, all, failed)
}

func joinSeeds(s []uint64) string {
	var b []string
	for _, n := range s {
		b = append(b, fmt.Sprint(n))
	}
	return strings.Join(b, ",")
}

// runNemesisOnce is one seed: its own topology, fleet, schedule and checker.
// Its findings go into r; it reports whether the checker passed.
func runNemesisOnce(ctx context.Context, e *env, o nemOpts, seed uint64, r *Result) bool {
	s, err := nemesis.Generate(seed, o.duration, o.kinds, o.topology())
	if err != nil {
		r.fail("seed %d: %v", seed, err)
		return false
	}
	fmt.Fprint(os.Stderr, s)
	fmt.Fprint(e.log, s)
	t, err := upTopo(ctx, e, o.nodes, o.log)
	if err != nil {
		r.fail("seed %d: %v", seed, err)
		return false
	}
	defer t.down()
	out := filepath.Join(e.out, fmt.Sprintf("nemesis-%d", seed))
	os.RemoveAll(out)
	t.keep = out
	run := &fleetRun{mqtt: o.mqtt, v0: o.v0, v1: o.v1, log: o.log}
	if err := run.start(ctx, e, t, out, o.duration); err != nil {
		r.fail("seed %d: %v", seed, err)
		return false
	}
	iv := nemesis.Run(ctx, s, run.began, t, e.logf)
	v := run.finish(ctx, e, t, seed, iv)
	for _, l := range v.Lines() {
		r.measure("seed %d: %s", seed, l)
	}
	b, _ := json.MarshalIndent(struct {
		Schedule *nemesis.Schedule  `json:"schedule"`
		Faults   []nemesis.Interval `json:"faults"`
		Verdict  nemesis.Verdict    `json:"verdict"`
	}{s, iv, v}, "", " ")
	os.WriteFile(filepath.Join(out, "nemesis.json"), b, 0o644)
	fmt.Fprintf(os.Stderr, "nemesis seed %d: %s\n", seed, map[bool]string{true: "PASS", false: "FAIL"}[v.Pass])
	for _, l := range v.Lines() {
		fmt.Fprintln(os.Stderr, "  "+l)
	}
	return v.Pass
}

// fleetRun is the fleet under a nemesis: swarms of each protocol through
// the balancer and an operator's override driver.
type fleetRun struct {
	v1, v0, mqtt int
	log          bool // the topology runs the readings log
	out          string
	began        time.Time
	duration     time.Duration
	swarms       map[string]*swarmProc
	overrides    *nemesis.OverrideDriver
	results      map[string]*sim.Results // after finish
}

func (f *fleetRun) start(ctx context.Context, e *env, t *haTopo, out string, d time.Duration) error {
	f.out, f.duration, f.swarms = out, d, map[string]*swarmProc{}
	common := append([]string{"--interval", "2s", "--duration", d.String(), "--hatch-rate", "0"}, t.swarmArgs()...)
	type sw struct {
		name string
		args []string
	}
	var all []sw
	if f.v1 > 0 {
		all = append(all, sw{"http-v1", []string{"--api", "v1", "--devices", fmt.Sprint(f.v1)}})
	}
	if f.v0 > 0 {
		all = append(all, sw{"http-v0", []string{"--api", "v0", "--devices", fmt.Sprint(f.v0)}})
	}
	if f.mqtt > 0 {
		all = append(all, sw{"mqtt-v1", []string{"--api", "v1", "--devices", fmt.Sprint(f.mqtt), "--protocol", "mqtt", "--mqtt-target", t.mqtt}})
	}
	f.began = time.Now()
	for _, s := range all {
		p, err := startSwarm(e, t.balancer, filepath.Join(out, s.name), append(s.args, common...)...)
		if err != nil {
			f.kill()
			return fmt.Errorf("swarm %s: %w", s.name, err)
		}
		f.swarms[s.name] = p
	}
	ov, err := nemesis.StartOverrides(ctx, t.balancer, t.file("operator-token"), 5, 2*time.Second)
	if err != nil {
		f.kill()
		return err
	}
	f.overrides = ov
	return nil
}

func (f *fleetRun) kill() {
	for _, s := range f.swarms {
		s.cmd.Process.Kill()
	}
}

// finish waits for the fleet, lets the cluster settle and runs the checker.
func (f *fleetRun) finish(ctx context.Context, e *env, t *haTopo, seed uint64, iv []nemesis.Interval) nemesis.Verdict {
	v := nemesis.Verdict{Seed: seed, Pass: true}
	ovs, refused := f.overrides.Stop()
	results := map[string]*sim.Results{}
	for name, s := range f.swarms {
		// The swarm ends at its duration, then audits (every acked reading
		// looked up): bounded, then killed.
		res, _, err := s.wait(ctx, time.Until(f.began.Add(f.duration))+10*time.Minute)
		if err != nil {
			e.logf("swarm %s: %v", name, err)
		}
		results[name] = res
	}
	f.results = results
	v.Add(nemesis.Faults(iv))
	for _, c := range nemesis.Audits(results) {
		v.Add(c)
	}
	oc := nemesis.Overrides(ovs)
	if len(refused) > 0 {
		oc.Detail += fmt.Sprintf("; operator requests refused: %v", refused)
	}
	v.Add(oc)
	if err := t.healthy(ctx, 3*time.Minute); err != nil {
		v.Add(nemesis.Check{Name: "cluster healthy after the faults", Detail: err.Error()})
	}
	dsn, err := t.dsn(ctx)
	if err != nil {
		v.Add(nemesis.Check{Name: "every PostgreSQL member holds the same rows", Detail: "cluster.sh dsn: " + err.Error()})
	} else {
		dsns, err := nemesis.MemberDSNs(dsn)
		if err != nil {
			v.Add(nemesis.Check{Name: "every PostgreSQL member holds the same rows", Detail: err.Error()})
		} else {
			names := []string{"pg1", "pg2", "pg3"}[:len(dsns)]
			v.Add(nemesis.Members(nemesis.WaitMembers(ctx, names, dsns, 2*time.Minute)))
		}
		v.Add(statsCheck(ctx, t, dsn))
	}
	v.Add(logCheck(ctx, t, f.log, dsn))
	v.Costs = nemesis.Costs(iv, results)
	// The faults go into each swarm's results.json and its report draws
	// them as bands.
	for name, res := range results {
		if res == nil {
			continue
		}
		dir := filepath.Join(f.out, name)
		if err := writeFaults(dir, res, iv); err != nil {
			e.logf("%s: %v", name, err)
			continue
		}
		if _, err := report.FromFile(filepath.Join(dir, "results.json"), filepath.Join(dir, "report.html")); err != nil {
			e.logf("report %s: %v", name, err)
		}
	}
	return v
}

// logCheck reads the readings log (with --log) against the stored rows.
func logCheck(ctx context.Context, t *haTopo, withLog bool, dsn string) nemesis.Check {
	if !withLog {
		return nemesis.Log(nil, "no readings log in this run (--log=false)")
	}
	ms := t.machines(ctx)
	var brokers []string
	for _, k := range []string{"kafka1", "kafka2", "kafka3"} {
		if a := ms[k]; a != "" {
			brokers = append(brokers, a+":9092")
		}
	}
	if len(brokers) == 0 || dsn == "" {
		return nemesis.Check{Name: "the readings log holds every acknowledged reading", Detail: fmt.Sprintf("not read: brokers %v (cluster.sh machines), database DSN given %v", brokers, dsn != "")}
	}
	log := kafka.Target{Brokers: brokers, Topic: "kettle.readings"}
	// deploy/cluster.sh's Kafka over TLS (unless KETTLE_HA_TLS=0): read as its admin user
	if pw, err := os.ReadFile(filepath.Join(t.dir, "kafka", "users", "admin.password")); err == nil {
		log.Auth = kafka.Auth{CA: filepath.Join(t.dir, "tls", "ca.crt"), User: "admin", Password: strings.TrimSpace(string(pw))}
	}
	l, err := nemesis.ReadLog(ctx, log, dsn)
	if err != nil {
		return nemesis.Check{Name: "the readings log holds every acknowledged reading", Detail: err.Error()}
	}
	return nemesis.Log(l, "")
}

// statsCheck compares the statistics served through the balancer with the
// six recomputed from the rows on the primary; the served ones are read
// until they match or 30 s pass (a node serving from a standby catches up).
func statsCheck(ctx context.Context, t *haTopo, dsn string) nemesis.Check {
	var c nemesis.Check
	for end := time.Now().Add(30 * time.Second); ; {
		served, err := nemesis.ServedStats(ctx, t.balancer, t.file("operator-token"))
		if err != nil {
			c = nemesis.Check{Name: "statistics served = recomputed from rows", Detail: "GET /v1/statistics: " + err.Error()}
		} else {
			rows, err := nemesis.RecomputeStats(ctx, dsn, httpapi.ReportingWindow)
			if err != nil {
				c = nemesis.Check{Name: "statistics served = recomputed from rows", Detail: err.Error()}
			} else {
				c = nemesis.Stats(served, rows)
			}
		}
		if c.Pass || time.Now().After(end) || ctx.Err() != nil {
			return c
		}
		time.Sleep(time.Second)
	}
}

// writeFaults adds the faults to a swarm's results.json (the report's bands).
func writeFaults(dir string, res *sim.Results, iv []nemesis.Interval) error {
	res.Faults = nil
	for _, v := range iv {
		if v.Start.IsZero() {
			continue
		}
		res.Faults = append(res.Faults, sim.FaultInterval{Name: v.Name, Kind: v.Kind, Start: v.Start, End: v.End})
	}
	b, err := json.MarshalIndent(res, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "results.json"), b, 0o644)
}
