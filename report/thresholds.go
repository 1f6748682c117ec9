package report

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Thresholds say which figures of a comparison count and by how much they
// must move to be called regressed or improved. The file is YAML (JSON is
// YAML too):
//
//	confidence: 0.95        # of the bootstrap intervals (default 0.95)
//	resamples: 2000         # bootstrap replicates (default 2000)
//	figures:
//	  measurement.p99: {regress_if_ratio_over: 1.10}
//	  "*.p99.9": {ignore: true}
//	  "*.error_rate": {regress_if_delta_over: 0.0005}
//	  simulator.rss_per_kettle: {fail: false}
//
// A figure's name is SUBJECT.MEASURE (an endpoint, "server" or
// "simulator", then what is measured); a key may use * for any subject or
// measure (path.Match). The most specific key wins: an exact name over a
// pattern, a pattern with fewer *'s over one with more. Rules given in the
// file are laid over the defaults (DefaultRules), field by field.
type Thresholds struct {
	Confidence float64          `yaml:"confidence" json:"confidence"`
	Resamples  int              `yaml:"resamples" json:"resamples"`
	Figures    map[string]*Rule `yaml:"figures" json:"figures"`
}

// Rule judges one figure. A ratio figure (latency, throughput, CPU and
// memory per unit) is B/A; a delta figure (error rate) is B−A.
//
// A ratio figure regressed when its estimate passed the regress bound and
// its whole confidence interval lies on the same side of 1 (of 0 for a
// delta): the change is both larger than what matters and larger than the
// runs' own noise. Improved likewise; otherwise it is within noise.
type Rule struct {
	// Higher is worse (latency, CPU, memory, errors): regressed above
	// RegressIfRatioOver, improved below ImproveIfRatioUnder.
	RegressIfRatioOver  *float64 `yaml:"regress_if_ratio_over,omitempty" json:"regress_if_ratio_over,omitempty"`
	ImproveIfRatioUnder *float64 `yaml:"improve_if_ratio_under,omitempty" json:"improve_if_ratio_under,omitempty"`
	// Lower is worse (throughput).
	RegressIfRatioUnder *float64 `yaml:"regress_if_ratio_under,omitempty" json:"regress_if_ratio_under,omitempty"`
	ImproveIfRatioOver  *float64 `yaml:"improve_if_ratio_over,omitempty" json:"improve_if_ratio_over,omitempty"`
	// Delta figures: regressed when B−A is above RegressIfDeltaOver,
	// improved when below −ImproveIfDeltaOver.
	RegressIfDeltaOver *float64 `yaml:"regress_if_delta_over,omitempty" json:"regress_if_delta_over,omitempty"`
	ImproveIfDeltaOver *float64 `yaml:"improve_if_delta_over,omitempty" json:"improve_if_delta_over,omitempty"`
	// Fail: a regression of this figure fails the comparison (exit code);
	// false reports it only. Ignore leaves the figure out.
	Fail   *bool `yaml:"fail,omitempty" json:"fail,omitempty"`
	Ignore bool  `yaml:"ignore,omitempty" json:"ignore,omitempty"`
}

func f64(v float64) *float64 { return &v }
func bptr(v bool) *bool      { return &v }

// DefaultRules are the thresholds when no file is given (and under one).
// They are wider than a quiet machine needs: on a shared 2-core machine
// two runs of one build move the median and the CPU per request by up to
// a fifth and the tail by half, every figure at once as the neighbours
// come and go (bench/compare.sh's records; docs/operations.md, comparing
// runs).
func DefaultRules() map[string]*Rule {
	return map[string]*Rule{
		"*.p50":                     {RegressIfRatioOver: f64(1.25), ImproveIfRatioUnder: f64(0.80)},
		"*.p99":                     {RegressIfRatioOver: f64(1.50), ImproveIfRatioUnder: f64(0.67)},
		"*.p99.9":                   {RegressIfRatioOver: f64(2.00), ImproveIfRatioUnder: f64(0.50)},
		"*.req_per_s":               {RegressIfRatioUnder: f64(0.95), ImproveIfRatioOver: f64(1.05)},
		"*.error_rate":              {RegressIfDeltaOver: f64(0.001), ImproveIfDeltaOver: f64(0.001)},
		"server.cpu_us_per_request": {RegressIfRatioOver: f64(1.25), ImproveIfRatioUnder: f64(0.80)},
		"server.rss_per_kettle":     {RegressIfRatioOver: f64(1.20), ImproveIfRatioUnder: f64(0.83)},
		// The lab's own cost is reported, not gated: it is not the
		// system under test.
		"simulator.cpu_us_per_request": {RegressIfRatioOver: f64(1.25), ImproveIfRatioUnder: f64(0.80), Fail: bptr(false)},
		"simulator.rss_per_kettle":     {RegressIfRatioOver: f64(1.20), ImproveIfRatioUnder: f64(0.83), Fail: bptr(false)},
		// Connecting is once per kettle, at hatching: reported, not gated
		// (as kettle swarm's --slo-p99 does not judge it).
		"mqtt_connect.*": {Fail: bptr(false)},
		// A verdict also names the machine's neighbours (machine-cpu):
		// shown side by side, gated only when a file says so.
		"run.verdict": {Fail: bptr(false)},
	}
}

// DefaultThresholds are the thresholds of a comparison without a file.
func DefaultThresholds() *Thresholds {
	return &Thresholds{Confidence: 0.95, Resamples: 2000, Figures: DefaultRules()}
}

// ReadThresholds reads a thresholds file and lays it over the defaults.
func ReadThresholds(file string) (*Thresholds, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("thresholds: %w", err)
	}
	t, err := ParseThresholds(b)
	if err != nil {
		return nil, fmt.Errorf("thresholds %s: %w", file, err)
	}
	return t, nil
}

// ParseThresholds parses a thresholds document (strictly: an unknown field
// is an error naming it) and lays it over the defaults.
func ParseThresholds(doc []byte) (*Thresholds, error) {
	var in Thresholds
	dec := yaml.NewDecoder(bytes.NewReader(doc))
	dec.KnownFields(true)
	if err := dec.Decode(&in); err != nil && !errors.Is(err, io.EOF) { // io.EOF: an empty file, the defaults
		return nil, err
	}
	t := DefaultThresholds()
	if in.Confidence != 0 {
		t.Confidence = in.Confidence
	}
	if in.Resamples != 0 {
		t.Resamples = in.Resamples
	}
	for k, r := range in.Figures {
		if r == nil {
			r = &Rule{}
		}
		t.Figures[k] = overlay(t.Figures[k], r)
	}
	if errs := t.Validate(); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return t, nil
}

// overlay lays the fields set in r over base (nil: none).
func overlay(base, r *Rule) *Rule {
	out := Rule{}
	if base != nil {
		out = *base
	}
	set := func(dst **float64, v *float64) {
		if v != nil {
			*dst = v
		}
	}
	set(&out.RegressIfRatioOver, r.RegressIfRatioOver)
	set(&out.ImproveIfRatioUnder, r.ImproveIfRatioUnder)
	set(&out.RegressIfRatioUnder, r.RegressIfRatioUnder)
	set(&out.ImproveIfRatioOver, r.ImproveIfRatioOver)
	set(&out.RegressIfDeltaOver, r.RegressIfDeltaOver)
	set(&out.ImproveIfDeltaOver, r.ImproveIfDeltaOver)
	if r.Fail != nil {
		out.Fail = r.Fail
	}
	out.Ignore = out.Ignore || r.Ignore
	return &out
}

// Validate checks the thresholds, each problem naming its field.
func (t *Thresholds) Validate() []error {
	var errs []error
	if t.Confidence <= 0.5 || t.Confidence >= 1 {
		errs = append(errs, fmt.Errorf("confidence: must be between 0.5 and 1 (e.g. 0.95), got %g", t.Confidence))
	}
	if t.Resamples < 100 || t.Resamples > 100_000 {
		errs = append(errs, fmt.Errorf("resamples: must be 100..100000, got %d", t.Resamples))
	}
	for _, k := range sortedKeys(t.Figures) {
		r := t.Figures[k]
		if _, err := path.Match(k, "x"); err != nil || !strings.Contains(k, ".") {
			errs = append(errs, fmt.Errorf("figures.%s: want SUBJECT.MEASURE, e.g. measurement.p99 or *.p99", k))
		}
		pos := func(name string, v *float64, over1 bool) {
			switch {
			case v == nil:
			case *v <= 0:
				errs = append(errs, fmt.Errorf("figures.%s.%s: must be > 0, got %g", k, name, *v))
			case over1 && *v < 1:
				errs = append(errs, fmt.Errorf("figures.%s.%s: a ratio bound above 1, got %g", k, name, *v))
			case !over1 && *v > 1:
				errs = append(errs, fmt.Errorf("figures.%s.%s: a ratio bound below 1, got %g", k, name, *v))
			}
		}
		pos("regress_if_ratio_over", r.RegressIfRatioOver, true)
		pos("improve_if_ratio_over", r.ImproveIfRatioOver, true)
		pos("regress_if_ratio_under", r.RegressIfRatioUnder, false)
		pos("improve_if_ratio_under", r.ImproveIfRatioUnder, false)
		for name, v := range map[string]*float64{"regress_if_delta_over": r.RegressIfDeltaOver, "improve_if_delta_over": r.ImproveIfDeltaOver} {
			if v != nil && *v < 0 {
				errs = append(errs, fmt.Errorf("figures.%s.%s: must be ≥ 0, got %g", k, name, *v))
			}
		}
		if r.RegressIfRatioOver != nil && r.RegressIfRatioUnder != nil {
			errs = append(errs, fmt.Errorf("figures.%s: regress_if_ratio_over and regress_if_ratio_under both set; a figure is worse one way", k))
		}
	}
	return errs
}

// rule is the rule of a figure: every key that matches it, the least
// specific first, laid over each other (nil when none matches).
func (t *Thresholds) rule(name string) *Rule {
	var keys []string
	for k := range t.Figures {
		if ok, _ := path.Match(k, name); ok {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	stars := func(k string) int { return strings.Count(k, "*") }
	sort.Slice(keys, func(i, j int) bool {
		if stars(keys[i]) != stars(keys[j]) {
			return stars(keys[i]) > stars(keys[j])
		}
		return keys[i] < keys[j]
	})
	var r *Rule
	for _, k := range keys {
		r = overlay(r, t.Figures[k])
	}
	return r
}
