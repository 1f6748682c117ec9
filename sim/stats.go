package sim

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

const (
	epLogin = iota
	epMeasurement
	epCommand
	epMQTTConnect
	epMQTTPublish
	nEP
)

var epNames = [nEP]string{EPLogin, EPMeasurement, EPCommand, EPMQTTConnect, EPMQTTPublish}

// epStats counts one endpoint: this second, the progress window, the run.
type epStats struct {
	hist, window, total *hdrhistogram.Histogram
	req, errs           int64
	status              map[string]int64
	kinds               map[string]int64
	wReq                int64
	wKinds              map[string]int64
	tReq, tErrs         int64
	tKinds              map[string]int64
}

func newEPStats() *epStats {
	return &epStats{
		hist: NewHistogram(), window: NewHistogram(), total: NewHistogram(),
		status: map[string]int64{}, kinds: map[string]int64{}, wKinds: map[string]int64{}, tKinds: map[string]int64{},
	}
}

// stats is shared by the dispatcher and every exchange. Requests are
// recorded under one mutex (a few thousand a second: no contention worth
// sharding); plain counters are atomics.
type stats struct {
	mu  sync.Mutex
	ep  [nEP]*epStats
	use [nEP]bool

	offered [nEP]atomic.Int64 // this second
	obs     Observer

	readings, acked, dropped, late, dupReported, pollsDeferred atomic.Int64
	commands, mqttLost                                         atomic.Int64 // MQTT: commands received, connections lost
	maxLag, totMaxLag                                          atomic.Int64 // ns
}

func newStats(api, protocol string) *stats {
	st := &stats{}
	for i := range st.ep {
		st.ep[i] = newEPStats()
	}
	if protocol == ProtocolMQTT {
		st.use = [nEP]bool{epMQTTConnect: true, epMQTTPublish: true}
	} else {
		st.use = [nEP]bool{api == "v0", true, true, false, false}
	}
	return st
}

func (st *stats) add(c *atomic.Int64, n int64) { c.Add(n) }

// offer counts a request of endpoint ep coming due.
func (st *stats) offer(ep int) {
	st.offered[ep].Add(1)
	if st.obs != nil {
		st.obs.Offered(epNames[ep])
	}
}

// lag records how late the dispatcher fired an event.
func (st *stats) lag(ns int64) {
	for _, m := range []*atomic.Int64{&st.maxLag, &st.totMaxLag} {
		for {
			old := m.Load()
			if ns <= old || m.CompareAndSwap(old, ns) {
				break
			}
		}
	}
}

// record counts one request. latNs < 0: no latency to record (the request
// completed but its answer was unusable).
func (st *stats) record(ep int, latNs int64, status int, err error) {
	kind := ""
	switch {
	case err != nil:
		kind = errKind(err)
	case status/100 != 2 && status != 304:
		kind = "http_" + strconv.Itoa(status)
	}
	key := ""
	if status != 0 {
		key = strconv.Itoa(status)
	}
	st.recordKind(ep, latNs, key, status, kind)
}

// recordKind counts one request whose outcome is already classified: key is
// the status as results.json shows it ("" for none: HTTP status, or an MQTT
// reason code "0x00"), status is what the Observer sees (an HTTP status; MQTT
// maps success to 200), kind the error class ("" for success).
func (st *stats) recordKind(ep int, latNs int64, key string, status int, kind string) {
	if o := st.obs; o != nil {
		if latNs >= 0 && status != 0 {
			o.Completed(epNames[ep], status, time.Duration(latNs))
		}
		if kind != "" {
			o.Error(epNames[ep], kind)
		}
	}
	st.mu.Lock()
	e := st.ep[ep]
	if latNs >= 0 {
		us := max(latNs/1000, HistMinMicros)
		_ = e.hist.RecordValue(min(us, HistMaxMicros))
		e.req++
		e.wReq++
		e.tReq++
		if key != "" {
			e.status[key]++
		}
	}
	if kind != "" {
		e.errs++
		e.tErrs++
		e.kinds[kind]++
		e.wKinds[kind]++
		e.tKinds[kind]++
	}
	st.mu.Unlock()
}

// second closes the current second: it encodes and resets the per-second
// histograms and folds them into the window and the run.
func (st *stats) second(sec *Second) {
	st.mu.Lock()
	defer st.mu.Unlock()
	sec.Endpoints = map[string]*EndpointSecond{}
	for i, e := range st.ep {
		if !st.use[i] {
			continue
		}
		enc, _ := e.hist.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
		es := &EndpointSecond{Offered: st.offered[i].Swap(0), Requests: e.req, Histogram: string(enc)}
		if len(e.status) > 0 {
			es.Status = e.status
			e.status = map[string]int64{}
		}
		if len(e.kinds) > 0 {
			es.Errors = e.kinds
			e.kinds = map[string]int64{}
		}
		sec.Endpoints[epNames[i]] = es
		e.window.Merge(e.hist)
		e.total.Merge(e.hist)
		e.hist.Reset()
		e.req, e.errs = 0, 0
	}
}

// progress returns the live line for the window since the last call and
// resets the window.
func (st *stats) progress(elapsed time.Duration, window time.Duration, kettles, devices, inflight int64, cpuPct float64, rss int64) string {
	st.mu.Lock()
	defer st.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "[%4.0fs] kettles %d/%d  in-flight %d", elapsed.Seconds(), kettles, devices, inflight)
	errs := map[string]int64{}
	for i, e := range st.ep {
		if !st.use[i] {
			continue
		}
		fmt.Fprintf(&b, " | %s %.0f/s p50 %s p99 %s", epNames[i], float64(e.wReq)/window.Seconds(),
			ms(e.window.ValueAtQuantile(50)), ms(e.window.ValueAtQuantile(99)))
		for k, v := range e.wKinds {
			errs[k] += v
		}
		e.window.Reset()
		e.wReq = 0
		e.wKinds = map[string]int64{}
	}
	if len(errs) == 0 {
		b.WriteString(" | errors 0")
	} else {
		ks := make([]string, 0, len(errs))
		for k := range errs {
			ks = append(ks, k)
		}
		sort.Strings(ks)
		b.WriteString(" | errors")
		for _, k := range ks {
			fmt.Fprintf(&b, " %s=%d", k, errs[k])
		}
	}
	if st.use[epMQTTPublish] {
		fmt.Fprintf(&b, " | commands %d lost-conns %d", st.commands.Load(), st.mqttLost.Load())
	}
	fmt.Fprintf(&b, " | late %d lag %.0fms | cpu %.0f%% rss %dMiB", st.late.Load(), float64(st.maxLagWindow())/1e6, cpuPct, rss>>20)
	return b.String()
}

// maxLagWindow is the worst lag since the run started (progress shows the
// run's worst: a transient stall should stay visible).
func (st *stats) maxLagWindow() int64 { return st.totMaxLag.Load() }

func ms(us int64) string {
	return strconv.FormatFloat(float64(us)/1000, 'f', 1, 64) + "ms"
}

// cpuSeconds is the process's user+system CPU time.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

// maxRSS is the process's peak resident set.
func maxRSS() int64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return ru.Maxrss * 1024
}

// rss is the resident set now, from /proc/self/statm.
func rss() int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}
