package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// sample is one probe request as the client saw it.
type sample struct {
	at         time.Time // sent
	lat        time.Duration
	status     int // 0: transport error
	err        string
	retryAfter string
}

// probe sends one kind of request on a schedule, on its own keep-alive
// connections, and keeps every answer: the normal client whose experience
// each part reports.
type probe struct {
	name  string
	hc    *http.Client
	build func(i int) *http.Request

	mu      sync.Mutex
	samples []sample
}

func newProbe(name string, conns int, timeout time.Duration, build func(i int) *http.Request) *probe {
	tr := &http.Transport{MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns, IdleConnTimeout: time.Minute}
	return &probe{name: name, hc: &http.Client{Timeout: timeout, Transport: tr}, build: build}
}

// run sends a request every `every` until ctx ends or limit requests were
// sent (each loop is bounded in time and count). A slow answer does not
// delay the next send (open model): sends are started on schedule.
func (p *probe) run(ctx context.Context, every time.Duration, limit int) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for i := 0; i < limit; i++ {
			wg.Add(1)
			go func(i int) { defer wg.Done(); p.once(i) }(i)
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			}
		}
	}()
	return &wg
}

func (p *probe) once(i int) sample {
	req := p.build(i)
	s := sample{at: time.Now()}
	res, err := p.hc.Do(req)
	if err != nil {
		s.lat = time.Since(s.at)
		s.err = err.Error()
	} else {
		io.Copy(io.Discard, io.LimitReader(res.Body, 1<<20))
		res.Body.Close()
		s.lat = time.Since(s.at)
		s.status = res.StatusCode
		s.retryAfter = res.Header.Get("Retry-After")
	}
	p.mu.Lock()
	p.samples = append(p.samples, s)
	p.mu.Unlock()
	return s
}

// between returns the samples sent in [from, to).
func (p *probe) between(from, to time.Time) []sample {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []sample
	for _, s := range p.samples {
		if !s.at.Before(from) && s.at.Before(to) {
			out = append(out, s)
		}
	}
	return out
}

func (p *probe) all() []sample { return p.between(time.Time{}, time.Now().Add(time.Hour)) }

// writeCSV keeps every sample (ms since t0, latency, status) in path, so a
// tail can be placed in time against the server's log and metrics.
func (p *probe) writeCSV(path string, t0 time.Time) error {
	var b strings.Builder
	b.WriteString("probe,sent_ms,latency_ms,status,err,sent_unix_ms\n")
	for _, s := range p.all() {
		fmt.Fprintf(&b, "%s,%d,%.3f,%d,%q,%d\n", p.name, s.at.Sub(t0).Milliseconds(), float64(s.lat)/1e6, s.status, s.err, s.at.UnixMilli())
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// latStats summarises latencies.
type latStats struct {
	n             int
	p50, p99, max time.Duration
}

func stats(ss []sample, keep func(sample) bool) latStats {
	var ls []time.Duration
	for _, s := range ss {
		if keep == nil || keep(s) {
			ls = append(ls, s.lat)
		}
	}
	if len(ls) == 0 {
		return latStats{}
	}
	slices.Sort(ls)
	q := func(f float64) time.Duration {
		i := int(f*float64(len(ls))+0.999999) - 1
		return ls[max(0, min(i, len(ls)-1))]
	}
	return latStats{n: len(ls), p50: q(0.5), p99: q(0.99), max: ls[len(ls)-1]}
}

func (l latStats) String() string {
	if l.n == 0 {
		return "n=0"
	}
	return fmt.Sprintf("n=%d p50 %s p99 %s max %s", l.n, ms(l.p50), ms(l.p99), ms(l.max))
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/1e6) }

// byStatus counts samples by status ("err" for transport errors).
func byStatus(ss []sample) map[string]int {
	m := map[string]int{}
	for _, s := range ss {
		if s.status == 0 {
			k := "err"
			if strings.Contains(s.err, "Timeout") || strings.Contains(s.err, "timeout") {
				k = "timeout"
			}
			m[k]++
		} else {
			m[fmt.Sprint(s.status)]++
		}
	}
	return m
}

func fmtCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s×%d", k, m[k])
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}

// probeDevice is a v1 kettle the probes act as.
type probeDevice struct {
	id    uuid.UUID
	token string
}

func newProbeDevice(secret string) probeDevice {
	id := uuid.New()
	return probeDevice{id, kettle.DeviceToken([]byte(secret), id)}
}

func (d probeDevice) commandReq(base string) func(int) *http.Request {
	return func(int) *http.Request {
		r, _ := http.NewRequest("GET", base+"/v1/command", nil)
		r.Header.Set("Authorization", "Bearer "+d.token)
		return r
	}
}

// readingReq posts one reading per call, each at its own device time
// (start + i ms), so none is a duplicate.
func (d probeDevice) readingReq(base string, start time.Time) func(int) *http.Request {
	return func(i int) *http.Request {
		t := start.Add(time.Duration(i) * time.Millisecond).UTC()
		body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":500,"battery_full_mwh":1000,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":60,"water_level_ml":700}`, t.Format(time.RFC3339Nano))
		r, _ := http.NewRequest("POST", base+"/v1/measurements", strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer "+d.token)
		r.Header.Set("Content-Type", "application/json")
		return r
	}
}

func getReq(url string) func(int) *http.Request {
	return func(int) *http.Request {
		r, _ := http.NewRequest("GET", url, nil)
		return r
	}
}
