package sim

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// LabConfig is one fleet driven from several workers (kettle swarm --workers).
type LabConfig struct {
	// Config is the fleet: Devices is the whole fleet, split over Workers.
	Config
	Workers []string // HOST:PORT of each worker's control listener
	Token   string   // the workers' shared --token
	// Targets and MQTTTargets, if set, spread the shards over several
	// server nodes: worker i loads Targets[i mod len]. Config.Target (the
	// first node) is where the controller audits.
	Targets, MQTTTargets []string
	// LostAfter: a worker that does not answer for this long is lost (0: 5 s).
	LostAfter time.Duration
	// SetupTimeout bounds the workers' setup (provisioning) (0: 2 min + 1 s
	// per 1,000 kettles).
	SetupTimeout time.Duration
	// WorkerTLS, when set, is the control channel's client side: the
	// workers serve TLS (kettle swarm worker --tls-cert) and are verified
	// against its roots (--worker-ca); with a client certificate, the
	// workers may require it (--client-ca). Nil: plain HTTP, allowed only
	// to workers on loopback, since plans carry the device secret.
	WorkerTLS *tls.Config
}

// WorkerResult is one lab worker's part in a run.
type WorkerResult struct {
	Addr string `json:"addr"`
	// Its shard: kettles First, First+Stride, … of the fleet, Devices of them.
	First   int `json:"first"`
	Stride  int `json:"stride"`
	Devices int `json:"devices"`
	// State is "done", or "lost" (stopped answering, or failed): its
	// seconds up to LastT are merged, its readings are not audited.
	State      WorkerState `json:"state"`
	LastT      int         `json:"last_t"`
	Error      string      `json:"error,omitempty"`
	Requests   int64       `json:"requests"`
	Errors     int64       `json:"errors"`
	Acked      int64       `json:"acked"`
	CPUSeconds float64     `json:"cpu_seconds"`
	// CPUMicrosPerRequest and MaxRSSBytes are the worker process's own.
	CPUMicrosPerRequest float64 `json:"cpu_us_per_request"`
	MaxRSSBytes         int64   `json:"max_rss_bytes"`
	MaxLagMs            float64 `json:"max_lag_ms"`
	Audit               *Audit  `json:"audit,omitempty"` // its shard's part of the audit
}

// WorkerSecond is one worker in one second of the merged run.
type WorkerSecond struct {
	Requests   int64   `json:"requests"`
	CPUSeconds float64 `json:"cpu_seconds"` // the worker process's cumulative CPU
	RSSBytes   int64   `json:"rss_bytes"`
	MaxLagMs   float64 `json:"max_lag_ms"`
}

// labWorker is the controller's view of one worker.
type labWorker struct {
	addr     string
	plan     Plan
	seconds  []Second
	lastT    int
	lastOK   time.Time
	state    WorkerState
	err      string
	res      *Results
	acked    []DeviceAcked
	cpu, rss float64
	cpuReady float64 // its process CPU when it was ready: the start of its run's cost
}

type labClient struct {
	token  string
	scheme string // http, or https with LabConfig.WorkerTLS
	c      *http.Client
}

// do sends one control request and decodes a 2xx JSON answer into out.
func (lc *labClient) do(ctx context.Context, timeout time.Duration, method, addr, path string, in, out any) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, lc.scheme+"://"+addr+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+lc.token)
	resp, err := lc.c.Do(req)
	if err != nil {
		return fmt.Errorf("worker %s: %w", addr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 512<<20))
	if err != nil {
		return fmt.Errorf("worker %s %s: %w", addr, path, err)
	}
	if resp.StatusCode/100 != 2 {
		var e struct{ Error string }
		_ = json.Unmarshal(b, &e)
		return fmt.Errorf("worker %s %s: %s: %s", addr, path, resp.Status, e.Error)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fmt.Errorf("worker %s %s: %w", addr, path, err)
		}
	}
	return nil
}

// acked streams a worker's acknowledged readings.
func (lc *labClient) acked(ctx context.Context, addr, run string, max int) ([]DeviceAcked, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", lc.scheme+"://"+addr+pathAcked+"?run="+url.QueryEscape(run), nil)
	req.Header.Set("Authorization", "Bearer "+lc.token)
	resp, err := lc.c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("worker %s: %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("worker %s %s: %s", addr, pathAcked, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	var out []DeviceAcked
	for sc.Scan() {
		var d DeviceAcked
		if err := json.Unmarshal(sc.Bytes(), &d); err != nil {
			return nil, fmt.Errorf("worker %s %s: %w", addr, pathAcked, err)
		}
		if len(d.Times) == 0 { // the end marker
			return out, nil
		}
		if len(out) >= max {
			return nil, fmt.Errorf("worker %s: more devices acknowledged than its %d kettles", addr, max)
		}
		out = append(out, d)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("worker %s %s: %w", addr, pathAcked, err)
	}
	return nil, fmt.Errorf("worker %s %s: the stream ended early", addr, pathAcked)
}

// RunLab runs one fleet over several workers and merges what they saw into
// one Results: per-second histograms merged (never percentiles averaged),
// counts summed, each worker's cost kept beside, and one audit over every
// shard's acknowledged readings. A worker that stops answering is marked
// lost and the run goes on without it; its seconds so far stay merged.
func RunLab(ctx context.Context, lc LabConfig) (*Results, error) {
	if err := lc.check(); err != nil {
		return nil, err
	}
	cfg := &lc.Config
	id := make([]byte, 8)
	_, _ = rand.Read(id)
	l := &lab{lc: &lc, cfg: cfg, runID: hex.EncodeToString(id),
		cl: &labClient{token: lc.Token, scheme: "http", c: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, ResponseHeaderTimeout: 10 * time.Minute, TLSClientConfig: lc.WorkerTLS}}}}
	if lc.WorkerTLS != nil {
		l.cl.scheme = "https"
	}
	defer l.cl.c.CloseIdleConnections()
	l.ws = make([]*labWorker, len(lc.Workers))
	for i, p := range shardPlans(&lc, l.runID) {
		l.ws[i] = &labWorker{addr: lc.Workers[i], plan: p, state: stateSetup}
	}

	if err := l.setup(ctx); err != nil {
		return nil, err
	}
	start, err := l.start(ctx)
	if err != nil {
		return nil, err
	}
	l.follow(ctx, start)
	wctx := context.WithoutCancel(ctx)
	l.fetch(wctx)
	res := mergeLab(l.ws, cfg, start, time.Now())
	res.Params.Target = strings.Join(lc.Targets, ",")
	if cfg.Protocol == ProtocolMQTT {
		res.Params.MQTTTarget = strings.Join(lc.MQTTTargets, ",")
	}
	if !cfg.NoAudit && cfg.Operator != "" {
		if err := l.audit(wctx, res); err != nil {
			return res, err
		}
	}
	return res, nil
}

// check validates the lab's configuration and fills its defaults.
func (lc *LabConfig) check() error {
	cfg := &lc.Config
	if errs := cfg.Validate(); len(errs) > 0 {
		return errors.Join(errs...)
	}
	cfg.defaults()
	if len(lc.Workers) == 0 {
		return errors.New("--workers: want at least one HOST:PORT")
	}
	if len(lc.Token) < MinWorkerToken {
		return fmt.Errorf("--worker-token: want the workers' --token (at least %d characters)", MinWorkerToken)
	}
	if lc.WorkerTLS == nil {
		for _, w := range lc.Workers {
			if LoopbackSource(w) == nil {
				return fmt.Errorf("--workers %s is not on loopback: give --worker-ca (the PEM the workers' --tls-cert is signed with), so that the control channel, which carries the device secret, is TLS", w)
			}
		}
	}
	if cfg.Devices < len(lc.Workers) {
		return fmt.Errorf("--devices %d: want at least one kettle per worker (%d workers)", cfg.Devices, len(lc.Workers))
	}
	if len(lc.Targets) == 0 {
		lc.Targets = []string{cfg.Target}
	}
	for _, t := range lc.Targets {
		if _, err := CheckTarget(t, cfg.AllowHosts); err != nil {
			return err
		}
	}
	if cfg.Protocol == ProtocolMQTT && len(lc.MQTTTargets) == 0 {
		lc.MQTTTargets = []string{cfg.MQTTTarget}
	}
	if lc.LostAfter <= 0 {
		lc.LostAfter = 5 * time.Second
	}
	if lc.SetupTimeout <= 0 {
		lc.SetupTimeout = 2*time.Minute + time.Duration(cfg.Devices/1000)*time.Second
	}
	return nil
}

// lab is one run of RunLab: the controller and its workers.
type lab struct {
	lc    *LabConfig
	cfg   *Config
	runID string
	cl    *labClient
	ws    []*labWorker
	mu    sync.Mutex // the workers' fields while all runs
	// emitted is the last merged second handed to Config.OnSecond.
	emitted int
}

// all runs f on every worker at once and waits for them.
func (l *lab) all(f func(w *labWorker)) {
	var wg sync.WaitGroup
	for _, w := range l.ws {
		wg.Go(func() { f(w) })
	}
	wg.Wait()
}

// each sends one control request to every worker; the errors, joined.
func (l *lab) each(ctx context.Context, timeout time.Duration, method, path string, in func(w *labWorker) any) error {
	var errs []error
	l.all(func(w *labWorker) {
		if err := l.cl.do(ctx, timeout, method, w.addr, path, in(w), nil); err != nil {
			l.mu.Lock()
			errs = append(errs, err)
			l.mu.Unlock()
		}
	})
	return errors.Join(errs...)
}

// stopAll asks every worker to stop the run (even when ctx is done).
func (l *lab) stopAll(ctx context.Context) {
	_ = l.each(context.WithoutCancel(ctx), 5*time.Second, "POST", pathStop+"?run="+l.runID, func(*labWorker) any { return nil })
}

// setup sends each worker its plan and waits until every one is ready
// (provisioned); any failure, or LabConfig.SetupTimeout, stops them all.
func (l *lab) setup(ctx context.Context) error {
	if err := l.each(ctx, 30*time.Second, "POST", pathRun, func(w *labWorker) any { return w.plan }); err != nil {
		l.stopAll(ctx)
		return err
	}
	fmt.Fprintf(l.cfg.Log, "lab: run %s: %d kettles over %d workers (%s)\n", l.runID, l.cfg.Devices, len(l.ws), shardText(l.ws))
	setupEnd := time.Now().Add(l.lc.SetupTimeout)
	for {
		ready, failed := 0, []error(nil)
		l.all(func(w *labWorker) {
			var st WorkerStatus
			err := l.cl.do(ctx, 5*time.Second, "GET", w.addr, pathStatus+"?run="+l.runID, nil, &st)
			l.mu.Lock()
			defer l.mu.Unlock()
			switch {
			case err != nil:
				failed = append(failed, err)
			case st.State == stateFailed:
				failed = append(failed, fmt.Errorf("worker %s: %s", w.addr, st.Error))
			case st.State == stateReady:
				ready++
				w.cpuReady = st.CPUSeconds
			}
		})
		if len(failed) > 0 {
			l.stopAll(ctx)
			return fmt.Errorf("lab setup: %w", errors.Join(failed...))
		}
		if ready == len(l.ws) {
			return nil
		}
		if time.Now().After(setupEnd) || ctx.Err() != nil {
			l.stopAll(ctx)
			return fmt.Errorf("lab setup: %d of %d workers ready after %s", ready, len(l.ws), l.lc.SetupTimeout)
		}
		sleepCtx(ctx, 200*time.Millisecond)
	}
}

// start gives every worker one common start, a second from now.
func (l *lab) start(ctx context.Context) (time.Time, error) {
	start := time.Now().Add(time.Second).Truncate(time.Millisecond)
	at := map[string]time.Time{"at": start}
	if err := l.each(ctx, 5*time.Second, "POST", pathStart+"?run="+l.runID, func(*labWorker) any { return at }); err != nil {
		l.stopAll(ctx)
		return start, fmt.Errorf("lab start: %w", err)
	}
	for _, w := range l.ws {
		w.state, w.lastOK = stateRunning, time.Now()
	}
	fmt.Fprintf(l.cfg.Log, "lab: common start %s\n", start.UTC().Format(time.RFC3339Nano))
	return start, nil
}

// follow collects each worker's new seconds, once a second, until every
// worker is done or lost. An interrupted run (ctx) is followed to its end
// too: the workers are told to stop, and the run ends with what they did.
func (l *lab) follow(ctx context.Context, start time.Time) {
	cfg := l.cfg
	end := start.Add(cfg.Duration + 2*cfg.Timeout + 30*time.Second)
	lastProgress := time.Now()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	interrupted := false
	for {
		l.all(func(w *labWorker) { l.status(ctx, w) })
		l.emitSeconds(false)
		running := 0
		for _, w := range l.ws {
			if w.state == stateLost && w.err != "" {
				fmt.Fprintf(cfg.Log, "lab: worker %s lost at t=%ds (%d kettles from #%d every %d): %s\n", w.addr, w.lastT, w.plan.Devices, w.plan.First, w.plan.Stride, w.err)
				w.err = "lost at t=" + strconv.Itoa(w.lastT) + "s: " + w.err
				w.state = stateLostReported
			}
			if w.state == stateRunning {
				running++
			}
		}
		if cfg.Progress != nil && time.Since(lastProgress) >= cfg.ProgressEvery-100*time.Millisecond {
			fmt.Fprintln(cfg.Progress, labProgress(l.ws, time.Since(start)))
			lastProgress = time.Now()
		}
		if running == 0 {
			l.emitSeconds(true)
			return
		}
		if time.Now().After(end) {
			for _, w := range l.ws {
				if w.state == stateRunning {
					w.state, w.err = stateLostReported, fmt.Sprintf("lost at t=%ds: not done %s after the run's end", w.lastT, end.Sub(start.Add(cfg.Duration)).Round(time.Second))
				}
			}
			return
		}
		if !interrupted && ctx.Err() != nil {
			interrupted = true
			l.stopAll(ctx)
		}
		select {
		case <-tick.C:
		case <-time.After(2 * time.Second):
		}
	}
}

// status asks a running worker for its seconds since the last it sent; one
// that does not answer for LabConfig.LostAfter, or failed, is lost.
func (l *lab) status(ctx context.Context, w *labWorker) {
	if w.state != stateRunning {
		return
	}
	var st WorkerStatus
	// Not ctx: an interrupted run is followed to its end too.
	err := l.cl.do(context.WithoutCancel(ctx), 3*time.Second, "GET", w.addr, pathStatus+"?run="+l.runID+"&after="+strconv.Itoa(w.lastT), nil, &st)
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	switch {
	case err != nil:
		if now.Sub(w.lastOK) > l.lc.LostAfter {
			w.state, w.err = stateLost, fmt.Sprintf("no answer for %s: %v", now.Sub(w.lastOK).Round(time.Second), err)
		}
		return
	case st.State == stateFailed:
		w.state, w.err = stateLost, "failed: "+st.Error
	case st.State == stateDone:
		w.state = stateDone
	}
	w.lastOK = now
	w.cpu, w.rss = st.CPUSeconds, float64(st.RSSBytes)
	for _, s := range st.Seconds {
		if s.T > w.lastT {
			w.seconds = append(w.seconds, s)
			w.lastT = s.T
		}
	}
}

// fetch takes each finished worker's results and acknowledged readings; a
// worker whose result cannot be fetched is lost.
func (l *lab) fetch(ctx context.Context) {
	l.all(func(w *labWorker) {
		if w.state != stateDone {
			return
		}
		var res Results
		err := l.cl.do(ctx, 10*time.Minute, "GET", w.addr, pathResult+"?run="+l.runID, nil, &res)
		var acked []DeviceAcked
		if err == nil {
			acked, err = l.cl.acked(ctx, w.addr, l.runID, w.plan.Devices)
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if err != nil {
			w.state, w.err = stateLostReported, fmt.Sprintf("lost after t=%ds: its result could not be fetched: %v", w.lastT, err)
			return
		}
		w.res, w.acked = &res, acked
		w.seconds = res.Seconds
	})
}

// audit audits each finished worker's shard against the store and sums
// them into res.Audit (each shard's part in its worker's result).
func (l *lab) audit(ctx context.Context, res *Results) error {
	actx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	total := &Audit{}
	t0 := time.Now()
	for i, w := range l.ws {
		if w.res == nil {
			continue
		}
		a, err := AuditAcked(actx, l.cfg.Target, l.cfg.Operator, l.cfg.TLS, w.acked)
		if err != nil {
			return fmt.Errorf("audit of worker %s's shard: %w", w.addr, err)
		}
		res.Workers[i].Audit = a
		total.add(a)
	}
	total.Seconds = time.Since(t0).Seconds()
	res.Audit = total
	return nil
}

// shardPlans splits the fleet: worker i runs kettles i, i+W, i+2W, … of
// it: disjoint, and side by side in the hatch order, so every worker (and
// node) ramps up together.
func shardPlans(lc *LabConfig, runID string) []Plan {
	cfg := &lc.Config
	w := len(lc.Workers)
	plans := make([]Plan, w)
	for i := range plans {
		n := cfg.Devices / w
		if i < cfg.Devices%w {
			n++
		}
		p := Plan{Run: runID, Target: lc.Targets[i%len(lc.Targets)], Protocol: cfg.Protocol, API: cfg.API,
			First: i, Stride: w, Devices: n, Fleet: cfg.Devices, Interval: cfg.Interval, Jitter: cfg.Jitter, HatchRate: cfg.HatchRate,
			Duration: cfg.Duration, Batch: cfg.Batch, Conns: cfg.Conns, MQTTInflight: cfg.MQTTInflight, MQTTKeepAlive: cfg.MQTTKeepAlive,
			Timeout: cfg.Timeout, Seed: cfg.Seed, Stages: cfg.Stages, Rollout: cfg.Rollout}
		// Each secret goes only where it is used: the device secret to
		// workers that derive v1 tokens (HTTP v1, MQTT passwords), the
		// operator token only when there is no secret and they provision
		// through POST /v1/devices. The audit is the controller's.
		if cfg.API == "v1" || cfg.Protocol == ProtocolMQTT {
			if len(cfg.Secret) > 0 {
				p.Secret = cfg.Secret
			} else {
				p.Operator = cfg.Operator
			}
		}
		if cfg.Conns > 0 {
			p.Conns = max(1, cfg.Conns*n/cfg.Devices)
		}
		if cfg.TLS != nil {
			p.CA, p.TLSResume = cfg.CAPEM, cfg.TLS.ClientSessionCache != nil
		}
		if cfg.Protocol == ProtocolMQTT {
			p.MQTTTarget = lc.MQTTTargets[i%len(lc.MQTTTargets)]
		}
		plans[i] = p
	}
	return plans
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

func shardText(ws []*labWorker) string {
	var b []string
	for _, w := range ws {
		b = append(b, fmt.Sprintf("%s: %d kettles from #%d every %d", w.addr, w.plan.Devices, w.plan.First, w.plan.Stride))
	}
	return strings.Join(b, ", ")
}

// labProgress is the controller's live line: the last second every worker
// has reported, merged, and each worker's CPU, RSS and lag.
func labProgress(ws []*labWorker, elapsed time.Duration) string {
	var b strings.Builder
	t := -1
	for _, w := range ws {
		if w.state == stateRunning && (t < 0 || w.lastT < t) {
			t = w.lastT
		}
	}
	var secs []Second
	for _, w := range ws {
		for j := len(w.seconds) - 1; j >= 0; j-- {
			if w.seconds[j].T == t {
				secs = append(secs, w.seconds[j])
				break
			}
		}
	}
	m := mergeSecond(t, secs)
	fmt.Fprintf(&b, "[%4.0fs] lab t=%ds kettles %d", elapsed.Seconds(), t, m.Kettles)
	for _, n := range slices.Sorted(maps.Keys(m.Endpoints)) {
		e := m.Endpoints[n]
		p99 := int64(0)
		if h, err := hdrhistogram.Decode([]byte(e.Histogram)); err == nil {
			p99 = h.ValueAtQuantile(99)
		}
		var errs int64
		for _, v := range e.Errors {
			errs += v
		}
		fmt.Fprintf(&b, " | %s offered %d done %d p99 %s errors %d", n, e.Offered, e.Requests, ms(p99), errs)
	}
	b.WriteString(" | workers")
	for _, w := range ws {
		lag := 0.0
		if n := len(w.seconds); n > 0 {
			lag = w.seconds[n-1].MaxLagMs
		}
		fmt.Fprintf(&b, " %s %s cpu %.1fs rss %dMiB lag %.0fms;", w.addr, strings.TrimSuffix(string(w.state), "-reported"), w.cpu, int64(w.rss)>>20, lag)
	}
	return b.String()
}

// mergeSecond merges the workers' seconds of one T: counts summed,
// histograms merged exactly, the worst lag kept.
func mergeSecond(t int, secs []Second) Second {
	m := Second{T: t, Endpoints: map[string]*EndpointSecond{}}
	hists := map[string]*hdrhistogram.Histogram{}
	for _, s := range secs {
		m.Kettles += s.Kettles
		m.InFlight += s.InFlight
		m.LateStarts += s.LateStarts
		m.MaxLagMs = max(m.MaxLagMs, s.MaxLagMs)
		m.Readings += s.Readings
		m.Acked += s.Acked
		m.Dropped += s.Dropped
		m.OpenConns += s.OpenConns
		m.CommandsReceived += s.CommandsReceived
		m.CPUSeconds += s.CPUSeconds
		m.RSSBytes += s.RSSBytes
		for name, e := range s.Endpoints {
			me := m.Endpoints[name]
			if me == nil {
				me = &EndpointSecond{}
				m.Endpoints[name] = me
				hists[name] = NewHistogram()
			}
			me.Offered += e.Offered
			me.Requests += e.Requests
			me.Status = addCounts(me.Status, e.Status)
			me.Errors = addCounts(me.Errors, e.Errors)
			if e.Histogram != "" {
				if h, err := hdrhistogram.Decode([]byte(e.Histogram)); err == nil {
					hists[name].Merge(h)
				}
			}
		}
	}
	for name, h := range hists {
		enc, _ := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
		m.Endpoints[name].Histogram = string(enc)
	}
	return m
}

func addCounts(dst, src map[string]int64) map[string]int64 {
	if len(src) == 0 {
		return dst
	}
	if dst == nil {
		dst = map[string]int64{}
	}
	for k, v := range src {
		dst[k] += v
	}
	return dst
}

// mergeLab builds the fleet's Results from its workers'.
func mergeLab(ws []*labWorker, cfg *Config, start, end time.Time) *Results {
	res := &Results{Schema: SchemaVersion, Start: start, End: end, Seconds: mergeSeconds(ws)}
	tot := mergeTotals(res.Seconds, cfg.steadyFrom(len(res.Seconds)))
	tot.WallSeconds = end.Sub(start).Seconds()
	params := cfg.params()
	if len(ws) > 0 && strings.HasPrefix(ws[0].plan.Target, "https:") {
		params.TLS, params.TLSResume = true, ws[0].plan.TLSResume
	}
	if cfg.Protocol == ProtocolMQTT {
		params.Protocol, params.MQTTInflight = cfg.Protocol, cfg.MQTTInflight
	}
	for i, w := range ws {
		wr := w.result()
		if r := w.res; r != nil {
			t := r.Totals
			tot.Unacked += t.Unacked
			tot.DuplicatesReported += t.DuplicatesReported
			tot.PollsDeferred += t.PollsDeferred
			tot.Dials += t.Dials
			tot.TLSHandshakes += t.TLSHandshakes
			tot.TLSResumed += t.TLSResumed
			tot.ConnsLost += t.ConnsLost
			if i == 0 || params.ConnMode == "" {
				params.ConnMode, params.Provisioning, params.SourceIPs = r.Params.ConnMode, r.Params.Provisioning, r.Params.SourceIPs
			}
			params.Conns += r.Params.Conns
			params.SourceAddrs = append(params.SourceAddrs, r.Params.SourceAddrs...)
		}
		tot.MaxRSSBytes += wr.MaxRSSBytes
		tot.CPUSeconds += wr.CPUSeconds
		res.Workers = append(res.Workers, wr)
	}
	tot.setCPURates(res.Seconds)
	res.Params = params
	res.Totals = tot
	return res
}

// mergeSeconds merges the workers' seconds of each T, each worker's part
// kept beside (a worker's T are strictly increasing).
func mergeSeconds(ws []*labWorker) []Second {
	maxT := 0
	for _, w := range ws {
		if n := len(w.seconds); n > 0 {
			maxT = max(maxT, w.seconds[n-1].T)
		}
	}
	byT := make([][]Second, maxT+1)
	wsec := make([][]WorkerSecond, maxT+1)
	for t := range wsec {
		wsec[t] = make([]WorkerSecond, len(ws))
	}
	for i, w := range ws {
		for _, s := range w.seconds {
			byT[s.T] = append(byT[s.T], s)
			var req int64
			for _, e := range s.Endpoints {
				req += e.Requests
			}
			wsec[s.T][i] = WorkerSecond{Requests: req, CPUSeconds: s.CPUSeconds, RSSBytes: s.RSSBytes, MaxLagMs: s.MaxLagMs}
		}
	}
	var out []Second
	for t := 1; t <= maxT; t++ {
		if len(byT[t]) == 0 {
			continue
		}
		s := mergeSecond(t, byT[t])
		s.Workers = wsec[t]
		out = append(out, s)
	}
	return out
}

// mergeTotals is the totals of merged seconds: latency from the merged
// histograms, counts summed, the rate over the steady seconds (from
// steadyFrom on).
func mergeTotals(secs []Second, steadyFrom int) Totals {
	tot := Totals{Endpoints: map[string]*EndpointTotal{}, ErrorsByKind: map[string]int64{}}
	hists := map[string]*hdrhistogram.Histogram{}
	for j, s := range secs {
		for name, e := range s.Endpoints {
			et := tot.Endpoints[name]
			if et == nil {
				et = &EndpointTotal{}
				tot.Endpoints[name] = et
				hists[name] = NewHistogram()
			}
			if h, err := hdrhistogram.Decode([]byte(e.Histogram)); err == nil {
				hists[name].Merge(h)
			}
			et.Requests += e.Requests
			et.Offered += e.Offered
			for k, v := range e.Errors {
				et.Errors += v
				tot.ErrorsByKind[k] += v
			}
			if j >= steadyFrom {
				et.PerSecond += float64(e.Requests)
			}
		}
		tot.Readings += s.Readings
		tot.Acked += s.Acked
		tot.Dropped += s.Dropped
		tot.LateStarts += s.LateStarts
		tot.CommandsReceived += s.CommandsReceived
		tot.MaxLagMs = max(tot.MaxLagMs, s.MaxLagMs)
	}
	for name, et := range tot.Endpoints {
		et.setLatency(hists[name])
		if n := len(secs) - steadyFrom; n > 0 {
			et.PerSecond /= float64(n)
		}
		tot.Requests += et.Requests
		tot.Errors += et.Errors
	}
	if tot.Requests > 0 {
		tot.ErrorRate = float64(tot.Errors) / float64(tot.Requests)
	}
	return tot
}

// result is the worker's line of the merged Results: its counts from its
// seconds; its cost from its own totals, or, lost, as far as its seconds
// tell, from when it was ready.
func (w *labWorker) result() WorkerResult {
	wr := WorkerResult{Addr: w.addr, First: w.plan.First, Stride: w.plan.Stride, Devices: w.plan.Devices, State: stateDone, LastT: w.lastT, Error: w.err}
	for _, s := range w.seconds {
		for _, e := range s.Endpoints {
			wr.Requests += e.Requests
			for _, v := range e.Errors {
				wr.Errors += v
			}
		}
		wr.Acked += s.Acked
		wr.MaxLagMs = max(wr.MaxLagMs, s.MaxLagMs)
		wr.MaxRSSBytes = max(wr.MaxRSSBytes, s.RSSBytes)
	}
	if r := w.res; r != nil {
		t := r.Totals
		wr.CPUSeconds, wr.MaxRSSBytes, wr.CPUMicrosPerRequest = t.CPUSeconds, t.MaxRSSBytes, t.CPUMicrosPerRequest
		return wr
	}
	wr.State = stateLost
	if n := len(w.seconds); n > 0 {
		wr.CPUSeconds = max(0, w.seconds[n-1].CPUSeconds-w.cpuReady)
	}
	if wr.Requests > 0 {
		wr.CPUMicrosPerRequest = wr.CPUSeconds / float64(wr.Requests) * 1e6
	}
	return wr
}

// LostWorkers lists the workers that did not finish (empty: none).
func (r *Results) LostWorkers() []WorkerResult {
	var out []WorkerResult
	for _, w := range r.Workers {
		if w.State != stateDone {
			out = append(out, w)
		}
	}
	return out
}
