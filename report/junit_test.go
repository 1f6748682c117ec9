package report

import (
	"bytes"
	"encoding/xml"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/sim"
)

// TestJUnitParsesBack: the JUnit summary of a run and a comparison parses
// back as the schema CI systems read, with one testcase per check, the
// failures' messages and the totals consistent.
func TestJUnitParsesBack(t *testing.T) {
	r := loadRecorded(t)
	r.Audit = &sim.Audit{Acked: 100, Stored: 99, Lost: 1, Examples: []string{"k-1 2026-01-01T00:00:00Z"}}
	checks := Checks(r, 1, 0.001) // a 1 ms SLO: the recorded run breaks it
	slow := base
	slow.addMs = 5
	c, err := Compare(base.run(t, 1), slow.run(t, 2), fastThresholds(), CompareOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checks = append(checks, c.Checks()...)
	var buf bytes.Buffer
	if err := WriteJUnit(&buf, "kettle swarm", checks); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		XMLName  xml.Name `xml:"testsuites"`
		Tests    int      `xml:"tests,attr"`
		Failures int      `xml:"failures,attr"`
		Suites   []struct {
			Name     string `xml:"name,attr"`
			Tests    int    `xml:"tests,attr"`
			Failures int    `xml:"failures,attr"`
			Skipped  int    `xml:"skipped,attr"`
			Cases    []struct {
				Name      string `xml:"name,attr"`
				Classname string `xml:"classname,attr"`
				Failure   *struct {
					Message string `xml:"message,attr"`
				} `xml:"failure"`
				Skipped *struct {
					Message string `xml:"message,attr"`
				} `xml:"skipped"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatalf("%v\n%s", err, buf.String())
	}
	failed := map[string]string{}
	var tests, failures int
	for _, s := range doc.Suites {
		var f, sk int
		for _, tc := range s.Cases {
			if tc.Failure != nil {
				f++
				failed[s.Name+"/"+tc.Name] = tc.Failure.Message
			}
			if tc.Skipped != nil {
				sk++
			}
			if tc.Classname != "kettle."+s.Name {
				t.Errorf("%s: classname %q", tc.Name, tc.Classname)
			}
		}
		if f != s.Failures || sk != s.Skipped || len(s.Cases) != s.Tests {
			t.Errorf("suite %s: attributes %d tests %d failures %d skipped, cases say %d, %d, %d", s.Name, s.Tests, s.Failures, s.Skipped, len(s.Cases), f, sk)
		}
		tests += s.Tests
		failures += s.Failures
	}
	if tests != len(checks) || doc.Tests != tests || doc.Failures != failures {
		t.Errorf("%d checks, %d testcases (%d in the root), %d failures (%d in the root)", len(checks), tests, doc.Tests, failures, doc.Failures)
	}
	for name, want := range map[string]string{
		"slo/measurement p99 ≤ 1 ms":         "measurement p99",
		"audit/no acknowledged reading lost": "1 acknowledged readings lost",
		"comparison/measurement.p50":         "regressed",
	} {
		if !strings.Contains(failed[name], want) {
			t.Errorf("%s: failure %q, want it to say %q (failures: %v)", name, failed[name], want, failed)
		}
	}
	if _, ok := failed["audit/no acknowledged reading stored twice"]; ok {
		t.Error("a clean duplicate check failed")
	}
}
