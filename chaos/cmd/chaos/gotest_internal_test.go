package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestLongTest: longTest runs the test with KETTLE_HA_LONG=1, copies its
// figures and then the lines keep picks into the result, and fails the
// result when the test fails.
func TestLongTest(t *testing.T) {
	log, err := os.Create(filepath.Join(t.TempDir(), "chaos.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	e := &env{root: "../../..", log: log}
	keep := func(l string) bool { return strings.Contains(l, "kept:") }
	run := func() *Result {
		r := &Result{Pass: true}
		longTest(t.Context(), e, r, "./chaos/cmd/chaos/testdata/longtest", "TestLong", 3*time.Minute, keep)
		return r
	}
	r := run()
	want := []string{"span: 1.5 s", "long_test.go:16: kept: this line"}
	if !r.Pass || !slices.Equal(r.Measured, want) {
		t.Fatalf("passing test: pass %v, measured %q; want true, %q (%s)", r.Pass, r.Measured, want, r.Verdict)
	}
	t.Setenv("LONGTEST_FAIL", "1")
	if r := run(); r.Pass || !strings.Contains(r.Verdict, "TestLong") {
		t.Fatalf("failing test: pass %v, verdict %q; want a failure naming the test", r.Pass, r.Verdict)
	}
}
