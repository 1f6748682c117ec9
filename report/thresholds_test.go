package report

import (
	"strings"
	"testing"
)

func TestParseThresholds(t *testing.T) {
	// f parses doc; wantErr is a piece of the error ("" for none); check
	// then looks at the parsed thresholds.
	f := func(doc, wantErr string, check func(*Thresholds)) {
		t.Helper()
		th, err := ParseThresholds([]byte(doc))
		switch {
		case wantErr == "" && err != nil:
			t.Errorf("%q: %v", doc, err)
		case wantErr != "" && (err == nil || !strings.Contains(err.Error(), wantErr)):
			t.Errorf("%q: error %v, want %q", doc, err, wantErr)
		case err == nil && check != nil:
			check(th)
		}
	}
	ratio := func(name string, want float64) func(*Thresholds) {
		return func(th *Thresholds) {
			t.Helper()
			r := th.rule(name)
			if r == nil || r.RegressIfRatioOver == nil || *r.RegressIfRatioOver != want {
				t.Errorf("%s: rule %+v, want regress_if_ratio_over %g", name, r, want)
			}
		}
	}
	f(``, "", ratio("measurement.p99", 1.5)) // empty: the defaults
	f(`figures: {measurement.p99: {regress_if_ratio_over: 1.05}}`, "", ratio("measurement.p99", 1.05))
	f(`{"figures": {"measurement.p99": {"regress_if_ratio_over": 1.05}}}`, "", ratio("measurement.p99", 1.05)) // JSON
	f("figures:\n  \"*.p99\": {regress_if_ratio_over: 1.5}\n", "", ratio("command.p99", 1.5))
	// The exact name over the pattern, whatever the order.
	f("figures:\n  measurement.p99: {regress_if_ratio_over: 1.05}\n  \"*.p99\": {regress_if_ratio_over: 1.5}\n", "", func(th *Thresholds) {
		ratio("measurement.p99", 1.05)(th)
		ratio("command.p99", 1.5)(th)
	})
	// A rule laid over the default keeps the default's other fields.
	f(`figures: {measurement.p99: {fail: false}}`, "", func(th *Thresholds) {
		r := th.rule("measurement.p99")
		if r.Fail == nil || *r.Fail || r.RegressIfRatioOver == nil || *r.RegressIfRatioOver != 1.5 {
			t.Errorf("%+v", r)
		}
	})
	f(`figures: {"*.p99.9": {ignore: true}}`, "", func(th *Thresholds) {
		if r := th.rule("measurement.p99.9"); r == nil || !r.Ignore {
			t.Errorf("%+v", r)
		}
		if r := th.rule("measurement.p99"); r.Ignore {
			t.Error("*.p99.9 matched measurement.p99")
		}
	})
	f(`confidence: 0.99`, "", func(th *Thresholds) {
		if th.Confidence != 0.99 || th.Resamples != 2000 {
			t.Errorf("%+v", th)
		}
	})
	// Bad input names its field.
	f(`figures: {measurement.p99: {regress_if_ratio_ovr: 1.1}}`, "regress_if_ratio_ovr", nil)
	f(`figures: {measurement.p99: {regress_if_ratio_over: 0.9}}`, "figures.measurement.p99.regress_if_ratio_over: a ratio bound above 1", nil)
	f(`figures: {measurement.req_per_s: {regress_if_ratio_under: 1.2}}`, "figures.measurement.req_per_s.regress_if_ratio_under", nil)
	f(`figures: {p99: {regress_if_ratio_over: 1.1}}`, "figures.p99: want SUBJECT.MEASURE", nil)
	f(`figures: {"[.p99": {regress_if_ratio_over: 1.1}}`, "figures.[.p99", nil)
	f(`confidence: 95`, "confidence: must be between 0.5 and 1", nil)
	f(`resamples: 10`, "resamples: must be 100..100000", nil)
	f(`figures: {measurement.error_rate: {regress_if_delta_over: -1}}`, "regress_if_delta_over: must be ≥ 0", nil)
	f(`figures: [1, 2]`, "cannot unmarshal", nil)
}

// TestRuleJudges: a rule's bounds against estimates and intervals, both
// directions and the delta kind.
func TestRuleJudges(t *testing.T) {
	d := DefaultThresholds()
	f := func(name, kind string, est, lo, hi float64, want string) {
		t.Helper()
		if got, _ := judgeFigure(kind, est, lo, hi, d.rule(name)); got != want {
			t.Errorf("%s %g [%g, %g]: %s, want %s", name, est, lo, hi, got, want)
		}
	}
	f("measurement.p99", "ratio", 1.60, 1.10, 2.00, Regressed)
	f("measurement.p99", "ratio", 1.60, 0.95, 2.70, WithinNoise) // beyond the bound, not beyond the noise
	f("measurement.p99", "ratio", 1.40, 1.35, 1.45, WithinNoise) // beyond the noise, within the bound
	f("measurement.p99", "ratio", 0.60, 0.50, 0.70, Improved)
	f("measurement.req_per_s", "ratio", 0.90, 0.85, 0.95, Regressed)
	f("measurement.req_per_s", "ratio", 1.10, 1.06, 1.14, Improved)
	f("measurement.error_rate", "delta", 0.002, 0.001, 0.003, Regressed)
	f("measurement.error_rate", "delta", 0.002, -0.001, 0.005, WithinNoise)
	f("measurement.error_rate", "delta", 0, 0, 0, WithinNoise)
	f("server.rss_per_kettle", "ratio", 1.5, 1.4, 1.6, Regressed)
	f("measurement.p99", "ratio", nanf(), nanf(), nanf(), NotMeasured)
}

func nanf() float64 { return float64(nan) }
