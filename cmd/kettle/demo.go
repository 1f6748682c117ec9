package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sim"
)

func init() {
	register("demo", "the case study end to end: serve on the embedded store + swarm + audit, in one command", runDemo)
}

const demoDoc = `
Runs the case study end to end with nothing installed beyond Go: starts kettle
serve in this process on a fresh data directory (embedded SQLite store), then
swarms it like the case study did (20,000 kettles, 30 s interval, hatched at
200/s so the whole fleet is up after 100 s) for --duration, printing the live
progress, then the summary (throughput, p50/p99 per endpoint, errors), the
audit of every acknowledged reading, and where the results are.

The server shares this process, so the CPU and memory figures include it, and
both ends of every connection count against one open-file limit: connections
are a shared pool (--conns). For the simulator's own cost, run kettle serve and
kettle swarm as two processes (the summary prints the commands).

Exit status: as kettle swarm (0 ok, 1 could not run, 3 lost, 4 duplicated,
5 SLO breached).`

func runDemo(ctx context.Context, args []string) error {
	fs := newFlagSet("demo", "[--devices 20000] [--duration 3m] [flags]", demoDoc)
	var f swarmFlags
	f.register(fs, 20000, 3*time.Minute, 200, "2000")
	dataDir := fs.String("data-dir", "", "fresh directory for the store, secrets, server log and results (empty: a new temporary directory); kept afterwards")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	dir := *dataDir
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "kettle-demo-"); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create --data-dir: %w", err)
	}
	logPath := filepath.Join(dir, "serve.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return fmt.Errorf("create server log: %w", err)
	}
	defer logf.Close()

	// Both ends of every connection live in this process: give the server
	// half of the file descriptors. Otherwise it is `kettle serve` with
	// these flags (and the KETTLE_* environment serve reads).
	half := sim.FDBudget(0) / 2
	db := "sqlite:" + filepath.Join(dir, "kettle.db")
	scfg, err := serveConfig([]string{"--data-dir", dir, "--db", db, "--addr", "127.0.0.1:0", "--max-conns", strconv.Itoa(half)}, logf)
	if err != nil {
		return err
	}
	srv, err := server.Start(ctx, scfg)
	if err != nil {
		return fmt.Errorf("start the in-process server: %w", err)
	}
	defer srv.Close()

	c := &f.cfg
	c.Target, c.Operator = srv.URL(), srv.OperatorToken()
	f.secret, f.audit = string(srv.Secret()), true
	c.ReserveFDs = half
	c.InProcessNote = "server runs in this process: CPU and RSS include it"
	f.serverPID = os.Getpid() // the sampler records this one process once, as the server
	f.postgresPID = -1        // embedded store: other clusters on the machine are not ours
	if f.out == "" {
		f.out = dir
	}
	if err := f.resolve(); err != nil {
		return err
	}
	if err := f.validate(); err != nil {
		return err
	}
	f.command = commandLine("demo", args)
	fmt.Fprintf(os.Stderr, "demo: kettle serve (embedded SQLite) at %s, data in %s, server log %s\n", srv.URL(), dir, logPath)

	runErr := f.run(ctx, os.Stderr)

	fmt.Fprintf(os.Stderr, "  data dir (store, secrets, results.json, serve.log): %s\n", dir)
	fmt.Fprintf(os.Stderr, "  the same run as two processes:\n    kettle serve --data-dir %s --db %s --addr 127.0.0.1:8080 &\n    kettle swarm --target http://127.0.0.1:8080 --data-dir %s --devices %d --interval %s --hatch-rate %g --duration %s --conns %s --out %s\n",
		dir, db, dir, c.Devices, c.Interval, c.HatchRate, c.Duration, f.conns, dir)
	if err := srv.Close(); err != nil && runErr == nil {
		return fmt.Errorf("stop the in-process server: %w", err)
	}
	return runErr
}
