package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/results"
)

// scripts are the benchmarks: every bench/*.sh (the libraries they source
// live in bench/lib/).
func scripts(t *testing.T) []string {
	t.Helper()
	s, err := filepath.Glob("*.sh")
	if err != nil || len(s) == 0 {
		t.Fatalf("no bench/*.sh: %v", err)
	}
	sort.Strings(s)
	return s
}

// smokeArgs are the arguments of the scripts that take some: the A/B
// scripts compare two kettle binaries (here the same one twice).
func smokeArgs(script, bins string) []string {
	switch script {
	case "pg-ab.sh", "pg-stats-ab.sh":
		return []string{filepath.Join(bins, "kettle"), filepath.Join(bins, "kettle")}
	}
	return nil
}

// heavySmoke are the scripts whose smoke run brings up the HA topology or
// Kafka: over a minute each on two cores, so make test leaves them to make
// chaos (bench-smoke), which runs every script.
var heavySmoke = map[string]bool{"ha-sync.sh": true, "sizing.sh": true, "log-vs-direct.sh": true}

// TestBenchSmoke runs every benchmark script in its smoke mode (SMOKE=1:
// tiny sizes, seconds) and checks that it exits 0 and records one run of
// itself, into a scratch log: a benchmark that cannot start, or whose record
// fails, fails the build instead of its next reader.
func TestBenchSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the benchmarks' smoke runs start servers, PostgreSQL, the HA topology and Kafka")
	}
	bins := t.TempDir()
	start := time.Now()
	// One go build for all: its packages compile and link in parallel; each
	// binary is named after its package's directory, as bench_build expects.
	pkgs := []string{"./cmd/kettle", "./internal/results/cmd/record", "./bench/bare", "./bench/pgbench", "./bench/mqttpub", "./bench/mqttfleet", "./bench/tlsstorm"}
	cmd := exec.Command("go", append([]string{"build", "-o", bins + string(filepath.Separator)}, pkgs...)...)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %v: %v\n%s", pkgs, err, out)
	}
	t.Logf("built the benchmarks' binaries in %s", time.Since(start).Round(time.Second))
	// Three scripts at a time; those that bring up deploy/cluster.sh's
	// topology (its fixed addresses) one at a time besides.
	slots := make(chan struct{}, 3)
	var topology sync.Mutex
	t.Cleanup(func() { t.Logf("every benchmark's smoke run in %s", time.Since(start).Round(time.Second)) })
	for _, s := range scripts(t) {
		t.Run(s, func(t *testing.T) {
			if heavySmoke[s] && os.Getenv("KETTLE_HA_LONG") == "" {
				t.Skip("KETTLE_HA_LONG: brings up the HA topology or Kafka (a minute and more each); make chaos's bench-smoke part runs it")
			}
			t.Parallel()
			if s == "ha-sync.sh" || s == "sizing.sh" {
				topology.Lock()
				defer topology.Unlock()
			}
			slots <- struct{}{}
			defer func() { <-slots }()
			log := filepath.Join(t.TempDir(), "results.jsonl")
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "bash", append([]string{s}, smokeArgs(s, bins)...)...)
			cmd.Env = append(os.Environ(), "SMOKE=1", "KETTLE_RESULTS="+log, "KETTLE_BENCH_BINS="+bins, "KETTLE_RECORD_BIN="+filepath.Join(bins, "record"))
			began := time.Now()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("SMOKE=1 bench/%s: %v after %s; its output's end:\n%s", s, err, time.Since(began).Round(time.Second), tail(out, 40))
			}
			f, err := os.Open(log)
			if err != nil {
				t.Fatalf("SMOKE=1 bench/%s recorded nothing: %v; its output's end:\n%s", s, err, tail(out, 40))
			}
			defer f.Close()
			recs, err := results.Read(f)
			if err != nil || len(recs) != 1 || recs[0].Bench != s {
				t.Fatalf("SMOKE=1 bench/%s: want one record of itself, got %d (%v)", s, len(recs), err)
			}
			t.Logf("%s in %s, %d figures", s, time.Since(began).Round(time.Second), len(recs[0].Figures))
		})
	}
}

func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
