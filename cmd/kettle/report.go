package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

func init() {
	register("report", "turn a results.json into one self-contained HTML report with a USE verdict", runReport)
}

// The swarm's client-side metrics are what the simulator observes.
var _ sim.Observer = (*metrics.Swarm)(nil)

const reportDoc = `
Reads the results.json of kettle swarm (or demo) and writes one HTML file
that needs no network to view: latency percentiles per endpoint over time
(selectable), offered vs completed throughput, status codes, active kettles,
CPU and memory per process, disk await, ingest queue depth and pool wait; the
run's parameters and the command that reproduces it; a USE table (utilisation,
saturation, errors) per resource; and a verdict naming the first resource to
saturate, with its evidence and time. When nothing saturated, the verdict
says the target held only if the p99 stayed within --slo-p99 and failed
requests within --max-error-rate (0.001 when the run had that gate off);
otherwise it says what broke and, for failures, their kinds (http_401, …).

kettle swarm --out DIR and kettle demo write DIR/report.html themselves.
--system FILE uses system samples recorded elsewhere (sysstat.Series JSON,
e.g. by the server sampling itself) in place of the results' own.
--json also writes the report's summary as JSON (what the page shows).

With --baseline the comparison's page and JSON go next to the report
(compare.html, compare.json): kettle report --baseline A/results.json
B/results.json. Its SLO checks (--junit) are the run's own (slo_p99_ms,
max_error_rate in its params; 0.001 when the run had no error gate).
` + ciDoc

func runReport(ctx context.Context, args []string) error {
	fs := newFlagSet("report", "RESULTS.json [-o report.html]", reportDoc)
	out := fs.String("o", "", "output HTML file (default: report.html next to RESULTS)")
	jsonOut := fs.String("json", "", "also write the summary as JSON to this file")
	title := fs.String("title", "", "page title (default: kettles and start time)")
	system := fs.String("system", "", "system samples to use instead of the results' own (e.g. written by a server sampling itself)")
	var ci ciFlags
	ci.register(fs)
	// The results file may come before or after the flags.
	var path string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		path, args = args[0], args[1:]
	}
	if err := parseArgs(fs, args); err != nil {
		return err
	}
	if err := flagsFromEnv(fs); err != nil {
		return err
	}
	if path == "" && fs.NArg() > 0 {
		// Flags may follow the results file too (--baseline A B --junit F).
		path = fs.Arg(0)
		if err := fs.Parse(fs.Args()[1:]); err != nil {
			return err
		}
		if err := flagsFromEnv(fs); err != nil {
			return err
		}
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if path == "" {
		fs.Usage()
		return errors.New("give the results.json of a kettle swarm run")
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "results.json")
	}
	if *out == "" {
		*out = filepath.Join(filepath.Dir(path), "report.html")
	}
	if err := ci.validate(); err != nil {
		return err
	}
	r, err := sim.ReadResults(path)
	if err != nil {
		return err
	}
	if *system != "" {
		if r.System, err = sysstat.ReadFile(*system); err != nil {
			return err
		}
	}
	s, err := report.Build(r, report.Options{Title: *title})
	if err != nil {
		return err
	}
	if err := s.WriteFile(*out); err != nil {
		return err
	}
	if *jsonOut != "" {
		if err := s.WriteJSON(*jsonOut); err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stderr, "verdict: %s\nreport: %s\n", s.Verdict.Text, *out)
	maxErr := r.Params.MaxErrorRate
	if maxErr == 0 {
		maxErr = 0.001 // kettle swarm's default gate
	}
	return ci.apply(ctx, r, path, filepath.Dir(*out), report.Checks(r, r.Params.SLOP99Ms, maxErr), os.Stderr)
}

// instrument starts what watches a run besides the simulator itself: the
// swarm's /metrics (--metrics-addr) and the system sampler (--sample). The
// returned stop ends both and returns the samples (nil when not sampled).
func (f *swarmFlags) instrument(ctx context.Context) (stop func() *sysstat.Series, err error) {
	w := f.log
	var closers []func()
	if f.metricsAddr != "" {
		m := metrics.NewSwarm(prometheus.NewRegistry())
		l, err := metrics.Listen(f.metricsAddr, m.Handler())
		if err != nil {
			return nil, err
		}
		f.cfg.Observer = m
		fmt.Fprintf(w, "swarm: metrics at %s\n", l.URL())
		closers = append(closers, func() { _ = l.Close() })
	}
	var smp *sysstat.Sampler
	if f.sample {
		pid := f.serverPID
		u, _ := url.Parse(f.cfg.Target)
		if pid == 0 && u != nil {
			port, _ := strconv.Atoi(u.Port())
			if port == 0 {
				port = 80
			}
			if p, err := sysstat.FindListener("", port); err == nil {
				pid = p
			} else {
				fmt.Fprintf(w, "swarm: server process not sampled: %v\n", err)
			}
		}
		cfg := sysstat.Config{ServerPID: pid, PostgresPID: f.postgresPID, MetricsURL: strings.TrimRight(f.cfg.Target, "/") + "/metrics"}
		if f.workers != "" {
			cfg.SimulatorPID = -1 // the workers simulate; their CPU and RSS are in the results
		}
		if f.cfg.TLS != nil {
			cfg.Client = &http.Client{Timeout: 800 * time.Millisecond, Transport: &http.Transport{TLSClientConfig: f.cfg.TLS}}
		}
		smp, err = sysstat.Start(ctx, cfg)
		f.sampler = smp
		if err != nil {
			fmt.Fprintf(w, "swarm: system not sampled: %v\n", err)
			smp, f.sampler = nil, nil
		} else if pid > 0 {
			fmt.Fprintf(w, "swarm: sampling server pid %d, PostgreSQL, the simulator and the machine each second\n", pid)
		}
	}
	return func() *sysstat.Series {
		for _, c := range closers {
			c()
		}
		if smp == nil {
			return nil
		}
		return smp.Close()
	}, nil
}

// writeReport writes DIR/report.html for a finished run and prints its verdict.
func (f *swarmFlags) writeReport(res *sim.Results, w io.Writer) {
	s, err := report.Build(res, report.Options{})
	if err == nil {
		p := filepath.Join(f.out, "report.html")
		if err = s.WriteFile(p); err == nil {
			fmt.Fprintf(w, "  verdict: %s\n  report: %s\n", s.Verdict.Text, p)
			return
		}
	}
	fmt.Fprintf(w, "  report: not written: %v\n", err)
}
