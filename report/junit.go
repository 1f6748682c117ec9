package report

import (
	"encoding/xml"
	"fmt"
	"io"
	"os"

	"github.com/kettlefleet/kettlefleet/sim"
)

// Check is one pass/fail judgement of a run, as a CI system shows it: a
// testcase of the JUnit summary.
type Check struct {
	Suite   string // "slo", "audit", "comparison"
	Name    string
	Failure string // "" when it passed
	Skipped string // why it was not judged ("" when it was)
	Detail  string // what was measured, shown either way
}

// Checks are a run's SLO and audit judgements (kettle swarm's exit status,
// one check each): every endpoint's p99 against sloP99Ms (0: not judged),
// the error rate against maxErrorRate (negative: not judged), the audit,
// the lab's workers.
func Checks(r *sim.Results, sloP99Ms, maxErrorRate float64) []Check {
	var out []Check
	t := r.Totals
	for _, n := range sortedKeys(t.Endpoints) {
		e := t.Endpoints[n]
		c := Check{Suite: "slo", Name: n + " p99", Detail: fmt.Sprintf("p99 %.2f ms over %d requests", e.P99Ms, e.Requests)}
		switch {
		case n == sim.EPMQTTConnect:
			c.Skipped = "connecting is once per kettle, at hatching: reported, not judged"
		case sloP99Ms <= 0:
			c.Skipped = "no SLO given (--slo-p99 0)"
		case e.Requests > 0 && e.P99Ms > sloP99Ms:
			c.Failure = fmt.Sprintf("%s p99 %.1f ms > SLO %g ms", n, e.P99Ms, sloP99Ms)
		}
		if sloP99Ms > 0 {
			c.Name = fmt.Sprintf("%s p99 ≤ %g ms", n, sloP99Ms)
		}
		out = append(out, c)
	}
	er := Check{Suite: "slo", Name: fmt.Sprintf("error rate ≤ %g", maxErrorRate),
		Detail: fmt.Sprintf("%d errors of %d requests (%.5f)%s", t.Errors, t.Requests, t.ErrorRate, kindsStr(t.ErrorsByKind))}
	switch {
	case maxErrorRate < 0:
		er.Name, er.Skipped = "error rate", "no error-rate gate (--max-error-rate negative)"
	case t.ErrorRate > maxErrorRate:
		er.Failure = fmt.Sprintf("error rate %.5f > %g (%d of %d requests)", t.ErrorRate, maxErrorRate, t.Errors, t.Requests)
	}
	out = append(out, er)
	lost := Check{Suite: "audit", Name: "no acknowledged reading lost"}
	dup := Check{Suite: "audit", Name: "no acknowledged reading stored twice"}
	switch a := r.Audit; {
	case a != nil:
		lost.Detail, dup.Detail = a.Line(), a.Line()
		if a.Lost > 0 {
			lost.Failure = fmt.Sprintf("%d acknowledged readings lost, e.g. %v", a.Lost, a.Examples)
		}
		if a.Duplicated > 0 {
			dup.Failure = fmt.Sprintf("%d acknowledged readings stored more than once, e.g. %v", a.Duplicated, a.Examples)
		}
	case r.AuditSkipped != "":
		lost.Failure = "audit skipped: " + r.AuditSkipped
		dup.Skipped = lost.Failure
	default:
		lost.Skipped, dup.Skipped = "audit off (--audit=false)", "audit off (--audit=false)"
	}
	out = append(out, lost, dup)
	if len(r.Workers) > 0 {
		w := Check{Suite: "audit", Name: "every worker finished", Detail: fmt.Sprintf("%d workers", len(r.Workers))}
		if l := r.LostWorkers(); len(l) > 0 {
			w.Failure = fmt.Sprintf("%d of %d workers lost, their share measured only until then and not audited", len(l), len(r.Workers))
		}
		out = append(out, w)
	}
	return out
}

// Checks are the comparison's figures, one check each: a figure fails
// when it regressed and its rule fails the comparison.
func (c *Comparison) Checks() []Check {
	var out []Check
	for _, f := range c.Figures {
		k := Check{Suite: "comparison", Name: f.Name, Detail: f.Text}
		switch {
		case f.Status == NotMeasured:
			k.Skipped = "not measured in both runs"
		case f.Status == Regressed && f.Fail:
			k.Failure = f.Text + " (" + f.Bound + ")"
		}
		out = append(out, k)
	}
	return out
}

// JUnit document types: the schema CI systems read (Jenkins, GitLab,
// GitHub's test reporters): testsuites > testsuite > testcase with an
// optional failure or skipped.
type (
	junitSuites struct {
		XMLName  xml.Name     `xml:"testsuites"`
		Name     string       `xml:"name,attr"`
		Tests    int          `xml:"tests,attr"`
		Failures int          `xml:"failures,attr"`
		Skipped  int          `xml:"skipped,attr"`
		Suites   []junitSuite `xml:"testsuite"`
	}
	junitSuite struct {
		Name     string      `xml:"name,attr"`
		Tests    int         `xml:"tests,attr"`
		Failures int         `xml:"failures,attr"`
		Skipped  int         `xml:"skipped,attr"`
		Cases    []junitCase `xml:"testcase"`
	}
	junitCase struct {
		Name      string        `xml:"name,attr"`
		Classname string        `xml:"classname,attr"`
		Failure   *junitMessage `xml:"failure,omitempty"`
		Skipped   *junitMessage `xml:"skipped,omitempty"`
		SystemOut string        `xml:"system-out,omitempty"`
	}
	junitMessage struct {
		Message string `xml:"message,attr"`
		Text    string `xml:",chardata"`
	}
)

// WriteJUnit writes checks as a JUnit XML summary named name, one
// testsuite per Check.Suite in the order first met.
func WriteJUnit(w io.Writer, name string, checks []Check) error {
	doc := junitSuites{Name: name}
	idx := map[string]int{}
	for _, c := range checks {
		i, ok := idx[c.Suite]
		if !ok {
			i = len(doc.Suites)
			idx[c.Suite] = i
			doc.Suites = append(doc.Suites, junitSuite{Name: c.Suite})
		}
		s := &doc.Suites[i]
		tc := junitCase{Name: c.Name, Classname: "kettle." + c.Suite, SystemOut: c.Detail}
		switch {
		case c.Failure != "":
			tc.Failure = &junitMessage{Message: c.Failure, Text: c.Detail}
			s.Failures++
		case c.Skipped != "":
			tc.Skipped = &junitMessage{Message: c.Skipped}
			s.Skipped++
		}
		s.Tests++
		s.Cases = append(s.Cases, tc)
	}
	for _, s := range doc.Suites {
		doc.Tests += s.Tests
		doc.Failures += s.Failures
		doc.Skipped += s.Skipped
	}
	if _, err := io.WriteString(w, xml.Header); err != nil {
		return err
	}
	enc := xml.NewEncoder(w)
	enc.Indent("", " ")
	if err := enc.Encode(doc); err != nil {
		return err
	}
	_, err := io.WriteString(w, "\n")
	return err
}

// WriteJUnitFile writes the JUnit summary to path.
func WriteJUnitFile(path, name string, checks []Check) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("junit: %w", err)
	}
	if err := WriteJUnit(f, name, checks); err != nil {
		f.Close()
		return fmt.Errorf("junit %s: %w", path, err)
	}
	return f.Close()
}
