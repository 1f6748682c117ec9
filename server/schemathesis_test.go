package server_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// schemathesisBudget is the fuzzer's --max-time. It checks the budget
// between test cases, so a loaded machine overruns it: the test kills it
// at schemathesisBudget+40s, under two minutes in all.
const schemathesisBudget = 75 * time.Second

// TestSchemathesis runs the external OpenAPI fuzzer (schemathesis, pinned in
// deploy/deps/schemathesis.sh) against a real kettle serve with every check
// it has, its stateful phase included, a device token for the device
// routes, the operator token for the operator routes and a case-study
// cookie for those, from a fixed seed. Any finding fails; what is excluded
// is in httpapi/schemathesis.toml with its reason.
func TestSchemathesis(t *testing.T) {
	if testing.Short() {
		t.Skip("the fuzzer runs for up to 100 s (make test runs it)")
	}
	st, err := filepath.Abs("../.deps/venv-schemathesis/bin/st")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(st); err != nil {
		t.Fatalf("schemathesis is not installed (%v): run `make deps` (deploy/deps/schemathesis.sh installs it into .deps/venv-schemathesis)", err)
	}
	config, err := filepath.Abs("../httpapi/schemathesis.toml")
	if err != nil {
		t.Fatal(err)
	}
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	dev := uuid.New()
	devTok := kettle.DeviceToken(srv.Secret(), dev)
	if r := c.do("POST", "/v1/measurements", bearer(devTok), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)); r.status != 200 {
		t.Fatalf("the fuzzer's device: %d %s", r.status, r.body)
	}
	cookieID := login(t, c)
	revoke := uuid.New() // the one DELETE /v1/devices/{id} is given (schemathesis.toml)
	if r := c.do("POST", "/v1/measurements", bearer(kettle.DeviceToken(srv.Secret(), revoke)), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)); r.status != 200 {
		t.Fatalf("the device to revoke: %d %s", r.status, r.body)
	}

	ctx, cancel := context.WithTimeout(context.Background(), schemathesisBudget+40*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, st, "--config-file", config, "run", srv.URL()+"/openapi.json",
		"--seed", "42", "--max-time", strconv.Itoa(int(schemathesisBudget/time.Second)), "--workers", "1",
		"--generation-database", "none", "--no-color", "--request-timeout", "15")
	cmd.Dir = t.TempDir() // anything it writes stays out of the tree
	cmd.Env = append(os.Environ(),
		"KETTLE_ST_OPERATOR="+srv.OperatorToken(), "KETTLE_ST_DEVICE="+devTok, "KETTLE_ST_COOKIE="+cookieID, "KETTLE_ST_REVOKE="+revoke.String())
	out, err := cmd.CombinedOutput()
	summary := regexp.MustCompile(`(?m)^\s*(\d+ generated.*|Selected: .*|Tested: .*|[✅❌] .*|=+ .* in [0-9.]+s =+)$`).FindAllString(string(out), -1)
	t.Logf("schemathesis: %s", strings.Join(summary, " | "))
	if _, warnings, ok := strings.Cut(string(out), "WARNINGS ="); ok {
		warnings, _, _ = strings.Cut(warnings, "SUMMARY =")
		t.Logf("schemathesis warnings (not findings):%s", warnings)
	}
	if ctx.Err() != nil {
		t.Fatalf("schemathesis ran past %s:\n%s", schemathesisBudget+40*time.Second, tail(out, 120))
	}
	if err != nil {
		t.Fatalf("schemathesis found something (%v):\n%s", err, tail(out, 200))
	}
	if strings.Contains(string(out), "Authentication failed") {
		t.Fatalf("schemathesis could not authenticate on some operations (a credential was revoked or is wrong):\n%s", tail(out, 60))
	}
	// A phase the tool could not finish (🚫: its own error) tested nothing:
	// every phase must have run and passed.
	for _, phase := range []string{"Examples", "Coverage", "Fuzzing", "Stateful"} {
		if !regexp.MustCompile(`(?m)^\s*✅ ` + phase + `\s*$`).Match(out) {
			t.Fatalf("schemathesis phase %s did not run to a pass:\n%s", phase, tail(out, 80))
		}
	}
	if !strings.Contains(string(out), "Stateful") || !regexp.MustCompile(`Tested: 1[0-9]`).Match(out) {
		t.Fatalf("schemathesis did not run its stateful phase over every operation:\n%s", tail(out, 60))
	}
}

// tail is the last n lines of out.
func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
