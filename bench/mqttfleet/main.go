// Command mqttfleet merges the results.json of the several kettle swarm
// processes of bench/mqtt-fleet.sh over one time window (the hold, after
// every kettle connected) and prints what the fleet saw as one: readings
// acknowledged per second against the expected rate, PUBACK latency
// percentiles (the swarms' HDR histograms merged exactly), errors by kind,
// connections open and lost, and the summed audit.
//
//	mqttfleet -from 1763780000 -to 1763780180 -expect 3333.3 s1/results.json s2/results.json …
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/kettlefleet/kettlefleet/sim"
)

// merged is the fleet over the window, summed from every results file.
type merged struct {
	from, to                                     int64
	acked, readings, dropped, requests, commands int64
	seconds                                      map[int64]bool
	errs                                         map[string]int64
	open, lost, late                             int64
	maxLag                                       float64
	audit                                        sim.Audit
	audits                                       int
	hist                                         *hdrhistogram.Histogram
	// Per 10 s of the hold: where in it the slow PUBACKs were, beside the
	// simulators' own lag then.
	slices   map[int64]*hdrhistogram.Histogram
	sliceLag map[int64]float64
}

func main() {
	from := flag.Int64("from", 0, "window start, unix seconds (the hold began)")
	to := flag.Int64("to", 0, "window end, unix seconds")
	expect := flag.Float64("expect", 0, "expected readings/s (devices / interval)")
	jsonOut := flag.String("json", "", "also write the figures to this file, as bench/results.jsonl figures")
	flag.Parse()
	if flag.NArg() == 0 || *to <= *from {
		fmt.Fprintln(os.Stderr, "usage: mqttfleet -from UNIX -to UNIX [-expect R] results.json…")
		os.Exit(2)
	}
	m := &merged{from: *from, to: *to, seconds: map[int64]bool{}, errs: map[string]int64{},
		hist: sim.NewHistogram(), slices: map[int64]*hdrhistogram.Histogram{}, sliceLag: map[int64]float64{}}
	for _, p := range flag.Args() {
		if err := m.add(p); err != nil {
			fmt.Fprintln(os.Stderr, "mqttfleet:", err)
			os.Exit(1)
		}
	}
	nerr := m.print(*expect, flag.NArg())
	if *jsonOut != "" {
		if err := m.writeJSON(*jsonOut, *expect, nerr); err != nil {
			fmt.Fprintln(os.Stderr, "mqttfleet:", err)
		}
	}
	if m.audits < flag.NArg() || m.audit.Lost > 0 || m.audit.Duplicated > 0 {
		os.Exit(3)
	}
}

// add sums one swarm's results.json over the window. sim's own totals
// (Results.Totals) sum every second of one run; this keeps only the seconds
// all the swarms ran together, and the lag of each 10 s slice.
func (m *merged) add(p string) error {
	r, err := sim.ReadResults(p)
	if err != nil {
		return err
	}
	var lastOpen int64
	for _, s := range r.Seconds {
		// Second T covers [Start+T, Start+T+1).
		at := r.Start.Add(time.Duration(s.T) * time.Second).Unix()
		if at < m.from || at >= m.to {
			continue
		}
		m.seconds[at] = true
		m.acked += s.Acked
		m.readings += s.Readings
		m.dropped += s.Dropped
		m.late += s.LateStarts
		m.commands += s.CommandsReceived
		m.maxLag = max(m.maxLag, s.MaxLagMs)
		k := (at - m.from) / 10
		m.sliceLag[k] = max(m.sliceLag[k], s.MaxLagMs)
		lastOpen = s.OpenConns
		e := s.Endpoints[sim.EPMQTTPublish]
		if e == nil {
			continue
		}
		m.requests += e.Requests
		for k, n := range e.Errors {
			m.errs[k] += n
		}
		if e.Histogram != "" {
			h, err := hdrhistogram.Decode([]byte(e.Histogram))
			if err != nil {
				return fmt.Errorf("%s: histogram: %w", p, err)
			}
			m.hist.Merge(h)
			if m.slices[k] == nil {
				m.slices[k] = sim.NewHistogram()
			}
			m.slices[k].Merge(h)
		}
	}
	m.open += lastOpen
	m.lost += r.Totals.ConnsLost
	if a := r.Audit; a != nil {
		m.audits++
		m.audit.Devices += a.Devices
		m.audit.Acked += a.Acked
		m.audit.Stored += a.Stored
		m.audit.Lost += a.Lost
		m.audit.Duplicated += a.Duplicated
		m.audit.Unacked += a.Unacked
		m.audit.Seconds = max(m.audit.Seconds, a.Seconds)
		m.audit.Examples = append(m.audit.Examples, a.Examples...)
	}
	return nil
}

func (m *merged) ms(q float64) float64 { return float64(m.hist.ValueAtQuantile(q)) / 1000 }

// print writes the fleet's figures and returns the publish errors.
func (m *merged) print(expect float64, files int) int64 {
	win := float64(m.to - m.from)
	fmt.Printf("fleet over the hold (%d s, %d results files, %d seconds with data):\n", m.to-m.from, files, len(m.seconds))
	fmt.Printf("  readings acknowledged %d = %.1f/s (expected %.1f/s: ratio %.3f); generated %.1f/s; dropped from full kettle buffers %d\n",
		m.acked, float64(m.acked)/win, expect, float64(m.acked)/win/max(expect, 1e-9), float64(m.readings)/win, m.dropped)
	fmt.Printf("  PUBACK latency (from the intended send time) over %d publishes: p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.1f ms\n",
		m.hist.TotalCount(), m.ms(50), m.ms(99), m.ms(99.9), float64(m.hist.Max())/1000)
	var ks []string
	var nerr int64
	for k, n := range m.errs {
		ks = append(ks, fmt.Sprintf("%s=%d", k, n))
		nerr += n
	}
	sort.Strings(ks)
	fmt.Printf("  publish errors %d of %d%s; late starts %d; simulator max lag %.1f ms; commands received %d\n",
		nerr, m.requests, strings.Join(append([]string{""}, ks...), " "), m.late, m.maxLag, m.commands)
	fmt.Printf("  swarm connections open at the end of the hold %d; connections lost (whole run) %d\n", m.open, m.lost)
	var ts []int64
	for k := range m.slices {
		ts = append(ts, k)
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
	fmt.Printf("  per 10 s of the hold: PUBACK p99 ms / simulator max lag ms:")
	for _, k := range ts {
		fmt.Printf(" +%d %.0f/%.0f", 10*k, float64(m.slices[k].ValueAtQuantile(99))/1000, m.sliceLag[k])
	}
	fmt.Println()
	if m.audits == 0 {
		fmt.Println("  audit: none ran")
		return nerr
	}
	fmt.Printf("  audit (%d of %d results files): %s\n", m.audits, files, m.audit.Line())
	for i, e := range m.audit.Examples {
		if i == 5 {
			break
		}
		fmt.Printf("    e.g. %s\n", e)
	}
	return nerr
}

// writeJSON writes the figures as bench/results.jsonl figures.
func (m *merged) writeJSON(path string, expect float64, nerr int64) error {
	type fig struct {
		Name  string  `json:"name"`
		Value float64 `json:"value"`
		Unit  string  `json:"unit"`
	}
	win := float64(m.to - m.from)
	figs := []fig{
		{"readings_acked_per_s", float64(m.acked) / win, "readings/s"},
		{"readings_expected_per_s", expect, "readings/s"},
		{"puback_p50", m.ms(50), "ms"},
		{"puback_p99", m.ms(99), "ms"},
		{"puback_p999", m.ms(99.9), "ms"},
		{"publish_errors", float64(nerr), "publishes"},
		{"publishes", float64(m.requests), "publishes"},
		{"audit_acked", float64(m.audit.Acked), "readings"},
		{"audit_lost", float64(m.audit.Lost), "readings"},
		{"audit_duplicated", float64(m.audit.Duplicated), "readings"},
	}
	b, _ := json.Marshal(figs)
	return os.WriteFile(path, b, 0o644)
}
