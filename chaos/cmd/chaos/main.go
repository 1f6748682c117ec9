// Command chaos is `make chaos`: faults, overload and hostile input against
// real kettle serve processes, each part judged from the outside.
//
//	go run ./chaos/cmd/chaos [flags] all|crash|outage|outage-blackhole|overload|slow|badinput|auth ...
//
// Every part prints one verdict line ("chaos PART: PASS|FAIL — …") and the
// command exits non-zero if any part failed. `all` runs every part and then
// writes docs/reliability.md from their results (each part also leaves
// OUT/PART.json, so a later `chaos doc` can regenerate the page).
//
// Everything it starts listens on 127.0.0.1 (or a Unix socket, for
// PostgreSQL) and every wait is bounded by a deadline.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Result is one part's outcome, as the report shows it.
type Result struct {
	Part     string    `json:"part"`
	Title    string    `json:"title"`
	Done     string    `json:"done"`     // what was done
	Measured []string  `json:"measured"` // actual numbers, one finding a line
	Pass     bool      `json:"pass"`
	Verdict  string    `json:"verdict"` // the one-line reason
	Rows     []Row     `json:"rows,omitempty"`
	Command  string    `json:"command"`
	Start    time.Time `json:"start"`
	Seconds  float64   `json:"seconds"`
}

// Row is a sub-check of a part (the bad-input and auth tables have many).
type Row struct {
	Check   string `json:"check"`
	Outcome string `json:"outcome"` // PASS, FAIL, NOT IMPLEMENTED
	Detail  string `json:"detail"`
}

type part struct {
	name, title string
	run         func(ctx context.Context, e *env) *Result
}

var parts = []part{
	{"crash", "1. Crash (kill -9 mid-run)", partCrash},
	{"outage", "2. Database outage (PostgreSQL stopped 30 s)", partOutage},
	{"outage-blackhole", "2b. Database unreachable (packets to PostgreSQL dropped 30 s)", partOutageBlackhole},
	{"overload", "3. Overload (a multiple of the measured capacity's request rate, 2 min)", partOverload},
	{"slow", "4. Slow and hostile clients", partSlow},
	{"badinput", "5. Bad input (fuzzing + hostile-input table)", partBadInput},
	{"auth", "6. Auth (cross-device, operator endpoints, revocation)", partAuth},
	{"failover", "7. High availability (PostgreSQL failover, switchover, standby loss, node restarts behind HAProxy)", partFailover},
	{"pause", "7b. The primary paused (SIGSTOP) past Patroni's ttl, against a kill -9", partPause},
	{"log-outage", "8a. Readings log: PostgreSQL stopped 60 s behind Kafka", partLogOutage},
	{"log-broker", "8b. Readings log: kill -9 one Kafka broker (not the active controller)", partLogBrokerFault("kill", "broker")},
	{"log-broker-pause", "8b'. Readings log: one Kafka broker paused (SIGSTOP) 30 s", partLogBrokerFault("pause", "broker")},
	{"log-controller", "8b''. Readings log: kill -9 the Kafka node that is the active controller", partLogBrokerFault("kill", "controller")},
	{"log-writer", "8c. Readings log: kill -9 a writer mid-run", partLogWriter},
	{"log-failover", "8d. Readings log: PostgreSQL failover and switchover under the fleet (0 non-200)", partLogFailover},
	{"mqttstorm", "9. MQTT reconnect storm (a lost node's kettles reconnect at once)", partMQTTStorm},
}

// env is what every part shares.
type env struct {
	root     string // the module root (go.mod)
	out      string // results directory
	bin      string // the kettle binary under test
	fuzztime time.Duration
	// overload's --max-conns and duration (flags, to try other limits)
	overloadMaxConns int
	overloadDuration time.Duration
	// overload's offered load: overloadMultiple × the request rate of
	// overloadCapacity kettles at a 30 s interval (0: measured in the same
	// run by a short kettle capacity).
	overloadCapacity int
	overloadMultiple float64
	log              *os.File // chaos.log: every process's output and our notes
	// mqttstorm's fleet sizes (mqttstorm.go)
	stormHeld, stormKettles, stormMaxConns int
	stormWindow                            time.Duration
}

func (e *env) logf(format string, a ...any) {
	msg := fmt.Sprintf(format, a...)
	fmt.Fprintf(os.Stderr, "  · %s\n", msg)
	fmt.Fprintf(e.log, "%s %s\n", time.Now().Format("15:04:05.000"), msg)
}

const usage = `usage: chaos [flags] PART...   (chaos parts: list them)

Parts (run in the order given; "all" = every part, then docs/reliability.md):
  crash     kill -9 kettle serve under a swarm, restart it; audit (PostgreSQL and SQLite)
  outage    stop PostgreSQL 30 s under a swarm: polls, 503s, /readyz, drain, audit
  outage-blackhole  the same with PostgreSQL unreachable (a proxy drops its traffic 30 s)
  overload  a short kettle capacity, then 10× its request rate for 2 min: memory bound, fast 503s, polls, recovery
  slow      slowloris headers and bodies, 5,000 idle connections, a client that never reads
  badinput  go test -fuzz on every decoder (bounded), then the hostile-input tables
  auth      cross-device access over HTTP and MQTT, operator endpoints, revoked devices
  failover  Patroni failover, switchover, standby loss, rolling restart behind HAProxy (go test ./ha/, long)
  pause     the primary paused (SIGSTOP) past the ttl, then a kill -9: a pause costs no more than a kill + Patroni's 2 s (go test ./ha/, long)
  log-outage, log-broker, log-broker-pause, log-controller, log-writer
            kettle serve --log (Kafka): PostgreSQL away 60 s, a broker killed or paused, the
            active controller killed (each: ≤ 1 s over the usual p99 for 30 foreign kettles), a writer killed
  log-failover  --log on the Patroni topology: kill -9 of the primary and a switchover, 0 non-200 (go test ./ha/, long)
  mqttstorm a node holding 16,000 MQTT kettles takes 16,000 more reconnecting within 10 s: CONNACKs, p99, audit
  nemesis   a seeded nemesis on the HA topology, 3 seeds × 10 min, then the checker (chaos nemesis --help: --seed, --duration, --faults)
  doc       regenerate docs/reliability.md from OUT/*.json of an earlier run

Flags:
`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "nemesis" {
		os.Exit(nemesisMain(os.Args[2:])) // its own flags: nemesis.go
	}
	if len(os.Args) == 2 && os.Args[1] == "parts" { // every part, a name a line (the Makefile's list is checked against it)
		for _, p := range parts {
			fmt.Println(p.name)
		}
		return
	}
	fs := flag.NewFlagSet("chaos", flag.ExitOnError)
	out := fs.String("out", "", "results directory (default: ROOT/chaos-results)")
	doc := fs.String("doc", "", "the generated page (default: ROOT/docs/reliability.md)")
	fuzztime := fs.Duration("fuzztime", 20*time.Second, "time given to each fuzz target")
	omc := fs.Int("overload-max-conns", 4000, "overload: kettle serve --max-conns (the swarm uses 3000 connections)")
	odur := fs.Duration("overload-duration", 2*time.Minute, "overload: how long the overload lasts")
	ocap := fs.Int("overload-capacity", 0, "overload: the kettles (at a 30 s interval) kettle serve holds, whose request rate is multiplied (0: measured first in the same run by a short kettle capacity against the same binary)")
	omul := fs.Float64("overload-multiple", 10, "overload: the offered request rate as a multiple of --overload-capacity's")
	sheld := fs.Int("storm-held", 16000, "mqttstorm: MQTT kettles the node holds")
	skettles := fs.Int("storm-kettles", 16000, "mqttstorm: kettles reconnecting at once")
	swindow := fs.Duration("storm-window", 10*time.Second, "mqttstorm: the window they reconnect in")
	smax := fs.Int("storm-max-conns", 18500, "mqttstorm: the node's --mqtt-max-conns (one process has 20,000 open files here)")
	fs.Usage = func() { fmt.Fprint(os.Stderr, usage); fs.PrintDefaults() }
	fs.Parse(os.Args[1:])
	names := fs.Args()
	if len(names) == 0 {
		fs.Usage()
		os.Exit(2)
	}
	root, err := moduleRoot()
	if err != nil {
		fatal(err)
	}
	if *out == "" {
		*out = filepath.Join(root, "chaos-results")
	}
	if *doc == "" {
		*doc = filepath.Join(root, "docs", "reliability.md")
	}
	if len(names) == 1 && names[0] == "all" {
		names = nil
		for _, p := range parts {
			names = append(names, p.name)
		}
		names = append(names, "doc")
	}
	for _, n := range names {
		if n != "doc" && find(n) == nil {
			fmt.Fprintf(os.Stderr, "chaos: unknown part %q\n", n)
			fs.Usage()
			os.Exit(2)
		}
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fatal(err)
	}
	logf, err := os.OpenFile(filepath.Join(*out, "chaos.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fatal(err)
	}
	defer logf.Close()
	e := &env{root: root, out: *out, fuzztime: *fuzztime, log: logf, overloadMaxConns: *omc, overloadDuration: *odur, overloadCapacity: *ocap, overloadMultiple: *omul,
		stormHeld: *sheld, stormKettles: *skettles, stormWindow: *swindow, stormMaxConns: *smax}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	needBin := false
	for _, n := range names {
		if n != "doc" && n != "auth" && n != "failover" && n != "pause" && n != "log-failover" {
			needBin = true
		}
	}
	if needBin {
		e.bin = filepath.Join(*out, "bin", "kettle")
		e.logf("building %s", e.bin)
		cmd := exec.CommandContext(ctx, "go", "build", "-o", e.bin, "./cmd/kettle")
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			fatal(fmt.Errorf("go build ./cmd/kettle: %v\n%s", err, b))
		}
	}

	failed := 0
	for _, n := range names {
		if n == "doc" {
			if err := writeDoc(e, *doc); err != nil {
				fmt.Fprintf(os.Stderr, "chaos doc: %v\n", err)
				failed++
				continue
			}
			fmt.Printf("chaos doc: wrote %s\n", *doc)
			continue
		}
		p := find(n)
		fmt.Fprintf(os.Stderr, "== chaos %s: %s\n", p.name, p.title)
		start := time.Now()
		r := p.run(ctx, e)
		r.Part, r.Title, r.Start, r.Seconds = p.name, p.title, start, time.Since(start).Seconds()
		r.Command = "go run ./chaos/cmd/chaos " + p.name
		if p.name == "badinput" {
			r.Command += fmt.Sprintf(" (--fuzztime %s)", e.fuzztime)
		}
		verdict := "PASS"
		if !r.Pass {
			verdict = "FAIL"
			failed++
		}
		fmt.Printf("chaos %s: %s — %s (%.0fs)\n", p.name, verdict, r.Verdict, r.Seconds)
		fmt.Fprintf(e.log, "chaos %s: %s — %s\n", p.name, verdict, r.Verdict)
		b, _ := json.MarshalIndent(r, "", " ")
		os.WriteFile(filepath.Join(*out, p.name+".json"), b, 0o644)
		if ctx.Err() != nil {
			break
		}
	}
	if failed > 0 {
		os.Exit(1)
	}
}

func find(name string) *part {
	for i := range parts {
		if parts[i].name == name {
			return &parts[i]
		}
	}
	return nil
}

func fatal(err error) {
	fmt.Fprintf(os.Stderr, "chaos: %v\n", err)
	os.Exit(1)
}

// moduleRoot walks up from the working directory to go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.Contains(string(b), "module github.com/kettlefleet/kettlefleet\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("run chaos inside the kettlefleet module (no go.mod found above the working directory)")
		}
		dir = parent
	}
}

// fail and pass build a Result's verdict.
func (r *Result) measure(format string, a ...any) {
	r.Measured = append(r.Measured, fmt.Sprintf(format, a...))
}

func (r *Result) fail(format string, a ...any) *Result {
	r.Pass = false
	if r.Verdict != "" {
		r.Verdict += "; "
	}
	r.Verdict += fmt.Sprintf(format, a...)
	return r
}
