package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"time"
)

// fuzzTargets are every decoder's fuzz target: case-study JSON, v1 JSON,
// query parameters and request bodies through the real handlers, MQTT
// payloads and raw MQTT packets through the real embedded listener; and the
// v1 decoder's fast paths held to the general ones they stand in for.
var fuzzTargets = []struct{ pkg, name, what string }{
	{"./wire", "FuzzDecodeV0", "case-study POST /measurement JSON (DecodeV0)"},
	{"./wire", "FuzzDecodeV1", "v1 JSON, one reading or a batch (DecodeV1)"},
	{"./httpapi", "FuzzQueryParams", "query parameters and path ids of every GET route, through the handler"},
	{"./httpapi", "FuzzRequestBodies", "every request body (login, v0/v1 readings, provisioning, override), through the handler"},
	{"./mqttapi", "FuzzMQTTPayload", "MQTT 5 / 3.1.1 QoS 1 measurement payloads, through the embedded listener"},
	{"./mqttapi", "FuzzMQTTPacket", "raw bytes after a valid CONNECT, through the embedded listener"},
	{"./wire", "FuzzDecodeV1Fast", "v1 JSON: whatever the fast path takes, the general decoder takes as the same readings"},
	{"./wire", "FuzzParseUTC", "device times: whatever the fast parser takes, time.Parse returns as the identical time"},
	{".", "FuzzValid", "readings: Measurement.Valid says yes exactly when Validate names no field"},
}

var (
	figureRE    = regexp.MustCompile(`figure: (\S+) = (\S+) (\S+)`)
	fuzzStatsRE = regexp.MustCompile(`fuzz: elapsed: (\d+)s, execs: (\d+) .*?(?:new interesting: (\d+))?`)
	testLineRE  = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+)`)
)

// goTest runs `go test args…` in the module root, bounded by limit.
func goTest(ctx context.Context, e *env, limit time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", append([]string{"test"}, args...)...)
	cmd.Dir = e.root
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	e.logf("go test %s", strings.Join(args, " "))
	err := cmd.Run()
	fmt.Fprintf(e.log, "%s\n", buf.String())
	return buf.String(), err
}

// longTest runs one test of pkg in its long form (KETTLE_HA_LONG=1), bounded
// by limit, and copies into r the figures it logs, then the lines keep
// picks (nil: none); a failed test fails r.
func longTest(ctx context.Context, e *env, r *Result, pkg, test string, limit time.Duration, keep func(line string) bool) {
	os.Setenv("KETTLE_HA_LONG", "1")
	defer os.Unsetenv("KETTLE_HA_LONG")
	out, err := goTest(ctx, e, limit, "-count=1", "-v", "-timeout", (limit - time.Minute).String(), "-run", "^"+test+"$", pkg)
	var figures, lines []string
	for _, line := range strings.Split(out, "\n") {
		if m := figureRE.FindStringSubmatch(line); m != nil {
			figures = append(figures, fmt.Sprintf("%s: %s %s", m[1], m[2], m[3]))
		} else if l := strings.TrimSpace(line); keep != nil && keep(l) {
			lines = append(lines, l)
		}
	}
	r.Measured = append(r.Measured, figures...)
	r.Measured = append(r.Measured, lines...)
	if err != nil {
		r.fail("go test %s -run %s: %v %s", pkg, test, err, failureExcerpt(out))
	}
}

func partBadInput(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: fmt.Sprintf("`go test -run '^$' -fuzz '^FuzzX$' -fuzztime %s ./pkg` for each of %d fuzz targets (seed corpora committed in testdata/fuzz and in the targets; "+
		"they also run as plain tests in make test), then the hostile-input tables TestBadInput and TestHostileInput (server/), which send each input over HTTP to a real kettle serve "+
		"and check its 4xx status and the field or message named.", e.fuzztime, len(fuzzTargets))}
	fails := 0
	for _, f := range fuzzTargets {
		out, err := goTest(ctx, e, e.fuzztime+15*time.Minute, "-run", "^$", "-fuzz", "^"+f.name+"$", "-fuzztime", e.fuzztime.String(), "-parallel", "2", f.pkg)
		execs, interesting := "?", "?"
		if m := fuzzStatsRE.FindAllStringSubmatch(out, -1); len(m) > 0 {
			last := m[len(m)-1]
			execs = last[2]
		}
		if m := regexp.MustCompile(`new interesting: (\d+)`).FindAllStringSubmatch(out, -1); len(m) > 0 {
			interesting = m[len(m)-1][1]
		}
		row := Row{Check: f.name + " (" + f.pkg + "): " + f.what}
		if err != nil {
			fails++
			row.Outcome = "FAIL"
			row.Detail = fmt.Sprintf("%v: %s", err, failureExcerpt(out))
			r.fail("%s: %s", f.name, row.Detail)
		} else {
			row.Outcome = "PASS"
			row.Detail = fmt.Sprintf("%s execs in %s, %s new interesting inputs, no failure", execs, e.fuzztime, interesting)
		}
		r.Rows = append(r.Rows, row)
		r.measure("%s: %s", f.name, row.Detail)
		if ctx.Err() != nil {
			return r.fail("interrupted")
		}
	}
	for _, row := range mqttHostileRows(ctx, e) {
		r.Rows = append(r.Rows, row)
		r.measure("%s: %s — %s", row.Check, row.Outcome, row.Detail)
		if row.Outcome != "PASS" {
			r.fail("%s: %s", row.Check, row.Detail)
		}
	}
	out, err := goTest(ctx, e, 10*time.Minute, "-count=1", "-v", "-run", "^(TestBadInput|TestHostileInput)$", "./server")
	rows := testRows(out, "TestBadInput", "TestHostileInput")
	r.Rows = append(r.Rows, rows...)
	pass, fail := 0, 0
	for _, row := range rows {
		if row.Outcome == "PASS" {
			pass++
		} else if row.Outcome == "FAIL" {
			fail++
		}
	}
	r.measure("hostile-input tables: %d cases passed, %d failed", pass, fail)
	if err != nil || fail > 0 || pass == 0 {
		r.fail("hostile-input tables: %v %s", err, failureExcerpt(out))
	}
	if r.Pass {
		r.Verdict = fmt.Sprintf("%d fuzz targets × %s without a failure; %d hostile inputs each got their 4xx, never a 500", len(fuzzTargets), e.fuzztime, pass)
	}
	return r
}

func partAuth(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "go test of the auth tables against real servers: TestAuth and TestAuthChaos* (server/: HTTP v0 and v1, and MQTT on the embedded listener of the same kettle serve), " +
		"TestConnectRefused and TestACL (mqttapi/: every CONNACK refusal, publish and subscribe ACL on MQTT 3.1.1 and 5). TestAuthChaosRevocation deletes a device " +
		"(DELETE /v1/devices/{id}) and checks its token is refused over HTTP, its MQTT connect refused and its open MQTT session no longer acknowledged (it reports NOT IMPLEMENTED while the route is absent). " +
		"TestCredentialRotation (server/): with --operator-token-previous and --secret-previous the old operator token and device tokens are accepted beside the new (HTTP, MQTT, dashboard sign-in), a third is refused, each use counted."}
	out, err := goTest(ctx, e, 10*time.Minute, "-count=1", "-v", "-run", "^(TestAuth|TestAuthChaos.*|TestConnectRefused|TestACL|TestCredentialRotation)$", "./server", "./mqttapi")
	rows := testRows(out, "TestAuth", "TestAuthChaos", "TestConnectRefused", "TestACL", "TestCredentialRotation")
	r.Rows = rows
	pass, fail, ni := 0, 0, 0
	for _, row := range rows {
		switch row.Outcome {
		case "PASS":
			pass++
		case "FAIL":
			fail++
		case "NOT IMPLEMENTED":
			ni++
			r.measure("not implemented: %s — %s", row.Check, row.Detail)
		}
	}
	r.measure("%d auth checks passed, %d failed, %d not implemented", pass, fail, ni)
	if err != nil || fail > 0 || pass == 0 {
		r.fail("auth tests: %v %s", err, failureExcerpt(out))
	}
	if r.Pass {
		r.Verdict = fmt.Sprintf("%d checks: no cross-device read/write over HTTP or MQTT, device tokens refused on operator endpoints, retiring credentials accepted and counted", pass)
		if ni > 0 {
			r.Verdict += fmt.Sprintf("; %d not implemented (device revocation)", ni)
		}
	}
	return r
}

// testRows turns `go test -v` output into rows: one per test and subtest
// whose name starts with one of prefixes, with the test's log lines (-v
// streams them under "=== RUN name" / "=== NAME name" before the verdict
// line). A SKIP whose message says "not implemented" is reported as such.
func testRows(out string, prefixes ...string) []Row {
	var rows []Row
	logs := map[string][]string{}
	current := ""
	for _, l := range strings.Split(out, "\n") {
		t := strings.TrimSpace(l)
		if f := strings.Fields(t); len(f) == 3 && (f[0] == "===") && (f[1] == "RUN" || f[1] == "NAME" || f[1] == "CONT" || f[1] == "PAUSE") {
			current = f[2]
			continue
		}
		if strings.Contains(t, "_test.go:") && current != "" {
			logs[current] = append(logs[current], t)
			continue
		}
		m := testLineRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		name := m[2]
		match := false
		for _, p := range prefixes {
			if strings.HasPrefix(name, p) {
				match = true
			}
		}
		if !match {
			continue
		}
		row := Row{Check: name, Outcome: m[1], Detail: strings.Join(logs[name], " ")}
		if row.Outcome == "SKIP" && strings.Contains(strings.ToLower(row.Detail), "not implemented") {
			row.Outcome = "NOT IMPLEMENTED"
		}
		rows = append(rows, row)
	}
	return rows
}

func failureExcerpt(out string) string {
	var keep []string
	for _, l := range strings.Split(out, "\n") {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "--- FAIL") || strings.Contains(t, "_test.go:") || strings.HasPrefix(t, "Failing input") || strings.Contains(t, "go test -run=") || strings.HasPrefix(t, "panic:") {
			keep = append(keep, t)
		}
		if len(keep) >= 8 {
			break
		}
	}
	return strings.Join(keep, " | ")
}
