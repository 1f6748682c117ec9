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
	var (
		acked, readings, dropped, requests, commands int64
		seconds                                      = map[int64]bool{}
		errs                                         = map[string]int64{}
		open                                         int64
		lost, late                                   int64
		maxLag                                       float64
		audit                                        sim.Audit
		audits                                       int
		hist                                         = sim.NewHistogram()
		// Per 10 s of the hold: where in it the slow PUBACKs were, beside
		// the simulators' own lag then.
		slices   = map[int64]*hdrhistogram.Histogram{}
		sliceLag = map[int64]float64{}
	)
	for _, p := range flag.Args() {
		r, err := sim.ReadResults(p)
		if err != nil {
			fmt.Fprintln(os.Stderr, "mqttfleet:", err)
			os.Exit(1)
		}
		var lastOpen int64
		for _, s := range r.Seconds {
			// Second T covers [Start+T, Start+T+1).
			at := r.Start.Add(time.Duration(s.T) * time.Second).Unix()
			if at < *from || at >= *to {
				continue
			}
			seconds[at] = true
			acked += s.Acked
			readings += s.Readings
			dropped += s.Dropped
			late += s.LateStarts
			commands += s.CommandsReceived
			maxLag = max(maxLag, s.MaxLagMs)
			k := (at - *from) / 10
			sliceLag[k] = max(sliceLag[k], s.MaxLagMs)
			lastOpen = s.OpenConns
			e := s.Endpoints[sim.EPMQTTPublish]
			if e == nil {
				continue
			}
			requests += e.Requests
			for k, n := range e.Errors {
				errs[k] += n
			}
			if e.Histogram != "" {
				h, err := hdrhistogram.Decode([]byte(e.Histogram))
				if err != nil {
					fmt.Fprintf(os.Stderr, "mqttfleet: %s: histogram: %v\n", p, err)
					os.Exit(1)
				}
				hist.Merge(h)
				if slices[k] == nil {
					slices[k] = sim.NewHistogram()
				}
				slices[k].Merge(h)
			}
		}
		open += lastOpen
		lost += r.Totals.ConnsLost
		if a := r.Audit; a != nil {
			audits++
			audit.Devices += a.Devices
			audit.Acked += a.Acked
			audit.Stored += a.Stored
			audit.Lost += a.Lost
			audit.Duplicated += a.Duplicated
			audit.Unacked += a.Unacked
			audit.Seconds = max(audit.Seconds, a.Seconds)
			audit.Examples = append(audit.Examples, a.Examples...)
		}
	}
	win := float64(*to - *from)
	ms := func(q float64) float64 { return float64(hist.ValueAtQuantile(q)) / 1000 }
	fmt.Printf("fleet over the hold (%d s, %d results files, %d seconds with data):\n", *to-*from, flag.NArg(), len(seconds))
	fmt.Printf("  readings acknowledged %d = %.1f/s (expected %.1f/s: ratio %.3f); generated %.1f/s; dropped from full kettle buffers %d\n",
		acked, float64(acked)/win, *expect, float64(acked)/win/max(*expect, 1e-9), float64(readings)/win, dropped)
	fmt.Printf("  PUBACK latency (from the intended send time) over %d publishes: p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.1f ms\n",
		hist.TotalCount(), ms(50), ms(99), ms(99.9), float64(hist.Max())/1000)
	var ks []string
	var nerr int64
	for k, n := range errs {
		ks = append(ks, fmt.Sprintf("%s=%d", k, n))
		nerr += n
	}
	sort.Strings(ks)
	fmt.Printf("  publish errors %d of %d%s; late starts %d; simulator max lag %.1f ms; commands received %d\n",
		nerr, requests, strings.Join(append([]string{""}, ks...), " "), late, maxLag, commands)
	fmt.Printf("  swarm connections open at the end of the hold %d; connections lost (whole run) %d\n", open, lost)
	var ts []int64
	for k := range slices {
		ts = append(ts, k)
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
	fmt.Printf("  per 10 s of the hold: PUBACK p99 ms / simulator max lag ms:")
	for _, k := range ts {
		fmt.Printf(" +%d %.0f/%.0f", 10*k, float64(slices[k].ValueAtQuantile(99))/1000, sliceLag[k])
	}
	fmt.Println()
	if audits > 0 {
		fmt.Printf("  audit (%d of %d results files): %s\n", audits, flag.NArg(), audit.Line())
		for i, e := range audit.Examples {
			if i == 5 {
				break
			}
			fmt.Printf("    e.g. %s\n", e)
		}
	} else {
		fmt.Println("  audit: none ran")
	}
	if *jsonOut != "" {
		type fig struct {
			Name  string  `json:"name"`
			Value float64 `json:"value"`
			Unit  string  `json:"unit"`
		}
		figs := []fig{
			{"readings_acked_per_s", float64(acked) / win, "readings/s"},
			{"readings_expected_per_s", *expect, "readings/s"},
			{"puback_p50", ms(50), "ms"},
			{"puback_p99", ms(99), "ms"},
			{"puback_p999", ms(99.9), "ms"},
			{"publish_errors", float64(nerr), "publishes"},
			{"publishes", float64(requests), "publishes"},
			{"audit_acked", float64(audit.Acked), "readings"},
			{"audit_lost", float64(audit.Lost), "readings"},
			{"audit_duplicated", float64(audit.Duplicated), "readings"},
		}
		b, _ := json.Marshal(figs)
		if err := os.WriteFile(*jsonOut, b, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "mqttfleet:", err)
		}
	}
	if audits < flag.NArg() || audit.Lost > 0 || audit.Duplicated > 0 {
		os.Exit(3)
	}
}
