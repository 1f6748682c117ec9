package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sim"
)

func init() {
	register("capacity", "step the simulated fleet up until the SLO breaks: \"this deployment holds N kettles\"", runCapacity)
}

const capacityDoc = `
Answers "how many kettles does this deployment hold?" with one number. Runs
the swarm in steps of --step kettles from --start: each step is a fresh fleet
of that size, all kettles started at once with their phases spread over one
--interval (so the offered load is steady from the first second), run for
--step-duration. Its steady state — everything after --warmup — is judged:
the worst endpoint's p99 against --slo-p99 and the error rate against
--max-error-rate. The first step that breaks either (or whose simulator falls
behind by more than 500 ms, so the load was not what was asked) ends the run:

  holds N kettles at p99 ≤ 100ms (breaks at M: why; verdict)

The verdict is the report's: the first resource to saturate during the
breaking step, from the system samples (kettle report). --out DIR keeps every
step's results.json, capacity.json and report.html (the step chart, and the
breaking step in full).

Each step also reports the store's periodic work inside its judged seconds,
read from the server's /metrics: the embedded store's merges of staged rows,
PostgreSQL's checkpoints, WAL and full-page images. When the holding step had
none of it, a caveat line says that its figure leaves that cost out (a step
shorter than checkpoint_timeout, or than a merge cycle, may hold none).

With --workers (kettle swarm worker processes, on this machine or others)
every step is one fleet split over the same workers and merged exactly, so
capacity can be searched past the sockets one process or machine holds;
--conns is then split over the workers in proportion to their shards.

Connections are a shared pool (--conns, default 2000): past ~18,000 kettles
one connection per kettle would exceed the open-file limit. With --protocol
mqtt every kettle holds its own connection (the answer is then how many
connected kettles the node holds at the SLO; PUBACK is the endpoint judged),
so past ~18,000 kettles use --workers. Steps do not
audit (kettle swarm does). Devices accumulate on the server: each step
registers its own.

Exit status: 0 when a step held, 5 when even --start broke, 1 when it could not run.`

func runCapacity(ctx context.Context, args []string) error {
	fs := newFlagSet("capacity", "--target URL --slo-p99 100ms [--start 10000 --step 10000 --step-duration 60s --max 1000000]", capacityDoc)
	var f swarmFlags
	c := &f.cfg
	fs.StringVar(&c.Target, "target", "http://127.0.0.1:8080", "server base URL (loopback, or a host named in --allow-target); with --workers a comma-separated list of nodes")
	f.registerLab(fs)
	f.registerTLS(fs)
	fs.StringVar(&c.Operator, "operator-token", "", "operator token, to provision v1 devices when there is no --secret (empty: read from --data-dir)")
	fs.StringVar(&f.secret, "secret", "", "secret to derive v1 device tokens offline (empty: read from --data-dir)")
	secretFileVars(fs, "operator-token", "secret")
	fs.StringVar(&f.dataDir, "data-dir", "", "kettle serve's data directory, to read operator-token and secret from")
	fs.DurationVar(&f.sloP99, "slo-p99", 100*time.Millisecond, "a step holds while every endpoint's steady-state p99 is at most this")
	fs.Float64Var(&f.maxErrorRate, "max-error-rate", 0.001, "… and its errors/requests at most this")
	start := fs.Int("start", 10000, "kettles in the first step")
	step := fs.Int("step", 10000, "kettles added per step")
	stepDur := fs.Duration("step-duration", 60*time.Second, "length of one step")
	maxK := fs.Int("max", 1000000, "stop stepping here (the deployment holds at least this many)")
	warmup := fs.Duration("warmup", 0, "start of each step left out of the judgement: connection setup, caches (0: a quarter of --step-duration, at most 15 s)")
	pause := fs.Duration("pause", 3*time.Second, "rest between steps, for the server to drain")
	fs.DurationVar(&c.Interval, "interval", 30*time.Second, "time between a kettle's readings")
	fs.DurationVar(&c.Jitter, "jitter", time.Second, "± jitter of each send")
	fs.StringVar(&c.API, "api", "v1", "protocol: v0 or v1")
	f.registerProtocol(fs)
	fs.IntVar(&c.Batch, "batch", 1, "v1: readings per upload")
	fs.StringVar(&f.conns, "conns", "2000", "N shared connections, or per-device (one per kettle; capped by the fd limit)")
	fs.IntVar(&c.SourceIPs, "source-ips", 1, "spread connections over source addresses 127.0.0.1..N")
	fs.DurationVar(&c.Timeout, "timeout", 10*time.Second, "per request")
	f.seed = fs.Uint64("seed", 1, "seed of the kettles' physics and phases")
	fs.StringVar(&f.out, "out", "", "directory for the steps' results, capacity.json and report.html (empty: a new temporary directory)")
	fs.BoolVar(&f.sample, "sample", true, "sample the machine and processes, and scrape the server's /metrics, during each step")
	fs.IntVar(&f.serverPID, "server-pid", 0, "pid of the server process (0: the process listening on --target's port)")
	fs.IntVar(&f.postgresPID, "postgres-pid", 0, "postmaster pid to sample (0: every process named postgres; -1: none)")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve the swarm's Prometheus metrics here during the steps (empty: off)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	f.audit = false
	if *start <= 0 || *step <= 0 || *maxK < *start {
		return fmt.Errorf("want --start > 0, --step > 0 and --max ≥ --start (got %d, %d, %d)", *start, *step, *maxK)
	}
	if err := f.resolve(); err != nil {
		return err
	}
	// Checked as the first step's configuration: each step is checked
	// again by sim.Run with its own fleet.
	f.cfg.Devices, f.cfg.Duration = *start, *stepDur
	if err := f.validate(); err != nil {
		return err
	}
	if f.sloP99 <= 0 {
		return fmt.Errorf("--slo-p99 must be > 0")
	}
	if *warmup <= 0 {
		*warmup = min(*stepDur/4, 15*time.Second)
	}
	if *warmup >= *stepDur {
		return fmt.Errorf("--warmup %s leaves nothing of --step-duration %s to judge", *warmup, *stepDur)
	}
	if f.out == "" {
		d, err := os.MkdirTemp("", "kettle-capacity-")
		if err != nil {
			return err
		}
		f.out = d
	}
	f.command = commandLine("capacity", args)
	return f.capacity(ctx, os.Stderr, capacityPlan{start: *start, step: *step, max: *maxK, dur: *stepDur, warmup: *warmup, pause: *pause})
}

// registerProtocol adds the transport flags (kettle swarm and kettle
// capacity alike).
func (f *swarmFlags) registerProtocol(fs *flag.FlagSet) {
	c := &f.cfg
	fs.StringVar(&c.Protocol, "protocol", "http", "transport: http (--api v0 or v1) or mqtt (v1 payloads over MQTT 5, QoS 1, commands by subscription)")
	fs.StringVar(&c.MQTTTarget, "mqtt-target", "", "--protocol mqtt: the MQTT listener HOST:PORT (loopback, or a host named in --allow-target; empty: --target's host, port 1883); with --workers a comma-separated list like --target")
	fs.IntVar(&c.MQTTInflight, "mqtt-inflight", 1, "--protocol mqtt: publishes a kettle may have awaiting their PUBACK")
}

type capacityPlan struct {
	start, step, max int
	dur, warmup      time.Duration
	pause            time.Duration
}

// capacity runs the steps; it prints the answer line and writes the report.
func (f *swarmFlags) capacity(ctx context.Context, w io.Writer, p capacityPlan) error {
	f.log = w
	c := &f.cfg
	c.HatchRate, c.Duration, c.NoAudit = 0, p.dur, true
	c.Progress, c.Log, c.ProgressEvery = w, w, 10*time.Second
	capa := &report.Capacity{Command: f.command, SLOP99Ms: float64(f.sloP99) / 1e6, MaxErrorRate: f.maxErrorRate}
	var last *sim.Results
	for n := p.start; n <= p.max; n += p.step {
		if ctx.Err() != nil {
			break
		}
		c.Devices = n
		fmt.Fprintf(w, "capacity: step %d kettles for %s (judged after %s) → %s\n", n, p.dur, p.warmup, c.Target)
		stop, err := f.instrument(ctx)
		if err != nil {
			return err
		}
		res, err := f.runOnce(ctx)
		sys := stop()
		if err != nil {
			return fmt.Errorf("step %d kettles: %w", n, err)
		}
		res.Command = fmt.Sprintf("kettle swarm --target %s --devices %d --interval %s --hatch-rate 0 --duration %s --conns %s --api %s --batch %d --slo-p99 %s --max-error-rate %g",
			c.Target, n, c.Interval, p.dur, f.conns, c.API, c.Batch, f.sloP99, f.maxErrorRate)
		if c.Protocol == sim.ProtocolMQTT {
			res.Command += fmt.Sprintf(" --protocol mqtt --mqtt-target %s --mqtt-inflight %d", c.MQTTTarget, c.MQTTInflight)
		}
		if f.workers != "" {
			res.Command += fmt.Sprintf(" --target %s --workers %s --worker-token …", strings.Join(f.targets, ","), f.workers)
		}
		res.System = sys
		dir := filepath.Join(f.out, fmt.Sprintf("step-%07d", n))
		path, err := res.WriteFile(dir)
		if err != nil {
			return err
		}
		st, err := judgeStep(res, p.warmup, capa)
		if err != nil {
			return err
		}
		st.Results = path
		capa.Steps = append(capa.Steps, st)
		last = res
		periodic := ""
		if st.Periodic != nil {
			periodic = " [" + st.Periodic.Text() + "]"
		}
		fmt.Fprintf(w, "capacity: %d kettles: offered %.0f/s completed %.0f/s p50 %.1f ms p99 %.1f ms errors %.5f lag %.0f ms%s → %s\n",
			n, st.OfferedPerS, st.DonePerS, st.P50Ms, st.P99Ms, st.ErrorRate, st.MaxLagMs, periodic, heldWord(st))
		if !st.Held {
			capa.BreaksAt = n
			break
		}
		capa.Holds = n
		if n+p.step <= p.max {
			select {
			case <-time.After(p.pause):
			case <-ctx.Done():
			}
		}
	}
	if last == nil {
		return ctx.Err()
	}
	slo := f.sloP99.String()
	switch {
	case capa.BreaksAt == 0:
		capa.Line = fmt.Sprintf("holds %d kettles at p99 ≤ %s (did not break up to the last step; raise --max)", capa.Holds, slo)
	case capa.Holds == 0:
		b := capa.Steps[len(capa.Steps)-1]
		capa.Line = fmt.Sprintf("holds fewer than %d kettles at p99 ≤ %s (breaks at %d: %s; %s)", p.start, slo, b.Kettles, b.Why, b.Verdict.Text)
	default:
		b := capa.Steps[len(capa.Steps)-1]
		capa.Line = fmt.Sprintf("holds %d kettles at p99 ≤ %s (breaks at %d: %s; %s)", capa.Holds, slo, b.Kettles, b.Why, b.Verdict.Text)
	}
	fmt.Println(capa.Line) // the answer, on stdout for scripts
	for _, st := range capa.Steps {
		if st.Kettles == capa.Holds {
			if c := st.Periodic.Caveat(); c != "" {
				capa.Caveat = fmt.Sprintf("the %d-kettle step: %s", st.Kettles, c)
				fmt.Fprintf(w, "capacity: caveat: %s\n", capa.Caveat)
			}
		}
	}

	s, err := report.Build(last, report.Options{Title: fmt.Sprintf("kettle capacity: %s", firstClause(capa.Line)), SLOP99Ms: capa.SLOP99Ms})
	if err != nil {
		return err
	}
	s.Command = f.command
	s.Capacity = capa
	// Scripts (bench/capacity.sh, chaos overload) read the answer from
	// capacity.json: a run that cannot write it fails.
	if err := s.WriteJSON(filepath.Join(f.out, "capacity.json")); err != nil {
		return err
	}
	rp := filepath.Join(f.out, "report.html")
	if err := s.WriteFile(rp); err != nil {
		return err
	}
	fmt.Fprintf(w, "  report: %s\n", rp)
	if capa.Holds == 0 {
		return exitCode{exitSLO, "even the first step broke the SLO: " + capa.Line}
	}
	return nil
}

func heldWord(s report.Step) string {
	if s.Held {
		return "holds"
	}
	return "breaks: " + s.Why
}

func firstClause(line string) string {
	if i := strings.Index(line, " ("); i > 0 {
		return line[:i]
	}
	return line
}

// judgeStep measures a step's steady state (seconds after warmup): merged
// latency per endpoint, error rate, throughput, the simulator's lag; and the
// report's verdict on the step.
func judgeStep(res *sim.Results, warmup time.Duration, capa *report.Capacity) (report.Step, error) {
	st := report.Step{Kettles: res.Params.Devices}
	from := int(math.Ceil(warmup.Seconds()))
	steady := &sim.Results{Seconds: nil}
	for _, s := range res.Seconds {
		if s.T > from {
			steady.Seconds = append(steady.Seconds, s)
		}
	}
	secs := float64(len(steady.Seconds))
	if secs == 0 {
		return st, fmt.Errorf("step %d: no second after the warmup", st.Kettles)
	}
	var req, errs, offered int64
	for _, s := range steady.Seconds {
		for _, e := range s.Endpoints {
			req += e.Requests
			offered += e.Offered
			for _, n := range e.Errors {
				errs += n
			}
		}
		st.MaxLagMs = math.Max(st.MaxLagMs, s.MaxLagMs)
	}
	st.OfferedPerS, st.DonePerS = float64(offered)/secs, float64(req)/secs
	if req > 0 {
		st.ErrorRate = float64(errs) / float64(req)
	}
	worst := ""
	for name := range res.Totals.Endpoints {
		h, err := sim.MergeHistograms(steady, name)
		if err != nil {
			return st, err
		}
		if h.TotalCount() == 0 {
			continue
		}
		p99 := float64(h.ValueAtQuantile(99)) / 1000
		if p99 >= st.P99Ms {
			st.P99Ms, worst = p99, name
			st.P50Ms = float64(h.ValueAtQuantile(50)) / 1000
		}
	}
	var why []string
	if req == 0 {
		why = append(why, "no request completed")
	}
	if st.P99Ms > capa.SLOP99Ms {
		why = append(why, fmt.Sprintf("%s p99 %.0f ms > %g ms", worst, st.P99Ms, capa.SLOP99Ms))
	}
	if capa.MaxErrorRate >= 0 && st.ErrorRate > capa.MaxErrorRate {
		why = append(why, fmt.Sprintf("error rate %.4f > %g", st.ErrorRate, capa.MaxErrorRate))
	}
	if st.MaxLagMs >= 500 {
		why = append(why, fmt.Sprintf("the simulator lagged %.0f ms", st.MaxLagMs))
	}
	st.Held = len(why) == 0
	st.Why = strings.Join(why, ", ")
	st.Periodic = report.PeriodicWork(res.System, res.Start.Add(warmup))
	s, err := report.Build(res, report.Options{SLOP99Ms: capa.SLOP99Ms, MaxErrorRate: capa.MaxErrorRate})
	if err != nil {
		return st, err
	}
	st.Verdict = s.Verdict
	return st, nil
}
