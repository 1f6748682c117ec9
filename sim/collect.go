package sim

import (
	"fmt"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// collect closes a Second every second and prints the progress line, until
// stop is closed (then it closes the last, partial second).
func (s *Swarm) collect(res *Results, stop <-chan struct{}) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var prev struct{ late, readings, acked, dropped, commands int64 }
	lastProgress := time.Now()
	lastCPU := cpuSeconds()
	t := 0
	close := func() {
		// T is wall time since the start: a collector starved of CPU
		// (ticks dropped) folds the missed seconds into this one rather
		// than drifting behind the clock (a 100,000-kettle run on a
		// saturated machine recorded 88 "seconds" in 390).
		t = max(t+1, int(time.Since(s.start)/time.Second))
		sec := Second{T: t, Kettles: int(s.hatched.Load()), InFlight: int(s.busy.Load()), OpenConns: s.pool.open.Load()}
		s.st.second(&sec)
		late, readings, acked, dropped := s.st.late.Load(), s.st.readings.Load(), s.st.acked.Load(), s.st.dropped.Load()
		sec.LateStarts, sec.Readings, sec.Acked, sec.Dropped = late-prev.late, readings-prev.readings, acked-prev.acked, dropped-prev.dropped
		prev.late, prev.readings, prev.acked, prev.dropped = late, readings, acked, dropped
		cmds := s.st.commands.Load()
		sec.CommandsReceived, prev.commands = cmds-prev.commands, cmds
		lagNs := s.st.maxLag.Swap(0)
		sec.MaxLagMs = float64(lagNs) / 1e6
		if o := s.st.obs; o != nil {
			o.SetActive(sec.Kettles)
			o.SetLag(time.Duration(lagNs))
		}
		sec.CPUSeconds = cpuSeconds()
		sec.RSSBytes = rss()
		res.Seconds = append(res.Seconds, sec)
		if s.cfg.OnSecond != nil {
			s.cfg.OnSecond(sec)
		}
		if s.cfg.Progress != nil && time.Since(lastProgress) >= s.cfg.ProgressEvery-100*time.Millisecond {
			win := time.Since(lastProgress)
			pct := (sec.CPUSeconds - lastCPU) / win.Seconds() * 100
			fmt.Fprintln(s.cfg.Progress, s.st.progress(time.Since(s.start), win, s.hatched.Load(), int64(s.cfg.Devices), s.busy.Load(), pct, sec.RSSBytes))
			lastProgress, lastCPU = time.Now(), sec.CPUSeconds
		}
	}
	for {
		select {
		case <-tick.C:
			close()
		case <-stop:
			close()
			return
		}
	}
}

// totals fills res.Totals from the run's counters and seconds.
func (s *Swarm) totals(res *Results) {
	t := Totals{Endpoints: map[string]*EndpointTotal{}, ErrorsByKind: map[string]int64{}}
	t.WallSeconds = res.End.Sub(res.Start).Seconds()
	steadyFrom := s.cfg.steadyFrom(len(res.Seconds))
	s.st.mu.Lock()
	for i, e := range s.st.ep {
		if !s.st.use[i] {
			continue
		}
		et := &EndpointTotal{Requests: e.tReq, Errors: e.tErrs}
		et.setLatency(e.total)
		for _, sec := range res.Seconds {
			if es := sec.Endpoints[epNames[i]]; es != nil {
				et.Offered += es.Offered
			}
		}
		var n int64
		for _, sec := range res.Seconds[steadyFrom:] {
			if es := sec.Endpoints[epNames[i]]; es != nil {
				n += es.Requests
			}
		}
		if secs := len(res.Seconds) - steadyFrom; secs > 0 {
			et.PerSecond = float64(n) / float64(secs)
		}
		t.Endpoints[epNames[i]] = et
		t.Requests += e.tReq
		t.Errors += e.tErrs
		for k, v := range e.tKinds {
			t.ErrorsByKind[k] += v
		}
	}
	s.st.mu.Unlock()
	if t.Requests > 0 {
		t.ErrorRate = float64(t.Errors) / float64(t.Requests)
	}
	t.Readings, t.Acked, t.Dropped = s.st.readings.Load(), s.st.acked.Load(), s.st.dropped.Load()
	for i := range s.kettles {
		k := &s.kettles[i]
		k.mu.Lock()
		t.Unacked += int64(len(k.pending))
		k.mu.Unlock()
	}
	t.DuplicatesReported = s.st.dupReported.Load()
	t.LateStarts = s.st.late.Load()
	t.PollsDeferred = s.st.pollsDeferred.Load()
	t.MaxLagMs = float64(s.st.totMaxLag.Load()) / 1e6
	t.Dials = s.pool.dials.Load()
	t.TLSHandshakes, t.TLSResumed = s.pool.handshakes.Load(), s.pool.resumed.Load()
	t.CommandsReceived = s.st.commands.Load()
	t.ConnsLost = s.st.mqttLost.Load()
	t.CPUSeconds = cpuSeconds() - s.cpuStart
	t.MaxRSSBytes = maxRSS()
	t.setCPURates(res.Seconds)
	res.Totals = t
}

// steadyFrom is the index of the run's first steady second: the one after
// the last kettle hatched (0 when that leaves fewer than two seconds).
func (c *Config) steadyFrom(seconds int) int {
	from := 0
	if c.HatchRate > 0 {
		from = int(float64(c.Devices)/c.HatchRate) + 1
	}
	if from >= seconds-1 {
		return 0
	}
	return from
}

// setLatency sets an endpoint's percentiles and histogram from h (µs).
func (et *EndpointTotal) setLatency(h *hdrhistogram.Histogram) {
	et.P50Ms = float64(h.ValueAtQuantile(50)) / 1000
	et.P99Ms = float64(h.ValueAtQuantile(99)) / 1000
	et.P999Ms = float64(h.ValueAtQuantile(99.9)) / 1000
	et.MaxMs = float64(h.Max()) / 1000
	enc, _ := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
	et.Histogram = string(enc)
}

// setCPURates divides the run's CPU by its kettle-minutes and requests.
func (t *Totals) setCPURates(secs []Second) {
	var kettleSeconds float64
	for _, sec := range secs {
		kettleSeconds += float64(sec.Kettles)
	}
	if kettleSeconds > 0 {
		t.CPUPer10kKettlesPerMin = t.CPUSeconds / (kettleSeconds / 60 / 10000)
	}
	if t.Requests > 0 {
		t.CPUMicrosPerRequest = t.CPUSeconds / float64(t.Requests) * 1e6
	}
}
