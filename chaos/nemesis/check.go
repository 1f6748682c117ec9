package nemesis

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/sim"
)

// Check is one judgement of the checker.
type Check struct {
	Name   string `json:"name"`
	Pass   bool   `json:"pass"`
	Detail string `json:"detail"`
	// Skipped: not measured in this run (Detail says why); neither a pass
	// nor a failure, and said so.
	Skipped bool `json:"skipped,omitempty"`
}

// Verdict is the checker's outcome of one run.
type Verdict struct {
	Seed   uint64  `json:"seed"`
	Pass   bool    `json:"pass"`
	Checks []Check `json:"checks"`
	Costs  []Cost  `json:"costs"`
}

// Add appends a check; a failed one fails the verdict.
func (v *Verdict) Add(c Check) {
	v.Checks = append(v.Checks, c)
	if !c.Pass && !c.Skipped {
		v.Pass = false
	}
}

// Lines are the verdict for a terminal, one check a line, the seed on the
// failing ones so that the line alone reproduces the run.
func (v *Verdict) Lines() []string {
	var out []string
	for _, c := range v.Checks {
		mark := "ok  "
		switch {
		case c.Skipped:
			mark = "skip"
		case !c.Pass:
			mark = "FAIL"
		}
		line := fmt.Sprintf("%s %s: %s", mark, c.Name, c.Detail)
		if !c.Pass && !c.Skipped {
			line += fmt.Sprintf(" (seed %d)", v.Seed)
		}
		out = append(out, line)
	}
	for _, c := range v.Costs {
		out = append(out, "cost "+c.Line())
	}
	return out
}

// Audits judges each swarm's audit: every reading acknowledged to a kettle
// stored exactly once. A swarm without an audit fails: a run whose readings
// were never checked is not a clean one.
func Audits(swarms map[string]*sim.Results) []Check {
	var out []Check
	for _, name := range slices.Sorted(maps.Keys(swarms)) {
		r := swarms[name]
		c := Check{Name: "audit " + name}
		switch {
		case r == nil:
			c.Detail = "no results (the swarm did not finish)"
		case r.Audit == nil:
			c.Detail = "no audit: " + r.AuditSkipped
		default:
			a := r.Audit
			c.Pass = a.Lost == 0 && a.Duplicated == 0 && a.Acked > 0
			c.Detail = a.Line()
			if a.Acked == 0 {
				c.Detail += "; nothing was acknowledged"
			}
			if len(a.Examples) > 0 && !c.Pass {
				c.Detail += fmt.Sprintf("; e.g. %v", a.Examples[:min(3, len(a.Examples))])
			}
		}
		out = append(out, c)
	}
	return out
}

// Stats compares the statistics served (GET /v1/statistics) with the same
// six recomputed from the stored rows. Counts must be equal; sums, means
// and deviations equal within floating-point rounding (the store keeps
// compensated running sums, the recompute sums rows).
func Stats(served, recomputed httpapi.StatsJSON) Check {
	c := Check{Name: "statistics served = recomputed from rows"}
	var diffs []string
	cnt := func(name string, s, r int64) {
		if s != r {
			diffs = append(diffs, fmt.Sprintf("%s served %d, rows say %d", name, s, r))
		}
	}
	num := func(name string, s, r float64) {
		if !near(s, r) {
			diffs = append(diffs, fmt.Sprintf("%s served %.10g, rows say %.10g", name, s, r))
		}
	}
	cnt("1. measurement_count", served.MeasurementCount, recomputed.MeasurementCount)
	cnt("2a. devices_registered", served.DevicesRegistered, recomputed.DevicesRegistered)
	cnt("2b. devices_reporting", served.DevicesReporting, recomputed.DevicesReporting)
	num("3. total_battery_charge_mwh", served.TotalChargeMWh, recomputed.TotalChargeMWh)
	num("4. total_water_volume_ml", served.TotalWaterML, recomputed.TotalWaterML)
	num("6. total_potential_energy_c_ml", served.TotalPotentialCmL, recomputed.TotalPotentialCmL)
	hours := func(j httpapi.StatsJSON) map[int]httpapi.HourJSON {
		m := map[int]httpapi.HourJSON{}
		for _, h := range j.ByHour {
			if h.Count > 0 {
				m[h.Hour] = h
			}
		}
		return m
	}
	sh, rh := hours(served), hours(recomputed)
	for h := range 24 {
		s, r := sh[h], rh[h]
		name := fmt.Sprintf("5. hour %02d", h)
		cnt(name+" count", s.Count, r.Count)
		num(name+" water mean", s.Water.Mean, r.Water.Mean)
		num(name+" water stddev", s.Water.Stddev, r.Water.Stddev)
		num(name+" ambient mean", s.Ambient.Mean, r.Ambient.Mean)
		num(name+" ambient stddev", s.Ambient.Stddev, r.Ambient.Stddev)
	}
	c.Pass = len(diffs) == 0
	if c.Pass {
		c.Detail = fmt.Sprintf("%d measurements, %d devices (%d reporting), %d hours of day: all six equal", served.MeasurementCount, served.DevicesRegistered, served.DevicesReporting, len(sh))
	} else {
		c.Detail = strings.Join(diffs[:min(6, len(diffs))], "; ")
		if len(diffs) > 6 {
			c.Detail += fmt.Sprintf("; and %d more", len(diffs)-6)
		}
	}
	return c
}

// near is equality within rounding: 1e-9 relative, or 1e-6 absolute
// near zero.
func near(a, b float64) bool {
	d := math.Abs(a - b)
	return d <= 1e-6 || d <= 1e-9*math.Max(math.Abs(a), math.Abs(b))
}

// Override is one override an operator was answered 200 for, and what the
// kettle's polls said after.
type Override struct {
	Device  string        `json:"device"`
	Flush   float64       `json:"flush_ml_per_s"` // the value set, unique per override
	AckedAt time.Time     `json:"acked_at"`
	Polls   int           `json:"polls"`    // polls until the command carried it (0: never)
	Delay   time.Duration `json:"delay_ns"` // from the ack to that poll's answer
	// PollAfter is the wait the kettle was told (poll_after_s): a kettle
	// on its own schedule polls next that long after the ack at the
	// soonest.
	PollAfter time.Duration `json:"poll_after_ns"`
}

// Overrides judges the overrides: each acknowledged one must reach the
// kettle's next poll, which a kettle on its schedule sends PollAfter after
// the ack at the soonest. One that never arrives, or arrives later than
// that, fails the run. The driver polls every second, faster than any
// kettle: how many its first poll right after the ack did not carry yet
// (a node that did not set it learns it at its next cache refresh) is
// shown, not judged.
func Overrides(os []Override) Check {
	c := Check{Name: "overrides acknowledged → the kettle's next poll"}
	if len(os) == 0 {
		c.Detail = "no override was acknowledged during the run"
		return c
	}
	var never, late, notFirst int
	var worst time.Duration
	for _, o := range os {
		switch {
		case o.Polls == 0:
			never++
		case o.Delay > o.PollAfter:
			late++
		}
		if o.Polls != 1 {
			notFirst++
		}
		worst = max(worst, o.Delay)
	}
	c.Pass = never == 0 && late == 0
	c.Detail = fmt.Sprintf("%d acknowledged: %d by the kettle's next poll, %d later, %d never; worst %.2fs from the ack; "+
		"%d not yet on an immediate poll (1 s after the ack)", len(os), len(os)-never-late, late, never, worst.Seconds(), notFirst)
	return c
}

// Member is one PostgreSQL member's copy of the measurements.
type Member struct {
	Name     string `json:"name"`
	Rows     int64  `json:"rows"`
	Checksum string `json:"checksum"`
	Err      string `json:"err,omitempty"`
}

// Members judges the database members: every one holds the same rows.
func Members(ms []Member) Check {
	c := Check{Name: "every PostgreSQL member holds the same rows"}
	var parts []string
	c.Pass = len(ms) > 0
	for _, m := range ms {
		if m.Err != "" {
			parts = append(parts, fmt.Sprintf("%s: %s", m.Name, m.Err))
			c.Pass = false
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %d rows %s", m.Name, m.Rows, m.Checksum[:min(8, len(m.Checksum))]))
		if m.Rows != ms[0].Rows || m.Checksum != ms[0].Checksum {
			c.Pass = false
		}
	}
	c.Detail = strings.Join(parts, ", ")
	return c
}

// LogAudit is the readings log's side: the stored rows (every acknowledged
// reading among them: the audits) looked up in the Kafka topic.
type LogAudit struct {
	Acked   int64 `json:"stored"`
	Found   int64 `json:"found"`
	Missing int64 `json:"missing"`
}

// Log judges the readings log (nil: the run had no --log).
func Log(l *LogAudit, why string) Check {
	c := Check{Name: "the readings log holds every acknowledged reading"}
	if l == nil {
		c.Skipped, c.Detail = true, why
		return c
	}
	c.Pass = l.Missing == 0 && l.Acked > 0
	c.Detail = fmt.Sprintf("stored rows %d (the audits: every acknowledged reading among them), in the log %d, missing %d", l.Acked, l.Found, l.Missing)
	return c
}

// Faults judges the nemesis itself: every fault injected and healed. A
// fault that could not be injected is not a failure of the system under
// test, but the run did not test it, and says so.
func Faults(iv []Interval) Check {
	c := Check{Name: "faults injected and healed", Pass: true}
	var bad []string
	n := 0
	for _, v := range iv {
		if v.Start.IsZero() {
			continue
		}
		n++
		if v.Err != "" {
			bad = append(bad, v.Name+": "+v.Err)
		}
		if v.End.IsZero() {
			c.Pass = false
			bad = append(bad, v.Name+": not healed")
		}
	}
	if len(bad) > 0 {
		c.Pass = false
	}
	c.Detail = fmt.Sprintf("%d of %d", n-len(bad), n)
	if len(bad) > 0 {
		c.Detail += "; " + strings.Join(bad, "; ")
	}
	return c
}

// Cost is what one fault cost the kettles, from the swarms' per-second
// series over the fault and the Grace after its heal.
type Cost struct {
	Fault    string           `json:"fault"`
	Kind     string           `json:"kind"`
	Start    time.Time        `json:"start"`
	End      time.Time        `json:"end"`
	Requests int64            `json:"requests"`
	Errors   map[string]int64 `json:"errors"` // kind (503, timeout, conn, 401 …) → count
	// NoAckS is the longest run of whole seconds in which no reading was
	// acknowledged to any kettle (per-second resolution).
	NoAckS int `json:"no_ack_s"`
}

// Grace is how long after its heal a fault's cost is still charged to it
// (retries landing, a standby catching up).
const Grace = 10 * time.Second

// Line is the cost for a terminal.
func (c Cost) Line() string {
	var errs []string
	for _, k := range slices.Sorted(maps.Keys(c.Errors)) {
		errs = append(errs, fmt.Sprintf("%s×%d", k, c.Errors[k]))
	}
	e := "no errors"
	if len(errs) > 0 {
		e = strings.Join(errs, " ")
	}
	return fmt.Sprintf("%s (%s, %.0fs): %d requests, %s, longest without an acknowledgement %ds",
		c.Fault, c.Kind, c.End.Sub(c.Start).Seconds(), c.Requests, e, c.NoAckS)
}

// Costs charges each fault with what the kettles saw from its start to
// Grace after its heal, over every swarm.
func Costs(iv []Interval, swarms map[string]*sim.Results) []Cost {
	var out []Cost
	for _, v := range iv {
		if v.Start.IsZero() {
			continue
		}
		end := v.End
		if end.IsZero() {
			end = v.Start
		}
		c := Cost{Fault: v.Name, Kind: v.Kind, Start: v.Start, End: end, Errors: map[string]int64{}}
		from, to := v.Start, end.Add(Grace)
		// acks per wall-clock second over every swarm
		acks := map[int64]int64{}
		var lo, hi int64 = math.MaxInt64, math.MinInt64
		for _, r := range swarms {
			if r == nil {
				continue
			}
			for _, s := range r.Seconds {
				at := r.Start.Add(time.Duration(s.T) * time.Second)
				if !at.Add(time.Second).After(from) || !at.Before(to) {
					continue
				}
				sec := at.Unix()
				acks[sec] += s.Acked
				lo, hi = min(lo, sec), max(hi, sec)
				for _, ep := range s.Endpoints {
					c.Requests += ep.Requests
					for k, n := range ep.Errors {
						c.Errors[k] += n
					}
				}
			}
		}
		run := 0
		for sec := lo; sec <= hi; sec++ {
			if acks[sec] == 0 {
				run++
				c.NoAckS = max(c.NoAckS, run)
			} else {
				run = 0
			}
		}
		out = append(out, c)
	}
	return out
}
