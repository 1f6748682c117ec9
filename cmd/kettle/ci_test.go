package main_test

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/servertest"
)

// runKettle runs the kettle binary and returns its exit status and output.
func runKettle(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, kettleBin, args...).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &ee):
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("kettle %v: %v\n%s", args, err, out)
	return -1, ""
}

// TestSwarmBaselineJUnitRemoteWrite runs two small swarms against a real
// server, the second with --baseline (the first's results), --junit and
// --remote-write: the comparison's page and JSON are written, the JUnit
// summary holds the SLO, audit and comparison checks, and the series
// reach the remote-write receiver as snappy-compressed protobuf.
func TestSwarmBaselineJUnitRemoteWrite(t *testing.T) {
	srv, dir := servertest.SQLite(t)
	var pushes, bytes atomic.Int64
	rw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Header.Get("Content-Encoding") != "snappy" || r.Header.Get("Content-Type") != "application/x-protobuf" || len(b) == 0 {
			http.Error(w, "want snappy protobuf", http.StatusBadRequest)
			return
		}
		pushes.Add(1)
		bytes.Add(int64(len(b)))
		w.WriteHeader(http.StatusNoContent)
	}))
	defer rw.Close()
	swarm := func(out string, extra ...string) (int, string) {
		return runKettle(t, append([]string{"swarm", "--target", srv.URL(), "--data-dir", dir,
			"--devices", "20", "--interval", "200ms", "--jitter", "20ms", "--duration", "3s",
			"--sample=false", "--slo-p99", "0", "--max-error-rate", "-1", "--out", out}, extra...)...)
	}
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	if code, out := swarm(a); code != 0 {
		t.Fatalf("baseline run: exit %d\n%s", code, out)
	}
	junit := filepath.Join(dir, "junit.xml")
	code, out := swarm(b, "--baseline", a, "--junit", junit, "--remote-write", rw.URL+"/api/v1/write", "--remote-write-label", "build=test")
	if code != 0 && code != 6 {
		t.Fatalf("exit %d\n%s", code, out)
	}
	for _, want := range []string{"comparison against the baseline", "measurement.p99: ", "comparison: " + filepath.Join(b, "compare.html"), "junit: " + junit, "remote write: "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var cmp struct {
		Figures []struct{ Name, Status string }
		Line    string
	}
	raw, err := os.ReadFile(filepath.Join(b, "compare.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &cmp); err != nil || len(cmp.Figures) < 10 || cmp.Line == "" {
		t.Fatalf("compare.json: %v, %d figures, line %q", err, len(cmp.Figures), cmp.Line)
	}
	if st, err := os.Stat(filepath.Join(b, "compare.html")); err != nil || st.Size() < 5000 {
		t.Errorf("compare.html: %v", err)
	}
	var doc struct {
		Suites []struct {
			Name  string `xml:"name,attr"`
			Cases []struct {
				Name string `xml:"name,attr"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	raw, err = os.ReadFile(junit)
	if err != nil {
		t.Fatal(err)
	}
	if err := xml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	suites := map[string]int{}
	for _, s := range doc.Suites {
		suites[s.Name] = len(s.Cases)
	}
	if suites["slo"] < 3 || suites["audit"] != 2 || suites["comparison"] != len(cmp.Figures) {
		t.Errorf("junit suites %v, %d figures compared", suites, len(cmp.Figures))
	}
	if pushes.Load() == 0 || bytes.Load() < 100 {
		t.Errorf("remote write: %d pushes, %d bytes", pushes.Load(), bytes.Load())
	}

	// kettle report compares the same pair from the files; bad flags are
	// refused before anything is read, naming the flag and the field.
	if code, out := runKettle(t, "report", "--baseline", a, b, "-o", filepath.Join(dir, "r", "report.html")); code != 0 && code != 6 || !strings.Contains(out, "comparison: ") {
		t.Errorf("kettle report --baseline: exit %d\n%s", code, out)
	}
	// Rounds: two runs a side (each run twice: the spread between runs is
	// nil), judged by the spread between runs.
	code, out = runKettle(t, "report", "--baseline", a+","+a, b, "--pool", b, "-o", filepath.Join(dir, "p", "report.html"))
	var pooled struct {
		Method   string
		Baseline struct{ Runs []struct{ Path string } }
	}
	js, _ := os.ReadFile(filepath.Join(dir, "p", "compare.json"))
	if err := json.Unmarshal(js, &pooled); (code != 0 && code != 6) || err != nil || pooled.Method != "runs" || len(pooled.Baseline.Runs) != 2 ||
		!strings.Contains(out, "comparison of 2 runs with 2 baseline runs") {
		t.Errorf("kettle report --baseline A,A B --pool B: exit %d, %v, %+v\n%s", code, err, pooled, out)
	}
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("figures: {measurement.p99: {regress_if_ratio_over: 0.5}}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"report", "--thresholds", bad, b}, "give --baseline too"},
		{[]string{"report", "--baseline", a, "--thresholds", bad, b}, "figures.measurement.p99.regress_if_ratio_over: a ratio bound above 1"},
		{[]string{"report", "--baseline", filepath.Join(dir, "none"), b}, "--baseline: "},
		{[]string{"report", "--baseline", a + "," + filepath.Join(dir, "none"), b}, "--baseline: "},
		{[]string{"report", "--pool", a, b}, "--pool " + a + ": give --baseline too"},
		{[]string{"report", "--remote-write-label", "1x=y", b}, "--remote-write-label"},
		{[]string{"swarm", "--target", srv.URL(), "--remote-write", "127.0.0.1:9090"}, "--remote-write \"127.0.0.1:9090\": want an http://"},
	} {
		if code, out := runKettle(t, c.args...); code != 1 || !strings.Contains(out, c.want) {
			t.Errorf("%v: exit %d, want 1 and %q\n%s", c.args, code, c.want, out)
		}
	}
}
