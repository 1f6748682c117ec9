package sim

import (
	"bufio"
	"context"
	"crypto/subtle"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The lab's control channel: a controller (kettle swarm --workers) drives
// worker processes (kettle swarm worker) over plain HTTP/1.1 with JSON
// bodies, every request carrying the shared token. The worker only ever
// answers; it never dials the controller, so a worker behind a firewall
// needs one open port and nothing else.
const (
	pathRun    = "/v1/run"
	pathStart  = "/v1/start"
	pathStatus = "/v1/status"
	pathResult = "/v1/result"
	pathAcked  = "/v1/acked"
	pathStop   = "/v1/stop"

	// maxPlanBytes bounds a plan (its only large field is the secret).
	maxPlanBytes = 1 << 20
	// maxStatusSeconds bounds the seconds one status answer carries.
	maxStatusSeconds = 120
	// workerMaxDevices bounds one worker's shard.
	workerMaxDevices = 2_000_000
	// MinWorkerToken is the shortest control token a worker accepts.
	MinWorkerToken = 16
)

// Plan is a worker's shard of a fleet run, as the controller sends it.
type Plan struct {
	Run        string `json:"run"` // the controller's run id, echoed in every answer
	Target     string `json:"target"`
	Protocol   string `json:"protocol"`
	MQTTTarget string `json:"mqtt_target,omitempty"`
	API        string `json:"api"`
	// The shard is kettles First, First+Stride, … of the fleet; Devices of them.
	First         int           `json:"first"`
	Stride        int           `json:"stride"`
	Devices       int           `json:"devices"`
	Fleet         int           `json:"fleet"` // the whole fleet, for the record
	Interval      time.Duration `json:"interval_ns"`
	Jitter        time.Duration `json:"jitter_ns"`
	HatchRate     float64       `json:"hatch_rate"`
	Duration      time.Duration `json:"duration_ns"`
	Batch         int           `json:"batch"`
	Conns         int           `json:"conns"`
	MQTTInflight  int           `json:"mqtt_inflight,omitempty"`
	MQTTKeepAlive time.Duration `json:"mqtt_keepalive_ns,omitempty"`
	Timeout       time.Duration `json:"timeout_ns"`
	Seed          uint64        `json:"seed"`
	// The fleet's load shape: the whole fleet's, each shard's kettles
	// joining and leaving by their index in it.
	Stages  []Stage  `json:"stages,omitempty"`
	Rollout *Rollout `json:"rollout,omitempty"`
	// Secret derives device tokens offline; Operator provisions them (one of
	// the two). The control channel carries them: keep it on a network you
	// trust, or loopback.
	Secret   []byte `json:"secret,omitempty"`
	Operator string `json:"operator,omitempty"`
	// An https Target: the PEM certificates to trust (none: the worker's
	// system roots), and whether kettles resume TLS sessions.
	CA        []byte `json:"ca,omitempty"`
	TLSResume bool   `json:"tls_resume,omitempty"`
}

// validate checks the plan against the worker's bounds and target guard.
func (p *Plan) validate(w *WorkerConfig) error {
	var errs []error
	if p.Devices <= 0 || p.Devices > workerMaxDevices {
		errs = append(errs, fmt.Errorf("devices %d: want 1..%d", p.Devices, workerMaxDevices))
	}
	if p.First < 0 {
		errs = append(errs, fmt.Errorf("first %d: want ≥ 0", p.First))
	}
	if p.Duration <= 0 || p.Duration > 24*time.Hour {
		errs = append(errs, fmt.Errorf("duration %s: want (0, 24h]", p.Duration))
	}
	if len(p.Stages) > maxStages {
		errs = append(errs, fmt.Errorf("stages: %d, want at most %d", len(p.Stages), maxStages))
	}
	if _, err := CheckTarget(p.Target, w.AllowHosts); err != nil {
		errs = append(errs, fmt.Errorf("this worker %w (kettle swarm worker --allow-target names a host it may load)", err))
	}
	if p.Protocol == ProtocolMQTT {
		if _, err := CheckTargetAddr(p.MQTTTarget, w.AllowHosts); err != nil {
			errs = append(errs, fmt.Errorf("this worker %w", err))
		}
	}
	if _, err := p.tls(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// tls is the client side of an https Target (nil: http).
func (p *Plan) tls() (*tls.Config, error) {
	if !strings.HasPrefix(p.Target, "https:") {
		if p.CA != nil {
			return nil, fmt.Errorf("ca: the target %s is not https", p.Target)
		}
		return nil, nil
	}
	c, err := ClientTLS(p.CA, p.TLSResume)
	if err != nil {
		return nil, fmt.Errorf("ca: %w", err)
	}
	return c, nil
}

func (p *Plan) config(w *WorkerConfig) Config {
	tlsCfg, _ := p.tls() // validated
	return Config{
		TargetConfig:    TargetConfig{Target: p.Target, TLS: tlsCfg, Secret: p.Secret, Operator: p.Operator, AllowHosts: w.AllowHosts},
		FleetConfig:     FleetConfig{First: p.First, Stride: p.Stride, Devices: p.Devices, Seed: p.Seed},
		ScheduleConfig:  ScheduleConfig{Interval: p.Interval, Jitter: p.Jitter, HatchRate: p.HatchRate, Duration: p.Duration, Stages: p.Stages, Rollout: p.Rollout},
		TransportConfig: TransportConfig{Protocol: p.Protocol, MQTTTarget: p.MQTTTarget, API: p.API, Batch: p.Batch, Conns: p.Conns, MQTTInflight: p.MQTTInflight, MQTTKeepAlive: p.MQTTKeepAlive, Timeout: p.Timeout, SourceAddrs: w.SourceAddrs, ReserveFDs: w.ReserveFDs},
		AuditConfig:     AuditConfig{NoAudit: true, ExportAcked: true},
		OutputConfig:    OutputConfig{Log: w.Log},
	}
}

// WorkerStatus is a worker's answer to a status request.
type WorkerStatus struct {
	Run   string      `json:"run"`
	State WorkerState `json:"state"` // idle, setup, ready, running, done, failed
	Error string      `json:"error,omitempty"`
	// Seconds closed since the asked-for one (at most maxStatusSeconds).
	Seconds    []Second `json:"seconds,omitempty"`
	CPUSeconds float64  `json:"cpu_seconds"`
	RSSBytes   int64    `json:"rss_bytes"`
}

// WorkerState is where a lab worker's run stands: a worker reports the
// first six of its own; the controller adds the two lost ones.
type WorkerState string

// Worker states.
const (
	stateIdle    WorkerState = "idle"
	stateSetup   WorkerState = "setup"
	stateReady   WorkerState = "ready"
	stateRunning WorkerState = "running"
	stateDone    WorkerState = "done"
	stateFailed  WorkerState = "failed"
	// stateLost: the controller gave the worker up (it stopped answering,
	// failed, or its result could not be fetched); its seconds so far stay
	// merged, its readings are not audited.
	stateLost WorkerState = "lost"
	// stateLostReported is stateLost once the controller has logged it.
	stateLostReported WorkerState = "lost-reported"
)

// WorkerConfig is one worker process.
type WorkerConfig struct {
	Token       string   // shared with the controller; at least MinWorkerToken bytes
	AllowHosts  []string // non-loopback hosts this worker may load (see CheckTarget)
	SourceAddrs []net.IP // the shard's connections come from these addresses
	ReserveFDs  int
	// Orphan stops a run when no controller request arrived for this long
	// (0: 30 s): a controller that died must not leave load running.
	Orphan time.Duration
	Log    io.Writer
}

// Worker runs the shards a controller gives it, one at a time.
type Worker struct {
	cfg      WorkerConfig
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	lastSeen atomic.Int64 // unix ns of the last authenticated request
	sem      chan struct{}

	mu  sync.Mutex
	cur *workerRun
}

type workerRun struct {
	plan    Plan
	cancel  context.CancelFunc
	state   WorkerState
	err     string
	seconds []Second
	startc  chan time.Time
	res     *Results
}

// NewWorker returns a worker; Close stops its run.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	if len(cfg.Token) < MinWorkerToken {
		return nil, fmt.Errorf("--token: want at least %d characters (a shared secret: anyone who holds it can send load from this worker)", MinWorkerToken)
	}
	if cfg.Orphan <= 0 {
		cfg.Orphan = 30 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Worker{cfg: cfg, ctx: ctx, cancel: cancel, sem: make(chan struct{}, 8)}, nil
}

// Close stops the current run and waits for it.
func (w *Worker) Close() {
	w.cancel()
	w.wg.Wait()
}

// Handler is the control channel.
func (w *Worker) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+pathRun, w.handleRun)
	mux.HandleFunc("POST "+pathStart, w.handleStart)
	mux.HandleFunc("GET "+pathStatus, w.handleStatus)
	mux.HandleFunc("GET "+pathResult, w.handleResult)
	mux.HandleFunc("GET "+pathAcked, w.handleAcked)
	mux.HandleFunc("POST "+pathStop, w.handleStop)
	want := []byte("Bearer " + w.cfg.Token)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			workerError(rw, http.StatusUnauthorized, "wrong or missing worker token: give the controller the worker's --token (--worker-token)")
			return
		}
		select {
		case w.sem <- struct{}{}:
			defer func() { <-w.sem }()
		default:
			workerError(rw, http.StatusServiceUnavailable, "too many control requests at once")
			return
		}
		w.lastSeen.Store(time.Now().UnixNano())
		r.Body = http.MaxBytesReader(rw, r.Body, maxPlanBytes)
		mux.ServeHTTP(rw, r)
	})
}

// NewWorkerServer is the worker's HTTP server: every phase of a request has
// a deadline (the acknowledged-readings stream may take minutes).
func NewWorkerServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: 15 * time.Minute, IdleTimeout: time.Minute, MaxHeaderBytes: 16 << 10}
}

func workerError(rw http.ResponseWriter, status int, msg string) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(map[string]string{"error": msg})
}

func workerJSON(rw http.ResponseWriter, v any) {
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(v)
}

func (w *Worker) handleRun(rw http.ResponseWriter, r *http.Request) {
	var p Plan
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil {
		workerError(rw, http.StatusBadRequest, "plan: "+err.Error())
		return
	}
	if err := p.validate(&w.cfg); err != nil {
		workerError(rw, http.StatusForbidden, err.Error())
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.cur; c != nil && c.state != stateDone && c.state != stateFailed {
		workerError(rw, http.StatusConflict, fmt.Sprintf("busy with run %s (%s)", c.plan.Run, c.state))
		return
	}
	ctx, cancel := context.WithCancel(w.ctx)
	run := &workerRun{plan: p, cancel: cancel, state: stateSetup, startc: make(chan time.Time, 1)}
	w.cur = run
	fmt.Fprintf(w.cfg.Log, "worker: run %s: %d kettles (fleet index %d, every %d) of %d → %s\n", p.Run, p.Devices, p.First, max(p.Stride, 1), p.Fleet, p.Target)
	w.wg.Add(2)
	go func() { defer w.wg.Done(); w.execute(ctx, run) }()
	go func() { defer w.wg.Done(); w.watchdog(ctx, run) }()
	rw.WriteHeader(http.StatusAccepted)
	workerJSON(rw, map[string]string{"run": p.Run, "state": string(stateSetup)})
}

// execute runs the shard to its end.
func (w *Worker) execute(ctx context.Context, run *workerRun) {
	defer run.cancel()
	cfg := run.plan.config(&w.cfg)
	cfg.Ready = func(ctx context.Context) (time.Time, error) {
		w.setState(run, stateReady, "")
		select {
		case at := <-run.startc:
			w.setState(run, stateRunning, "")
			return at, nil
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
	cfg.OnSecond = func(s Second) {
		w.mu.Lock()
		run.seconds = append(run.seconds, s)
		w.mu.Unlock()
	}
	res, err := Run(ctx, cfg)
	w.mu.Lock()
	run.res = res
	w.mu.Unlock()
	if err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			err = cause
		}
		fmt.Fprintf(w.cfg.Log, "worker: run %s failed: %v\n", run.plan.Run, err)
		w.setState(run, stateFailed, err.Error())
		return
	}
	fmt.Fprintf(w.cfg.Log, "worker: run %s done: %d requests, %d readings acknowledged\n", run.plan.Run, res.Totals.Requests, res.Totals.Acked)
	w.setState(run, stateDone, "")
}

// watchdog stops a run whose controller went silent.
func (w *Worker) watchdog(ctx context.Context, run *workerRun) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if silent := time.Since(time.Unix(0, w.lastSeen.Load())); silent > w.cfg.Orphan {
				fmt.Fprintf(w.cfg.Log, "worker: run %s: no word from the controller for %s: stopping it\n", run.plan.Run, silent.Round(time.Second))
				w.setState(run, stateFailed, "stopped: the controller was silent for "+silent.Round(time.Second).String())
				run.cancel()
				return
			}
		}
	}
}

func (w *Worker) setState(run *workerRun, state WorkerState, msg string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if run.state == stateFailed {
		return // the first failure stands
	}
	run.state, run.err = state, msg
}

// current returns the run named by the request's run parameter.
func (w *Worker) current(rw http.ResponseWriter, r *http.Request) *workerRun {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cur == nil || w.cur.plan.Run != r.URL.Query().Get("run") {
		workerError(rw, http.StatusNotFound, "no such run on this worker (restarted, or another controller's run)")
		return nil
	}
	return w.cur
}

func (w *Worker) handleStart(rw http.ResponseWriter, r *http.Request) {
	run := w.current(rw, r)
	if run == nil {
		return
	}
	var body struct {
		At time.Time `json:"at"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.At.IsZero() {
		workerError(rw, http.StatusBadRequest, `want {"at": RFC 3339 time}`)
		return
	}
	w.mu.Lock()
	state := run.state
	w.mu.Unlock()
	if state != stateReady {
		workerError(rw, http.StatusConflict, "run is "+string(state)+", not ready")
		return
	}
	select {
	case run.startc <- body.At:
		workerJSON(rw, map[string]string{"run": run.plan.Run, "state": string(stateRunning)})
	default:
		workerError(rw, http.StatusConflict, "already started")
	}
}

func (w *Worker) handleStatus(rw http.ResponseWriter, r *http.Request) {
	run := w.current(rw, r)
	if run == nil {
		return
	}
	after, _ := strconv.Atoi(r.URL.Query().Get("after"))
	w.mu.Lock()
	st := WorkerStatus{Run: run.plan.Run, State: run.state, Error: run.err}
	for _, s := range run.seconds {
		if s.T > after && len(st.Seconds) < maxStatusSeconds {
			st.Seconds = append(st.Seconds, s)
		}
	}
	w.mu.Unlock()
	st.CPUSeconds, st.RSSBytes = cpuSeconds(), rss()
	workerJSON(rw, st)
}

// finished is the current run's result, or nil once it answered that there
// is none yet (the run is not done: 409 naming what is missing).
func (w *Worker) finished(rw http.ResponseWriter, r *http.Request, what string) *Results {
	run := w.current(rw, r)
	if run == nil {
		return nil
	}
	w.mu.Lock()
	state, res := run.state, run.res
	w.mu.Unlock()
	if state != stateDone || res == nil {
		workerError(rw, http.StatusConflict, "run is "+string(state)+": no "+what)
		return nil
	}
	return res
}

func (w *Worker) handleResult(rw http.ResponseWriter, r *http.Request) {
	if res := w.finished(rw, r, "result"); res != nil {
		workerJSON(rw, res)
	}
}

// handleAcked streams the acknowledged readings, one device a line.
func (w *Worker) handleAcked(rw http.ResponseWriter, r *http.Request) {
	res := w.finished(rw, r, "acknowledged readings")
	if res == nil {
		return
	}
	rw.Header().Set("Content-Type", "application/x-ndjson")
	bw := bufio.NewWriterSize(rw, 64<<10)
	enc := json.NewEncoder(bw)
	for _, d := range res.Acked {
		if enc.Encode(d) != nil {
			return
		}
	}
	bw.WriteString("{}\n") // the end: a cut stream is told from a complete one
	bw.Flush()
}

func (w *Worker) handleStop(rw http.ResponseWriter, r *http.Request) {
	run := w.current(rw, r)
	if run == nil {
		return
	}
	run.cancel()
	workerJSON(rw, map[string]string{"run": run.plan.Run, "state": "stopping"})
}

// ServeWorker serves w on l until ctx ends, then stops the run.
func ServeWorker(ctx context.Context, l net.Listener, w *Worker) error {
	srv := NewWorkerServer(w.Handler())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case <-ctx.Done():
	case err := <-errc:
		w.Close()
		return err
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	w.Close()
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// LoopbackSource returns the IPv4 loopback address of a worker's listen
// address, or nil: a worker on 127.0.45.12 sends its shard from
// 127.0.45.12 too, so each worker has its own ephemeral ports and the
// server's logs tell the shards apart.
func LoopbackSource(hostport string) net.IP {
	h, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	if ip == nil || !ip.IsLoopback() || ip.To4() == nil {
		return nil
	}
	return ip.To4()
}
