package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sim"
)

// exitRegressed is the exit status of a comparison that regressed (kettle
// report --baseline, kettle swarm --baseline).
const exitRegressed = 6

// ciFlags are kettle report's and kettle swarm's flags for CI and other
// tools: a comparison against a baseline run, a JUnit summary, the
// per-second series pushed to Prometheus.
type ciFlags struct {
	baseline    string
	pool        string
	thresholds  string
	junit       string
	remoteWrite string
	rwLabels    string
}

const ciDoc = `
Comparing runs: --baseline A/results.json compares this run (B) with A,
endpoint by endpoint: latency p50, p99, p99.9, completed requests a second,
error rate, the server's CPU per request and memory per kettle (and the
simulator's), the audit and the USE verdicts side by side. Each figure is
computed over each run's steady seconds (after hatching); its confidence
interval (95 %) is a moving-block bootstrap over those seconds (5 s blocks,
the seconds' HDR histograms merged for percentiles), and the change is B/A
(B−A for the error rate). A figure "regressed" when its change passed its
threshold and its whole interval lies beyond no change, "improved" likewise,
otherwise it is "within noise". --thresholds FILE (YAML or JSON) sets the
thresholds per figure, e.g.

  confidence: 0.95
  figures:
    measurement.p99: {regress_if_ratio_over: 1.10}
    "*.p99.9": {ignore: true}
    "*.error_rate": {regress_if_delta_over: 0.0005}

(defaults and the format: docs/operations.md, "Comparing runs"). The page
is written to compare.html, the verdict as JSON to compare.json. A figure
that regressed fails the run with exit status 6 (after the run's own
failures: audit, SLO).

Rounds: one run a side shows the noise within a run, not between runs (on
a shared machine two runs of one build differ by more than their seconds
suggest). --baseline A1,A2,A3 takes several runs of the baseline build and
--pool B1,B2 more runs of this one (each a results.json or its directory);
each run's figure is then one observation and the interval is Student's t
over the runs (their logarithms; variance pooled across the sides), so two
runs of one build come out within noise more often the more rounds there
are. bench/compare.sh runs such rounds (docs/benchmarks.md).

--junit FILE writes a JUnit XML summary for CI systems: one testcase per SLO
check (each endpoint's p99, the error rate), audit check and compared
figure, failures with their message.

--remote-write URL pushes the run's per-second series (latency percentiles,
offered and completed requests, status codes, error kinds, kettles, lag,
CPU and memory per process) to a Prometheus remote-write receiver (protocol
1.0; e.g. prometheus --web.enable-remote-write-receiver, URL
http://HOST:9090/api/v1/write), labelled job="kettle-swarm" and run=the
run's start time, plus --remote-write-label. Prometheus accepts samples
only about an hour back (its head block) unless its TSDB allows out-of-order
samples.`

func (c *ciFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.baseline, "baseline", "", "compare this run with a baseline run's results.json (or its directory; several runs of the baseline build comma-separated): compare.html and compare.json; exit 6 when a figure regressed")
	fs.StringVar(&c.pool, "pool", "", "with --baseline: more runs of this build (results.json files or their directories, comma-separated), compared with this run as one side; the interval is then the spread between runs")
	fs.StringVar(&c.thresholds, "thresholds", "", "with --baseline: YAML or JSON file of the thresholds per figure (empty: the defaults; see docs/operations.md)")
	fs.StringVar(&c.junit, "junit", "", "write a JUnit XML summary here: one testcase per SLO, audit and comparison check")
	fs.StringVar(&c.remoteWrite, "remote-write", "", "push the per-second series to this Prometheus remote-write URL, e.g. http://127.0.0.1:9090/api/v1/write (empty: off)")
	fs.StringVar(&c.rwLabels, "remote-write-label", "", "extra labels of the pushed series, NAME=VALUE,… (e.g. build=abc123)")
}

// validate checks the files and labels before a run spends its minutes.
func (c *ciFlags) validate() error {
	if c.thresholds != "" && c.baseline == "" {
		return fmt.Errorf("--thresholds %s: give --baseline too (thresholds judge a comparison)", c.thresholds)
	}
	if c.pool != "" && c.baseline == "" {
		return fmt.Errorf("--pool %s: give --baseline too (pooled runs are one side of a comparison)", c.pool)
	}
	if _, err := readRuns("--baseline", c.baseline); err != nil {
		return err
	}
	if _, err := readRuns("--pool", c.pool); err != nil {
		return err
	}
	if c.thresholds != "" {
		if _, err := report.ReadThresholds(c.thresholds); err != nil {
			return fmt.Errorf("--thresholds: %w", err)
		}
	}
	if c.rwLabels != "" {
		if _, err := report.ParseLabels(c.rwLabels); err != nil {
			return fmt.Errorf("--remote-write-label: %w", err)
		}
	}
	if c.remoteWrite != "" && !strings.HasPrefix(c.remoteWrite, "http://") && !strings.HasPrefix(c.remoteWrite, "https://") {
		return fmt.Errorf("--remote-write %q: want an http:// or https:// URL, e.g. http://127.0.0.1:9090/api/v1/write", c.remoteWrite)
	}
	return nil
}

// readRuns reads the comma-separated results of flag name (none when
// list is empty); the error names the flag and the file.
func readRuns(name, list string) ([]*sim.Results, error) {
	if list == "" {
		return nil, nil
	}
	var rs []*sim.Results
	for _, p := range strings.Split(list, ",") {
		if p = strings.TrimSpace(p); p == "" {
			return nil, fmt.Errorf("%s %q: an empty path in the list", name, list)
		}
		r, err := readResults(p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// readResults reads a results.json, or DIR/results.json.
func readResults(path string) (*sim.Results, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "results.json")
	}
	return sim.ReadResults(path)
}

// apply does what the flags ask of a finished run (res, read from or
// written to path; the comparison's files go to outDir when not empty):
// the comparison, the JUnit summary, the push. checks are the run's own
// SLO and audit checks. It returns an exitCode when the comparison
// regressed, or the first error.
func (c *ciFlags) apply(ctx context.Context, res *sim.Results, path, outDir string, checks []report.Check, w io.Writer) error {
	var cmpErr error
	if c.baseline != "" {
		cmp, err := c.compare(res, path, outDir, w)
		if err != nil {
			return err
		}
		checks = append(checks, cmp.Checks()...)
		if cmp.Failed {
			cmpErr = exitCode{exitRegressed, "compared with the baseline " + c.baseline + ": " + cmp.Line}
		}
	}
	if c.junit != "" {
		if err := report.WriteJUnitFile(c.junit, "kettle", checks); err != nil {
			return err
		}
		fmt.Fprintf(w, "  junit: %s\n", c.junit)
	}
	if c.remoteWrite != "" {
		labels, err := report.ParseLabels(c.rwLabels)
		if err != nil {
			return fmt.Errorf("--remote-write-label: %w", err)
		}
		s, err := report.Build(res, report.Options{})
		if err != nil {
			return err
		}
		n, err := report.RemoteWrite(ctx, nil, c.remoteWrite, s.RemoteSeries(labels))
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "  remote write: %d samples to %s\n", n, c.remoteWrite)
	}
	return cmpErr
}

func (c *ciFlags) compare(res *sim.Results, path, outDir string, w io.Writer) (*report.Comparison, error) {
	base, err := readRuns("--baseline", c.baseline)
	if err != nil {
		return nil, err
	}
	more, err := readRuns("--pool", c.pool)
	if err != nil {
		return nil, err
	}
	th := report.DefaultThresholds()
	if c.thresholds != "" {
		if th, err = report.ReadThresholds(c.thresholds); err != nil {
			return nil, err
		}
	}
	cands := append([]*sim.Results{res}, more...)
	cpaths := path
	if c.pool != "" {
		cpaths += "," + c.pool
	}
	cmp, err := report.CompareRuns(base, cands, th, report.CompareOptions{BaselinePath: c.baseline, CandidatePath: cpaths})
	if err != nil {
		return nil, err
	}
	cmp.Summary(w)
	if outDir != "" {
		html, js := filepath.Join(outDir, "compare.html"), filepath.Join(outDir, "compare.json")
		if err := cmp.WriteFile(html); err != nil {
			return nil, err
		}
		b, err := cmp.JSON()
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(js, b, 0o644); err != nil {
			return nil, err
		}
		fmt.Fprintf(w, "  comparison: %s, %s\n", html, js)
	}
	return cmp, nil
}
