package ha_test

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sim"
)

// logLine is one timestamped line of a member's log.
type logLine struct {
	at   time.Time
	who  string
	text string
}

// The timestamps of the logs: Patroni's "2006-01-02 15:04:05,000",
// PostgreSQL's "2006-01-02 15:04:05.000 UTC" (both UTC here) and kettle
// serve's "time=2006-01-02T15:04:05.000Z".
var (
	patroniTime  = regexp.MustCompile(`^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) `)
	postgresTime = regexp.MustCompile(`^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) UTC `)
	kettleTime   = regexp.MustCompile(`^time=(\S+) `)
)

// noise: lines that come every loop or every request and say nothing
// about a change of roles.
var noise = []string{"no action.", "device cache refresh", "dropping orphan temp table", "Lock owner:", "establishing a new patroni",
	`msg="request failed"`, "terminating connection due to administrator command", "the database system is shutting down",
	"terminating connection due to unexpected postmaster exit"}

// memberLogs returns the lines of the Patroni/PostgreSQL and kettle serve
// logs stamped in [from, to), in time order.
func (tp *topo) memberLogs(from, to time.Time) []logLine {
	var out []logLine
	for _, who := range []string{"pg1", "pg2", "pg3", "kettle1", "kettle2"} {
		b, err := os.ReadFile(filepath.Join(tp.dir, who+".log"))
		if err != nil {
			continue
		}
	lines:
		for _, l := range strings.Split(string(b), "\n") {
			for _, n := range noise {
				if strings.Contains(l, n) {
					continue lines
				}
			}
			var at time.Time
			if m := patroniTime.FindStringSubmatch(l); m != nil {
				at, err = time.Parse("2006-01-02 15:04:05.000", m[1]+"."+m[2])
			} else if m := postgresTime.FindStringSubmatch(l); m != nil {
				at, err = time.Parse("2006-01-02 15:04:05.000", m[1])
			} else if m := kettleTime.FindStringSubmatch(l); m != nil {
				at, err = time.Parse(time.RFC3339Nano, m[1])
			} else {
				continue
			}
			if err != nil || at.Before(from) || !at.Before(to) {
				continue
			}
			out = append(out, logLine{at, who, strings.TrimSpace(l)})
		}
	}
	slices.SortStableFunc(out, func(a, b logLine) int { return a.at.Compare(b.at) })
	return out
}

// timeline logs what the members did in [from, to) beside what the probe
// uploads saw, each line at its offset from from: where an outage's
// seconds go.
func (tp *topo) timeline(t *testing.T, name string, from, to time.Time, uploads []sample) {
	t.Helper()
	ev := tp.memberLogs(from, to)
	// The probe: each change between answered and failed, and slow answers.
	prev := -1
	for _, s := range uploads {
		ok := 0
		if s.status/100 == 2 {
			ok = 1
		}
		lat := s.done.Sub(s.at)
		if ok != prev || lat > 500*time.Millisecond {
			ev = append(ev, logLine{s.at, "probe", fmt.Sprintf("upload sent, answered %d after %.0f ms", s.status, lat.Seconds()*1000)})
		}
		prev = ok
	}
	slices.SortStableFunc(ev, func(a, b logLine) int { return a.at.Compare(b.at) })
	var b strings.Builder
	for i, e := range ev {
		if i == 150 {
			fmt.Fprintf(&b, "… %d more lines\n", len(ev)-i)
			break
		}
		text := e.text
		if len(text) > 220 {
			text = text[:220] + "…"
		}
		fmt.Fprintf(&b, "%+8.3fs %-7s %s\n", e.at.Sub(from).Seconds(), e.who, text)
	}
	t.Logf("%s timeline (from %s):\n%s", name, from.UTC().Format("15:04:05.000"), b.String())
}

// ackGap is the longest time between two answered uploads in ss (sent in
// order, one at a time): how long no reading was acknowledged, whether the
// uploads between failed or waited.
func ackGap(ss []sample) time.Duration {
	var last time.Time
	var gap time.Duration
	for _, s := range ss {
		if s.status/100 != 2 {
			continue
		}
		if !last.IsZero() {
			gap = max(gap, s.done.Sub(last))
		}
		last = s.done
	}
	return gap
}

// slowSeconds logs each second of [from, to) whose polls' p99 was over
// 100 ms, beside that second's uploads and late starts: a kettle's poll
// that came due while its upload was out is sent after it, and its latency
// counts from when it came due.
func slowSeconds(t *testing.T, name string, res *sim.Results, from, to time.Time) {
	t.Helper()
	var b strings.Builder
	n := 0
	for _, s := range res.Seconds {
		at := res.Start.Add(time.Duration(s.T) * time.Second)
		if at.Before(from) || !at.Before(to) {
			continue
		}
		pq, pn := secondP99(s, sim.EPCommand)
		if pq <= 100*time.Millisecond {
			continue
		}
		if n++; n > 40 {
			continue
		}
		uq, un := secondP99(s, sim.EPMeasurement)
		fmt.Fprintf(&b, "%s polls p99 %.0f ms of %d; uploads p99 %.0f ms of %d, errors %v; late starts %d; swarm lag %.0f ms\n",
			at.UTC().Format("15:04:05"), pq.Seconds()*1000, pn, uq.Seconds()*1000, un, uploadErrors(s), s.LateStarts, s.MaxLagMs)
	}
	t.Logf("%s: %d seconds with polls p99 over 100 ms:\n%s", name, n, b.String())
}

func secondP99(s sim.Second, ep string) (time.Duration, int64) {
	e := s.Endpoints[ep]
	if e == nil || e.Histogram == "" {
		return 0, 0
	}
	h, err := hdrhistogram.Decode([]byte(e.Histogram))
	if err != nil {
		return 0, 0
	}
	return time.Duration(h.ValueAtQuantile(99)) * time.Microsecond, h.TotalCount()
}

// logSlowest logs the n slowest of ss with when they were sent.
func logSlowest(t *testing.T, name string, ss []sample, n int) {
	t.Helper()
	ss = slices.Clone(ss)
	slices.SortFunc(ss, func(a, b sample) int { return cmp.Compare(b.done.Sub(b.at), a.done.Sub(a.at)) })
	var parts []string
	for _, s := range ss[:min(n, len(ss))] {
		parts = append(parts, fmt.Sprintf("%s %.0f ms (%d)", s.at.UTC().Format("15:04:05.000"), s.done.Sub(s.at).Seconds()*1000, s.status))
	}
	t.Logf("%s, slowest: %s", name, strings.Join(parts, ", "))
}

func uploadErrors(s sim.Second) map[string]int64 {
	if e := s.Endpoints[sim.EPMeasurement]; e != nil {
		return e.Errors
	}
	return nil
}

// firstLine is when the first line of lines holding text was written (zero: none).
func firstLine(lines []logLine, text string) (time.Time, string) {
	for _, l := range lines {
		if strings.Contains(l.text, text) {
			return l.at, l.who
		}
	}
	return time.Time{}, ""
}
