package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestDocKeepsRowsOfPartsNotRun: a page rendered from one part's result
// keeps every other part's row, checks and run time from the page before,
// and rendering it again changes nothing but the header.
func TestDocKeepsRowsOfPartsNotRun(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	os.Mkdir(out, 0o755)
	page := filepath.Join(dir, "reliability.md")
	e := &env{out: out}
	write := func(r *Result) {
		t.Helper()
		b, _ := jsonIndent(r)
		if err := os.WriteFile(filepath.Join(out, r.Part+".json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Date(2026, 11, 27, 21, 25, 48, 0, time.UTC)
	write(&Result{Part: "crash", Title: "1. Crash", Done: "kill | restart", Measured: []string{"acked=1 lost=0", "down 2.2s"}, Pass: true, Verdict: "0 lost", Command: "go run ./chaos/cmd/chaos crash", Start: start, Seconds: 94})
	write(&Result{Part: "auth", Done: "tables", Pass: false, Verdict: "1 check failed", Rows: []Row{{Check: "a|b", Outcome: "FAIL", Detail: "x\ny"}}, Start: start.Add(time.Hour), Seconds: 4, Command: "go run ./chaos/cmd/chaos auth"})
	if err := writeDoc(e, page); err != nil {
		t.Fatal(err)
	}
	first, _ := os.ReadFile(page)
	// Only the auth part is run again; crash's row comes from the page.
	os.Remove(filepath.Join(out, "crash.json"))
	if err := writeDoc(e, page); err != nil {
		t.Fatal(err)
	}
	second, _ := os.ReadFile(page)
	body := func(b []byte) string { _, rest, _ := strings.Cut(string(b), "\n\n| part |"); return rest }
	if body(first) != body(second) {
		t.Errorf("the page rendered again without crash.json differs:\n%s\n---\n%s", body(first), body(second))
	}
	for _, want := range []string{"| 1. Crash (kill -9 mid-run) | kill \\| restart | acked=1 lost=0<br>down 2.2s | PASS: 0 lost |",
		"| a\\|b | FAIL | x<br>y |", "| crash | 2026-11-27 21:25:48 | 94 |", "| 7b. The primary paused (SIGSTOP) past Patroni's ttl, against a kill -9 | — | — | not run |"} {
		if !strings.Contains(string(second), want) {
			t.Errorf("the page lacks %q:\n%s", want, second)
		}
	}
	// Rows in the order of their numbers, whatever file registered them.
	var labels []string
	for _, l := range strings.Split(body(second), "\n") {
		if c := cells(l); len(c) == 4 && strings.HasPrefix(l, "| ") && !strings.HasPrefix(l, "|---") && label(strings.TrimSpace(c[0])) != "" {
			labels = append(labels, label(strings.TrimSpace(c[0])))
		}
		if strings.HasPrefix(l, "## ") {
			break
		}
	}
	if !slices.IsSortedFunc(labels, cmpLabel) {
		t.Errorf("rows out of order: %v", labels)
	}
}

// TestMergeNemesis: seeds run one at a time with the same options add up
// to one result; a rerun seed replaces its lines; other options do not mix.
func TestMergeNemesis(t *testing.T) {
	o, err := parseNemesis([]string{"--seed", "1", "--duration", "10m"})
	if err != nil {
		t.Fatal(err)
	}
	one := func(seed uint64, pass bool) *Result {
		q := o
		q.seeds = []uint64{seed}
		r := &Result{Pass: true, Done: nemDone(q), Measured: []string{fmtSeed(seed, pass)}, Seconds: 700}
		var failed []string
		if !pass {
			failed = []string{fmtUint(seed)}
		}
		return nemVerdict(r, q, failed)
	}
	with := func(seed uint64) nemOpts { q := o; q.seeds = []uint64{seed}; return q }
	r := mergeNemesis(one(1, true), one(2, false), with(2))
	r = mergeNemesis(r, one(3, true), with(3))
	if r.Pass || !strings.Contains(r.Command, "--seed 1,2,3 ") || !strings.Contains(r.Verdict, "seed(s) 2 failed") || len(r.Measured) != 3 || r.Seconds != 2100 {
		t.Errorf("seeds 1, 2 (failed), 3: %+v", r)
	}
	r = mergeNemesis(r, one(2, true), with(2))
	if !r.Pass || !strings.Contains(r.Verdict, "3 seed(s) × 10m0s") || !slices.Equal(r.Measured, []string{fmtSeed(1, true), fmtSeed(2, true), fmtSeed(3, true)}) {
		t.Errorf("seed 2 rerun and passing: %+v", r)
	}
	short := with(4)
	short.duration = 2 * time.Minute
	if m := mergeNemesis(r, one(4, true), short); strings.Contains(m.Command, "1,") {
		t.Errorf("a 2-minute seed merged into 10-minute ones: %s", m.Command)
	}
}

func jsonIndent(r *Result) ([]byte, error) { return json.MarshalIndent(r, "", " ") }

func fmtUint(n uint64) string { return strconv.FormatUint(n, 10) }

func fmtSeed(seed uint64, pass bool) string {
	if pass {
		return "seed " + fmtUint(seed) + ": ok   audit"
	}
	return "seed " + fmtUint(seed) + ": FAIL audit"
}

// TestNemesisBudget: the page's reason for keeping the nemesis out of make
// test comes from the recorded run (seeds, duration, seconds), and a record
// without them gives no reason rather than a made-up one.
func TestNemesisBudget(t *testing.T) {
	f := func(cmd string, seconds float64, want string) {
		t.Helper()
		got := nemesisBudget(&Result{Command: cmd, Seconds: seconds})
		if want == "" && got != "" || !strings.Contains(got, want) {
			t.Errorf("nemesisBudget(%q, %v) = %q, want it to contain %q", cmd, seconds, got, want)
		}
	}
	f("go run ./chaos/cmd/chaos nemesis --seed 1,2,3 --duration 10m0s --faults pause --nodes 2 --log=false --kettles 300", 2400, "3 seed(s) of 10m0s took 2400 s here, 800 s a seed, of which 200 s beyond")
	f("go run ./chaos/cmd/chaos nemesis --seed 7 --duration 2m0s --faults pause --nodes 2 --log=false --kettles 300", 300, "about 300 s under the heavy lock")
	f("go run ./chaos/cmd/chaos nemesis --seed 7 --duration 2m0s --faults pause", 0, "")
	f("go run ./chaos/cmd/chaos nem-clock", 60, "")
}
