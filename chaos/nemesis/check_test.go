package nemesis

import (
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/sim"
)

func TestAudits(t *testing.T) {
	f := func(r *sim.Results, pass bool, want string) {
		t.Helper()
		c := Audits(map[string]*sim.Results{"v1": r})[0]
		if c.Pass != pass || !strings.Contains(c.Detail, want) {
			t.Errorf("Audits = %+v; want pass %v and %q", c, pass, want)
		}
	}
	f(&sim.Results{Audit: &sim.Audit{Acked: 10, Stored: 10}}, true, "")
	f(&sim.Results{Audit: &sim.Audit{Acked: 10, Stored: 9, Lost: 1, Examples: []string{"dev 5"}}}, false, "e.g. [dev 5]")
	f(&sim.Results{Audit: &sim.Audit{Acked: 10, Stored: 11, Duplicated: 1}}, false, "")
	f(&sim.Results{Audit: &sim.Audit{}}, false, "nothing was acknowledged")
	f(&sim.Results{AuditSkipped: "the store did not answer"}, false, "no audit: the store did not answer")
	f(nil, false, "did not finish")
}

func TestStats(t *testing.T) {
	base := func() httpapi.StatsJSON {
		s := httpapi.StatsJSON{MeasurementCount: 1000, DevicesRegistered: 10, DevicesReporting: 10, TotalChargeMWh: 5000.25, TotalWaterML: 7000, TotalPotentialCmL: 280000.5,
			ByHour: make([]httpapi.HourJSON, 24)}
		for h := range s.ByHour {
			s.ByHour[h].Hour = h
		}
		s.ByHour[13] = httpapi.HourJSON{Hour: 13, Count: 1000, Water: httpapi.MeanJSON{Mean: 61.5, Stddev: 3.25}, Ambient: httpapi.MeanJSON{Mean: 20, Stddev: 1}}
		return s
	}
	f := func(change func(*httpapi.StatsJSON), pass bool, want string) {
		t.Helper()
		r := base()
		change(&r)
		c := Stats(base(), r)
		if c.Pass != pass || !strings.Contains(c.Detail, want) {
			t.Errorf("Stats = %+v; want pass %v and %q", c, pass, want)
		}
	}
	f(func(*httpapi.StatsJSON) {}, true, "all six equal")
	f(func(s *httpapi.StatsJSON) { s.TotalChargeMWh += 1e-7 }, true, "") // rounding
	f(func(s *httpapi.StatsJSON) { s.MeasurementCount++ }, false, "1. measurement_count served 1000, rows say 1001")
	f(func(s *httpapi.StatsJSON) { s.DevicesReporting-- }, false, "2b.")
	f(func(s *httpapi.StatsJSON) { s.TotalWaterML += 1 }, false, "4. total_water_volume_ml")
	f(func(s *httpapi.StatsJSON) { s.TotalPotentialCmL *= 1.001 }, false, "6. total_potential")
	f(func(s *httpapi.StatsJSON) { s.ByHour[13].Water.Stddev = 3.5 }, false, "5. hour 13 water stddev")
	f(func(s *httpapi.StatsJSON) { s.ByHour[14] = httpapi.HourJSON{Hour: 14, Count: 1} }, false, "5. hour 14 count served 0, rows say 1")
}

func TestOverridesMembersLogFaults(t *testing.T) {
	at := time.Unix(1000, 0)
	pa := 30 * time.Second
	if c := Overrides([]Override{{Polls: 1, Delay: time.Second, PollAfter: pa}, {Polls: 3, Delay: 4 * time.Second, PollAfter: pa}}); !c.Pass ||
		c.Detail != "2 acknowledged: 2 by the kettle's next poll, 0 later, 0 never; worst 4.00s from the ack; 1 not yet on an immediate poll (1 s after the ack)" {
		t.Errorf("Overrides = %+v", c)
	}
	if c := Overrides([]Override{{Polls: 1, Delay: time.Second, PollAfter: pa}, {Polls: 31, Delay: 31 * time.Second, PollAfter: pa}}); c.Pass || !strings.Contains(c.Detail, "1 later") {
		t.Errorf("an override that missed the kettle's next poll passed: %+v", c)
	}
	if c := Overrides([]Override{{Polls: 1}, {Polls: 0, AckedAt: at}}); c.Pass {
		t.Errorf("an override that never reached its kettle passed: %+v", c)
	}
	if c := Overrides(nil); c.Pass {
		t.Errorf("no override driven passed: %+v", c)
	}
	same := []Member{{Name: "pg1", Rows: 5, Checksum: "abcdef0123"}, {Name: "pg2", Rows: 5, Checksum: "abcdef0123"}, {Name: "pg3", Rows: 5, Checksum: "abcdef0123"}}
	if c := Members(same); !c.Pass || c.Detail != "pg1 5 rows abcdef01, pg2 5 rows abcdef01, pg3 5 rows abcdef01" {
		t.Errorf("Members = %+v", c)
	}
	diff := append(same[:2:2], Member{Name: "pg3", Rows: 5, Checksum: "ffff"})
	if c := Members(diff); c.Pass {
		t.Errorf("members that differ passed: %+v", c)
	}
	if c := Members(append(same[:2:2], Member{Name: "pg3", Err: "connection refused"})); c.Pass {
		t.Errorf("a member that did not answer passed: %+v", c)
	}
	if c := Log(nil, "no --log"); !c.Skipped || c.Detail != "no --log" {
		t.Errorf("Log(nil) = %+v", c)
	}
	if c := Log(&LogAudit{Acked: 3, Found: 2, Missing: 1}, ""); c.Pass {
		t.Errorf("a reading missing from the log passed: %+v", c)
	}
	iv := []Interval{{Name: "a", Start: at, End: at.Add(time.Second)}, {Name: "b", Start: at, End: at, Err: "inject pause pg1: unknown verb"}, {Name: "later"}}
	if c := Faults(iv); c.Pass || !strings.Contains(c.Detail, "1 of 2; b: inject pause pg1: unknown verb") {
		t.Errorf("Faults = %+v", c)
	}
	v := Verdict{Seed: 77, Pass: true}
	v.Add(Log(nil, "no --log"))
	v.Add(Overrides([]Override{{Polls: 0}}))
	if v.Pass || !strings.HasSuffix(v.Lines()[1], "(seed 77)") || !strings.HasPrefix(v.Lines()[0], "skip") {
		t.Errorf("verdict: %v %q", v.Pass, v.Lines())
	}
}

func TestCosts(t *testing.T) {
	start := time.Unix(1_000_000, 0)
	sec := func(t int, acked int64, errs map[string]int64) sim.Second {
		return sim.Second{T: t, Acked: acked, Endpoints: map[string]*sim.EndpointSecond{"measurement": {Requests: 10, Errors: errs}}}
	}
	var ss []sim.Second
	for i := range 60 {
		switch {
		case i >= 20 && i < 27: // 7 s without an ack, 503s
			ss = append(ss, sec(i, 0, map[string]int64{"503": 4}))
		case i == 30:
			ss = append(ss, sec(i, 0, map[string]int64{"timeout": 1}))
		default:
			ss = append(ss, sec(i, 10, nil))
		}
	}
	r := &sim.Results{Start: start, Seconds: ss}
	iv := []Interval{{Kind: Kill, Name: "kill -9 pg1", Start: start.Add(18 * time.Second), End: start.Add(25 * time.Second)},
		{Kind: Pause, Name: "quiet", Start: start.Add(45 * time.Second), End: start.Add(48 * time.Second)}}
	cs := Costs(iv, map[string]*sim.Results{"v1": r})
	if len(cs) != 2 {
		t.Fatalf("costs: %+v", cs)
	}
	if c := cs[0]; c.NoAckS != 7 || c.Errors["503"] != 28 || c.Errors["timeout"] != 1 || c.Requests != 170 {
		t.Errorf("cost of the kill: %s", c.Line())
	}
	if c := cs[1]; c.NoAckS != 0 || len(c.Errors) != 0 {
		t.Errorf("cost of a fault nobody noticed: %s", c.Line())
	}
	if l := cs[0].Line(); l != "kill -9 pg1 (kill, 7s): 170 requests, 503×28 timeout×1, longest without an acknowledgement 7s" {
		t.Errorf("line: %s", l)
	}
}
