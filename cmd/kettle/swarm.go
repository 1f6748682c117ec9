package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sim"
)

func init() {
	register("swarm", "simulate a fleet of kettles against a server on this machine (open model) and audit it", runSwarm)
}

const swarmDoc = `
Simulates --devices kettles. Each is a small physical model (battery, reservoir,
water and ambient temperature) that obeys the commands it polls. Every
--interval (per-kettle phase, ± --jitter) a kettle posts its reading and polls
its command, over the case-study protocol (--api v0: POST /login first, then
POST /measurement, GET /command) or v1 (bearer tokens derived offline from
--secret, or provisioned with --operator-token through POST /v1/devices).

Open model: a send starts when it is due whether or not the kettle's previous
request came back, and latency is measured from the intended send time, so a
slow server cannot lower the load it is measured under (coordinated omission).
A kettle has at most one exchange outstanding; a reading due meanwhile is
buffered and sent as soon as it returns, counted as a late start. The
simulator's own lag behind the schedule is reported too. On 503, a timeout or
a connection error the kettle retries the same reading later with backoff
(at least Retry-After); a reading counts as acknowledged only on a 2xx.

MQTT (--protocol mqtt): each kettle holds its own MQTT 5 connection to
--mqtt-target (default: --target's host, port 1883), username = device id,
password = device token (derived from --secret, or provisioned with the
operator token), and publishes its readings QoS 1 to kettles/{id}/measurements
(one reading per message, or --batch K as a JSON array), with at most
--mqtt-inflight messages awaiting their PUBACK; a reading counts as
acknowledged only on a PUBACK with a reason code below 0x80 (kettle serve
sends it after the commit). A publish without its PUBACK after --timeout
counts as a timeout but stays in flight (MQTT 5 resends only on a new
connection). Commands are not polled: the kettle subscribes to
kettles/{id}/command and obeys the last one pushed (retained). A lost
connection is redialed with backoff (1 s doubling to 30 s, jittered; after a
timeout or a busy server from 8 s up to 2 min); readings meanwhile stay
buffered (up to 1000, then the oldest is dropped and counted). Endpoints in the results: mqtt_connect (dial + CONNECT + SUBSCRIBE,
reported, not judged by --slo-p99) and mqtt_publish (judged). --target is
still needed for provisioning and the audit (HTTP operator API).
One process holds at most one connection per open file (ulimit -n less ~200,
and the server holds at most --mqtt-max-conns): 20,000 files ≈ 19,800 kettles
here; past that, drive the fleet from several workers (--workers, below)
against several kettle serve processes (each with its own --mqtt-addr,
sharing one PostgreSQL), as bench/mqtt-fleet.sh does. Each MQTT kettle costs
the simulator one reader goroutine (the scheduler writes); its measured RSS
per kettle is in docs/results.md.

Past one process or one machine: start kettle swarm worker processes
(kettle swarm worker --help) and give their addresses to --workers with
their --worker-token. The fleet is split over them (kettle i on worker i
mod W), started at one common time, merged into one results.json (the
workers' histograms merged exactly, each worker's CPU, RSS and lag beside)
and audited once; a worker lost mid-run is marked with its share and the
run still ends with its report (exit 1). See docs/operations.md.

Load shapes: --stages 2m:20000,5m:20000,30s:40000,5m:40000 gives the fleet a
size over time (linear between points from 0; a 0s stage is a step): kettles
join in index order as it grows and the last to join leave first, switched
off (connection closed, readings kept) until they join again; one joining in
a step after the start sends at that instant (a power cut's reconnect storm).
--scenario FILE reads stages and a firmware rollout from YAML or JSON
(contrib/scenarios; docs/operations.md, "Load shapes").

Live view: --ui 127.0.0.1:9102 serves the report page while the run goes,
fed every second (server-sent events), with a button that stops the run as
an interrupt does (audit, results and report still written). Off loopback
it needs --ui-token-file.

Only this machine can be loaded: --target must be 127.0.0.0/8, ::1 or
localhost, unless the operator names a host exactly in --allow-target (and
each worker in its own --allow-target). Connections: --conns per-device (one keep-alive connection per
kettle) or a shared pool of N; both capped by the open-file limit less a
reserve (kettles then share connections; the cap is printed). The server caps
its connections too (kettle serve --max-conns: its fd limit less 1024) and
answers the excess 503: past that many kettles, use --conns N.

TLS: an https:// --target (kettle serve --tls-cert) is spoken over TLS 1.2+,
the server's certificate checked against --ca (or the system's roots); an
untrusted one stops the run before it starts. Kettles offer X25519, then
P-256, as kettle firmware does, and with --tls-resume resume their sessions
when they reconnect. The handshakes, and how many were resumed, are in the
summary and results.json. With --protocol mqtt the kettles speak TLS to
--mqtt-target too (kettle serve --tls-cert makes its MQTT listener TLS).

Memory: the heap of a swarm (and of a swarm worker) is mostly kettle
state held for the whole run, so the process runs with GOGC=25 unless GOGC
is set, and gives setup's garbage back before the run starts. With shared
connections (--conns N) a kettle waiting for one is a queued entry, not a
goroutine. GOMAXPROCS limits the cores it uses (one is enough below a few
thousand requests a second, and costs less CPU per request than two).

At the end, with the operator token (--operator-token, or the file in
--data-dir), every acknowledged reading is looked up in the server:
acked=… stored=… lost=… duplicated=…

Exit status:
  0  run done, audit clean, SLO met
  1  the run could not be done (bad flag, refused target, provisioning or
     audit request failed), or the audit was skipped (no operator token
     and no --audit=false: the summary says "audit: skipped")
  3  audit: acknowledged readings lost
  4  audit: acknowledged readings stored more than once
  5  SLO breached: a p99 above --slo-p99 or an error rate above --max-error-rate
  6  compared with --baseline, a figure regressed
A failure prints one line saying why.
` + ciDoc

// Exit codes of kettle swarm (and kettle demo).
const (
	exitLost      = 3
	exitDuplicate = 4
	exitSLO       = 5
)

// swarmFlags are the flags shared by swarm and demo.
type swarmFlags struct {
	cfg          sim.Config
	conns        string
	sourceAddrs  string
	ca           string // PEM roots for an https target
	tlsResume    bool
	out          string
	sloP99       time.Duration
	maxErrorRate float64
	dataDir      string
	secret       string
	audit        bool
	auditAfter   string
	seed         *uint64
	command      string // the command line, recorded in results.json
	// System sampling and the report (see instrument, report.go).
	sample      bool
	serverPID   int
	postgresPID int
	metricsAddr string
	debugAddr   string // pprof (kettle swarm only)
	report      bool
	log         io.Writer // where progress and notes go (run sets it)
	// The distributed lab (see swarm_worker.go).
	workers     string   // --workers HOST:PORT,…
	workerToken string   // --worker-token
	allowTarget string   // --allow-target HOST,…
	workerCA    string   // --worker-ca
	workerCert  string   // --worker-cert
	workerKey   string   // --worker-key
	targets     []string // --target split (several server nodes)
	mqttTargets []string
	ci          ciFlags // --baseline, --junit, --remote-write (see ci.go)
	shapeFlags          // --stages, --scenario (swarm_shape.go)
	liveFlags           // --ui (swarm_live.go)
}

// register adds the flags of a run (shared by swarm and demo).
func (f *swarmFlags) register(fs *flag.FlagSet, devices int, duration time.Duration, hatch float64, conns string) {
	c := &f.cfg
	fs.IntVar(&c.Devices, "devices", devices, "simulated kettles")
	fs.DurationVar(&c.Interval, "interval", 30*time.Second, "time between a kettle's readings")
	fs.DurationVar(&c.Jitter, "jitter", time.Second, "each send is due at phase + k×interval ± jitter (≤ interval/4)")
	fs.Float64Var(&c.HatchRate, "hatch-rate", hatch, "kettles started per second (0: all at once, phases spread over one interval)")
	fs.DurationVar(&c.Duration, "duration", duration, "length of the run, ramp-up included; it stops by itself")
	fs.StringVar(&c.API, "api", "v1", "protocol: v0 (case study: login, cookie) or v1 (bearer tokens)")
	fs.IntVar(&c.Batch, "batch", 1, "v1: readings a kettle buffers and uploads in one request (1..1000)")
	fs.StringVar(&f.conns, "conns", conns, "per-device (one keep-alive connection per kettle) or N shared connections; capped by the fd limit")
	fs.IntVar(&c.SourceIPs, "source-ips", 1, "spread connections over source addresses 127.0.0.1..N (past ~14,000 connections each: bind takes half the ephemeral ports)")
	fs.StringVar(&f.sourceAddrs, "source-addrs", "", "spread connections over these loopback source addresses instead of --source-ips, e.g. 127.0.0.11 or 127.0.0.11-127.0.0.12 (one set per swarm process when several run at once)")
	fs.DurationVar(&c.Timeout, "timeout", 10*time.Second, "per request; a timed-out reading is retried")
	f.seed = fs.Uint64("seed", 1, "seed of the kettles' physics, phases and jitter")
	fs.StringVar(&f.out, "out", "", "directory to write results.json to (empty: none)")
	fs.DurationVar(&f.sloP99, "slo-p99", 100*time.Millisecond, "fail (exit 5) if any endpoint's p99 is above this (0: no check)")
	fs.Float64Var(&f.maxErrorRate, "max-error-rate", 0.001, "fail (exit 5) if errors/requests is above this (negative: no check)")
	fs.BoolVar(&f.sample, "sample", true, "sample the machine, the server, PostgreSQL and the simulator each second (/proc) and the server's /metrics, into results.json")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve the swarm's own Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9101; empty: off)")
	fs.BoolVar(&f.report, "report", true, "with --out: also write DIR/report.html (kettle report)")
}

// registerTarget adds the flags that point a swarm at a running server.
func (f *swarmFlags) registerTarget(fs *flag.FlagSet) {
	c := &f.cfg
	fs.StringVar(&c.Target, "target", "http://127.0.0.1:8080", "server base URL (loopback, or a host named in --allow-target); with --workers a comma-separated list of nodes, worker i loading node i mod N (the first one is audited)")
	f.registerLab(fs)
	f.registerProtocol(fs)
	fs.StringVar(&c.Operator, "operator-token", "", "operator token for the audit and v1 provisioning (empty: read from --data-dir)")
	fs.StringVar(&f.secret, "secret", "", "secret to derive v1 device tokens offline (empty: read from --data-dir, else provision with the operator token)")
	fs.StringVar(&f.dataDir, "data-dir", "", "kettle serve's data directory, to read operator-token and secret from")
	secretFileVars(fs, "operator-token", "secret")
	fs.BoolVar(&f.audit, "audit", true, "audit acknowledged readings at the end (needs the operator token)")
	fs.StringVar(&f.auditAfter, "audit-after", "", "before the audit, wait (at most 5 min) until GET of this URL answers 200, e.g. a log writer's http://127.0.0.1:8081/drained (kettle serve --log: acknowledged readings reach the store once the writers drained the log)")
	fs.IntVar(&f.serverPID, "server-pid", 0, "pid of the server process to sample (0: the process listening on --target's port)")
	fs.IntVar(&f.postgresPID, "postgres-pid", 0, "postmaster pid: sample that PostgreSQL cluster only (0: every process named postgres; -1: none)")
	f.registerTLS(fs)
}

// registerTLS adds the flags of an https:// --target.
func (f *swarmFlags) registerTLS(fs *flag.FlagSet) {
	fs.StringVar(&f.ca, "ca", "", "https --target: PEM file of the certificate(s) to trust, e.g. kettle serve's self-signed --tls-cert (empty: the system's roots)")
	fs.BoolVar(&f.tlsResume, "tls-resume", true, "https --target: kettles keep session tickets and resume TLS sessions when they reconnect (false: every connection a full handshake)")
}

// tlsConfig is the client side of an https target (nil for http).
func (f *swarmFlags) tlsConfig() (*tls.Config, error) {
	u, err := sim.CheckTarget(f.cfg.Target, f.cfg.AllowHosts)
	if err != nil || u.Scheme != "https" {
		if f.ca != "" && err == nil {
			return nil, fmt.Errorf("--ca %s: the target %s is not https", f.ca, f.cfg.Target)
		}
		return nil, err
	}
	var pem []byte
	if f.ca != "" {
		if pem, err = os.ReadFile(f.ca); err != nil {
			return nil, fmt.Errorf("--ca: %w", err)
		}
		f.cfg.CAPEM = pem
	}
	c, err := sim.ClientTLS(pem, f.tlsResume)
	if err != nil {
		return nil, fmt.Errorf("--ca %s: %w", f.ca, err)
	}
	return c, nil
}

func runSwarm(ctx context.Context, args []string) error {
	if len(args) > 0 && args[0] == "worker" {
		return runSwarmWorker(ctx, args[1:])
	}
	lowGCHeadroom()
	fs := newFlagSet("swarm", "--target URL --devices N [flags]", swarmDoc)
	var f swarmFlags
	f.register(fs, 1000, time.Minute, 0, "per-device")
	f.registerTarget(fs)
	fs.StringVar(&f.debugAddr, "debug-addr", "", "serve Go's pprof profiles of the swarm itself on this address, e.g. 127.0.0.1:6062 (empty: off)")
	f.ci.register(fs)
	f.registerShape(fs)
	f.registerLive(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := f.resolveShape(fs); err != nil {
		return err
	}
	if f.debugAddr != "" {
		stop, err := serveDebug(f.debugAddr, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			return err
		}
		defer stop()
	}
	if err := f.resolve(); err != nil {
		return err
	}
	if err := f.validate(); err != nil {
		return err
	}
	if err := f.ci.validate(); err != nil {
		return err
	}
	f.command = commandLine("swarm", args)
	return f.run(ctx, os.Stderr)
}

// lowGCHeadroom runs a swarm process with GOGC=25 unless GOGC is set: its
// heap is mostly kettle state that lives the whole run and it allocates
// little per request (about a reading's worth, bench/swarm-memory.sh's
// profile), so a small headroom keeps RSS near that state for a collection
// every few seconds, whose cost is the allocation rate's, not the fleet's.
func lowGCHeadroom() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(25)
	}
}

// resolve fills the config from the flags that need parsing or files.
func (f *swarmFlags) resolve() error {
	c := &f.cfg
	c.Seed = *f.seed
	if err := f.resolveLab(); err != nil {
		return err
	}
	tlsCfg, err := f.tlsConfig()
	if err != nil {
		return err
	}
	c.TLS = tlsCfg
	switch f.conns {
	case "per-device", "":
		c.Conns = 0
	default:
		n, err := strconv.Atoi(f.conns)
		if err != nil || n <= 0 {
			return fmt.Errorf("--conns %q: want per-device or a positive number", f.conns)
		}
		c.Conns = n
	}
	if f.sourceAddrs != "" {
		ips, err := sim.ParseSourceAddrs(f.sourceAddrs)
		if err != nil {
			return err
		}
		c.SourceAddrs = ips
	}
	if c.Protocol == sim.ProtocolMQTT && c.API == "v1" {
		if c.MQTTTarget == "" {
			for _, t := range f.targets {
				u, _ := sim.CheckTarget(t, c.AllowHosts)
				f.mqttTargets = append(f.mqttTargets, net.JoinHostPort(u.Hostname(), "1883"))
			}
			c.MQTTTarget = f.mqttTargets[0]
		}
		for _, t := range f.mqttTargets {
			if _, err := sim.CheckTargetAddr(t, c.AllowHosts); err != nil {
				return err
			}
		}
	}
	if f.dataDir != "" {
		if c.Operator == "" {
			t, err := server.ReadSecret(f.dataDir, "operator-token")
			if err != nil {
				return err
			}
			c.Operator = t
		}
		if f.secret == "" {
			if s, err := server.ReadSecret(f.dataDir, "secret"); err == nil {
				f.secret = s
			}
		}
	}
	if f.secret != "" {
		c.Secret = []byte(f.secret)
	}
	c.NoAudit = !f.audit
	if f.auditAfter != "" {
		c.AuditAfter = waitFor200(f.auditAfter)
	}
	c.SLOP99, c.MaxErrorRate = f.sloP99, f.maxErrorRate
	return nil
}

// validate is the run's configuration checked by sim.Config.Validate, every
// problem named by its flag.
func (f *swarmFlags) validate() error { return errors.Join(f.cfg.Validate()...) }

// run runs the swarm and judges it: audit, then SLO.
func (f *swarmFlags) run(ctx context.Context, w io.Writer) error {
	c := &f.cfg
	c.Progress, c.Log = w, w
	skipped := ""
	if !c.NoAudit && c.Operator == "" {
		skipped = "no operator token: give --operator-token or --data-dir, or --audit=false to run without it"
		fmt.Fprintln(w, "swarm: no operator token (--operator-token or --data-dir): the audit will be skipped and the run will exit 1")
	}
	if c.Protocol == sim.ProtocolMQTT {
		fmt.Fprintf(w, "swarm: %d MQTT kettles → %s (audit via %s), interval %s, hatch %g/s, duration %s, in-flight %d, batch %d\n",
			c.Devices, c.MQTTTarget, c.Target, c.Interval, c.HatchRate, c.Duration, c.MQTTInflight, c.Batch)
	} else {
		fmt.Fprintf(w, "swarm: %d kettles → %s (%s), interval %s, hatch %g/s, duration %s\n",
			c.Devices, c.Target, c.API, c.Interval, c.HatchRate, c.Duration)
	}
	f.log = w
	f.describeShape(w)
	stop, err := f.instrument(ctx)
	if err != nil {
		return err
	}
	ctx, endLive, err := f.startLive(ctx)
	if err != nil {
		stop()
		return err
	}
	res, err := f.runOnce(ctx)
	defer endLive(res, err)
	sys := stop()
	if res != nil {
		res.Command = f.command
		res.System = sys
		res.AuditSkipped = skipped
		res.Summary(w)
		if f.out != "" {
			p, werr := res.WriteFile(f.out)
			if werr != nil {
				return werr
			}
			fmt.Fprintf(w, "  results: %s\n", p)
			if f.report {
				f.writeReport(res, w)
			}
		}
	}
	if err != nil {
		return err
	}
	judged := f.judge(res)
	resPath := ""
	if f.out != "" {
		resPath = filepath.Join(f.out, "results.json")
	}
	if err := f.ci.apply(ctx, res, resPath, f.out, report.Checks(res, float64(f.sloP99)/1e6, f.maxErrorRate), w); judged == nil {
		return err
	} else if err != nil {
		fmt.Fprintf(w, "  %v\n", err)
	}
	return judged
}

// judge turns the results into an exit status.
func (f *swarmFlags) judge(res *sim.Results) error {
	if a := res.Audit; a != nil {
		if a.Lost > 0 {
			return exitCode{exitLost, fmt.Sprintf("audit failed: %d acknowledged readings lost (%s); e.g. %s", a.Lost, a.Line(), strings.Join(a.Examples, ", "))}
		}
		if a.Duplicated > 0 {
			return exitCode{exitDuplicate, fmt.Sprintf("audit failed: %d acknowledged readings stored more than once (%s); e.g. %s", a.Duplicated, a.Line(), strings.Join(a.Examples, ", "))}
		}
	}
	if lost := res.LostWorkers(); len(lost) > 0 {
		var b []string
		for _, w := range lost {
			b = append(b, fmt.Sprintf("%s (%d kettles from #%d every %d, %s)", w.Addr, w.Devices, w.First, max(w.Stride, 1), w.Error))
		}
		return fmt.Errorf("%d of %d workers lost, their share measured only until then and not audited: %s", len(lost), len(res.Workers), strings.Join(b, "; "))
	}
	if res.AuditSkipped != "" {
		return fmt.Errorf("audit: skipped (%s)", res.AuditSkipped)
	}
	t := res.Totals
	if f.maxErrorRate >= 0 && t.ErrorRate > f.maxErrorRate {
		return exitCode{exitSLO, fmt.Sprintf("SLO breached: error rate %.5f > --max-error-rate %g (%d of %d requests)", t.ErrorRate, f.maxErrorRate, t.Errors, t.Requests)}
	}
	if f.sloP99 > 0 {
		for name, e := range t.Endpoints {
			if name == sim.EPMQTTConnect {
				continue // once per kettle, at hatching: reported, not judged
			}
			if e.Requests > 0 && e.P99Ms > float64(f.sloP99)/1e6 {
				return exitCode{exitSLO, fmt.Sprintf("SLO breached: %s p99 %.1f ms > --slo-p99 %s", name, e.P99Ms, f.sloP99)}
			}
		}
	}
	if t.Requests == 0 {
		return errors.New("no request completed: is the server up at --target?")
	}
	return nil
}
