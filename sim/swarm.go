package sim

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/minheap"
	"github.com/kettlefleet/kettlefleet/wire"
)

// Config is one swarm run.
type Config struct {
	Target string // base URL of the server; must be loopback
	// TLS is the client side of an https:// Target (RootCAs: the server's
	// CA; ClientSessionCache: kettles resume sessions); nil: the system's
	// roots, no resumption. With an https Target, MQTT kettles speak TLS
	// to MQTTTarget too.
	TLS       *tls.Config
	Devices   int           // kettles
	Interval  time.Duration // between a kettle's readings
	Jitter    time.Duration // each send is due at phase + k×Interval ± Jitter
	HatchRate float64       // kettles started per second; 0 starts all at once with random phases
	Duration  time.Duration // whole run, hatching included
	API       string        // "v0" (case-study protocol) or "v1"
	// Protocol is how kettles talk: ProtocolHTTP (default: API decides v0
	// or v1) or ProtocolMQTT (v1 payloads over MQTT 5 to MQTTTarget; Target
	// stays the HTTP base URL for provisioning and the audit).
	Protocol     string
	MQTTTarget   string // host:port of the MQTT listener; must be loopback
	MQTTInflight int    // publishes a kettle may have awaiting PUBACK (0: 1)
	// MQTTKeepAlive is the MQTT keepalive (whole seconds); 0: twice the
	// interval, within 30 s..1 h.
	MQTTKeepAlive time.Duration
	Batch         int // v1: readings per upload (a kettle uploads when it has Batch buffered)
	// Conns is the number of shared connections; 0 means one keep-alive
	// connection per kettle. Both are capped by the fd budget (see FDBudget).
	Conns     int
	SourceIPs int // spread connections over 127.0.0.1..N (IPv4 loopback targets)
	// SourceAddrs, if set, are the source addresses to spread connections
	// over instead (e.g. one per swarm process when several share the
	// machine: each address has its own ephemeral ports).
	SourceAddrs []net.IP
	Timeout     time.Duration // per request, dial included
	Seed        uint64        // the kettles' physics and phases derive from it
	Secret      []byte        // v1: derive device tokens offline
	Operator    string        // operator token: v1 provisioning (without Secret) and the audit
	ReserveFDs  int           // file descriptors to leave to others (an in-process server)
	// Progress receives a live line every ProgressEvery (nil: none).
	Progress      io.Writer
	ProgressEvery time.Duration
	NoAudit       bool
	// AuditAfter, when set, is waited for before the audit: with a
	// readings log, the acknowledged readings are in the store only once
	// the writers drained it (kettle swarm --audit-after URL).
	AuditAfter    func(ctx context.Context) error
	InProcessNote string // recorded in Params, e.g. when the server shares this process
	// SLOP99 and MaxErrorRate are recorded in Params for the report (the
	// caller judges the run).
	SLOP99       time.Duration
	MaxErrorRate float64
	// Log receives notes about caps and setup (nil: discard).
	Log io.Writer
	// Observer, if set, sees every request as it happens (kettle swarm
	// --metrics-addr: *metrics.Swarm).
	Observer Observer

	// The distributed lab (kettle swarm --workers): one shard of a fleet.
	//
	// First and Stride place this run in a fleet: kettle i of the shard
	// is kettle First+i×Stride of the fleet (Stride 0 counts as 1), with
	// that kettle's physics seed and hatch time, so shards of one fleet
	// never overlap, and strided shards hatch in step side by side.
	First, Stride int
	// AllowHosts names non-loopback hosts the operator allows as Target or
	// MQTTTarget (exact names or addresses; empty: loopback only).
	AllowHosts []string
	// Ready, if set, is called once the kettles are set up; it returns the
	// wall-clock time the run starts (the fleet's common start) and the
	// run waits until then.
	Ready func(ctx context.Context) (time.Time, error)
	// OnSecond, if set, is given each Second as it closes (from the
	// collector's goroutine; it must not block).
	OnSecond func(Second)
	// ExportAcked fills Results.Acked with every acknowledged reading, for
	// an audit done elsewhere (the lab's controller audits all shards).
	ExportAcked bool
}

// Observer is told about requests as they happen; *metrics.Swarm is one.
// Calls come from many goroutines and must not block.
type Observer interface {
	// Offered: a request came due at its intended send time.
	Offered(endpoint string)
	// Completed: a response arrived, latency from the intended send time.
	Completed(endpoint string, status int, latency time.Duration)
	// Error: a request failed (kind as in results: timeout, conn, http_503 …).
	Error(endpoint, kind string)
	// SetActive and SetLag are called once a second.
	SetActive(n int)
	SetLag(d time.Duration)
}

// Protocols of Config.Protocol.
const (
	ProtocolHTTP = "http"
	ProtocolMQTT = "mqtt"
)

func (c *Config) defaults() {
	if c.Protocol == "" {
		c.Protocol = ProtocolHTTP
	}
	if c.Protocol == ProtocolMQTT {
		c.API = "v1"
		if c.MQTTInflight <= 0 {
			c.MQTTInflight = 1
		}
	}
	if c.Interval <= 0 {
		c.Interval = 30 * time.Second
	}
	if c.Jitter < 0 || c.Jitter > c.Interval/4 {
		c.Jitter = c.Interval / 4
	}
	if c.API == "" {
		c.API = "v1"
	}
	if c.Batch <= 0 || c.API == "v0" {
		c.Batch = 1
	}
	if c.Batch > kettle.MaxBatch {
		c.Batch = kettle.MaxBatch
	}
	if c.Timeout <= 0 {
		c.Timeout = 10 * time.Second
	}
	if c.SourceIPs <= 0 {
		c.SourceIPs = 1
	}
	if c.ProgressEvery <= 0 {
		c.ProgressEvery = 5 * time.Second
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
}

// CheckLoopback parses a target URL and refuses anything but this machine:
// a load test must never hit someone else's server by a typo.
func CheckLoopback(target string) (*url.URL, error) {
	u, err := url.Parse(target)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("--target %q: want http://HOST:PORT or https://HOST:PORT", target)
	}
	h := u.Hostname()
	ip := net.ParseIP(h)
	if !(strings.EqualFold(h, "localhost") || (ip != nil && ip.IsLoopback())) {
		return nil, fmt.Errorf("refusing --target %s: the swarm only loads this machine (127.0.0.0/8, ::1 or localhost)", target)
	}
	return u, nil
}

func ipStrings(ips []net.IP) []string {
	var s []string
	for _, ip := range ips {
		s = append(s, ip.String())
	}
	return s
}

// FDBudget is how many connections the swarm may open: the fd limit less a
// reserve for everything else in the process.
func FDBudget(reserve int) int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 1000
	}
	if rl.Cur < rl.Max { // Go raises the soft limit at start; be sure
		rl.Cur = rl.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
	}
	n := int(rl.Cur) - 200 - reserve
	if n < 1 {
		n = 1
	}
	return n
}

// maxPending bounds the readings a kettle buffers while the server does not
// acknowledge them; the oldest is dropped (and counted) beyond it.
const maxPending = kettle.MaxBatch

const (
	evTick  = 0
	evRetry = 1
	// evConnect = 2, evCheck = 3 (mqtt.go)
)

type event struct {
	at   int64 // ns since start
	k    int32
	kind uint8
}

// When orders the scheduler's heap.
func (e event) When() int64 { return e.at }

// pcg is a kettle's own seeded random source (16 bytes, no allocation).
type pcg struct{ rand.PCG }

func (p *pcg) Float64() float64 { return float64(p.Uint64()>>11) / (1 << 53) }

// work is what one exchange does: upload buffered readings, poll the command.
// at is the intended start (ns since start), from which latency is measured.
type work struct {
	upload, poll bool
	at           int64
}

func (w *work) merge(o work) {
	if !w.upload && !w.poll {
		*w = o
		return
	}
	w.upload = w.upload || o.upload
	w.poll = w.poll || o.poll
	w.at = min(w.at, o.at)
}

type kettleState struct {
	mu       sync.Mutex
	id       uuid.UUID
	auth     string // request header line(s) carrying the credential
	loggedIn bool
	inflight bool
	attempts uint8 // consecutive failed uploads
	ticks    int32
	rng      pcg
	model    Model
	phase    int64 // first tick, ns since start
	retryAt  int64 // no upload before this (backoff, Retry-After)
	pollAt   int64 // no poll before this (the last command's max-age)
	owed     work  // work that came due while an exchange was outstanding
	pending  []kettle.Measurement
	acked    ackLog // device times of acknowledged readings
	etag     string
	mq       *mqttKettle // MQTT kettles only
}

// Swarm is one run in progress.
type Swarm struct {
	cfg     Config
	base    string // path prefix of the target
	host    string
	pool    *pool
	kettles []kettleState
	start   time.Time
	endAt   int64
	heapMu  sync.Mutex
	heap    minheap.Heap[event]
	wg      sync.WaitGroup // exchanges outstanding
	// Exchanger goroutines (see startExchange): idle ones wait on idle.
	idle       chan job
	idleStop   chan struct{}
	exchangers sync.WaitGroup
	readers    sync.WaitGroup // MQTT: connection attempts, readers, flushers (mqttClose ends them)
	stop       atomic.Bool
	st         *stats
	hatched    atomic.Int64
	busy       atomic.Int64
	params     Params
	http       *httpClient
	mqDial     func() (net.Conn, error) // MQTT: dials the listener
	// cpuStart is the process CPU when the run started.
	cpuStart float64
}

func (s *Swarm) now() int64              { return int64(time.Since(s.start)) }
func (s *Swarm) wall(ns int64) time.Time { return s.start.Add(time.Duration(ns)) }

// Run runs a swarm to the end of its duration (or ctx), audits it unless
// NoAudit, and returns the results. An error means the run could not be done;
// a bad audit or latency is in the results, for the caller to judge.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	cfg.defaults()
	u, err := CheckTarget(cfg.Target, cfg.AllowHosts)
	if err != nil {
		return nil, err
	}
	if cfg.Devices <= 0 {
		return nil, fmt.Errorf("--devices must be > 0, got %d", cfg.Devices)
	}
	if cfg.Duration <= 0 {
		return nil, fmt.Errorf("--duration must be > 0")
	}
	if cfg.API != "v0" && cfg.API != "v1" {
		return nil, fmt.Errorf("--api %q: want v0 or v1", cfg.API)
	}
	addr := u.Host
	if strings.EqualFold(u.Hostname(), "localhost") {
		addr = net.JoinHostPort("127.0.0.1", u.Port())
	}
	var tlsCfg *tls.Config
	if u.Scheme == "https" {
		tlsCfg = &tls.Config{}
		if cfg.TLS != nil {
			tlsCfg = cfg.TLS.Clone()
		}
		tlsCfg.ServerName = u.Hostname()
		cfg.TLS = tlsCfg
	}
	if u.Port() == "" {
		port := "80"
		if tlsCfg != nil {
			port = "443"
		}
		addr = net.JoinHostPort(strings.Trim(addr, "[]"), port)
	}
	if cfg.Protocol != ProtocolHTTP && cfg.Protocol != ProtocolMQTT {
		return nil, fmt.Errorf("--protocol %q: want http or mqtt", cfg.Protocol)
	}
	s := &Swarm{cfg: cfg, base: strings.TrimRight(u.Path, "/"), host: u.Host, st: newStats(cfg.API, cfg.Protocol),
		idle: make(chan job), idleStop: make(chan struct{})}
	s.st.obs = cfg.Observer
	s.http = newHTTPClient(strings.TrimRight(cfg.Target, "/"), cfg.Operator, tlsCfg)

	budget := FDBudget(cfg.ReserveFDs)
	var n int
	var mode string
	if cfg.Protocol == ProtocolMQTT {
		var err error
		if n, err = s.mqttSetup(budget); err != nil {
			return nil, err
		}
		mode = "per-device"
	} else {
		perDevice := cfg.Conns <= 0
		n = min(cfg.Conns, cfg.Devices)
		mode = "shared"
		if perDevice {
			n, mode = cfg.Devices, "per-device"
		}
		if n > budget {
			fmt.Fprintf(cfg.Log, "swarm: %d connections wanted but the fd limit leaves %d (ulimit -n; %d reserved): ", n, budget, cfg.ReserveFDs)
			if perDevice {
				fmt.Fprintf(cfg.Log, "kettle i uses connection i mod %d\n", budget)
			} else {
				fmt.Fprintf(cfg.Log, "capped to %d\n", budget)
			}
			n = budget
		}
		checkSourcePorts(cfg.Log, n, sourceAddrs(&cfg, addr))
		s.pool = newPool(n, perDevice, dialer(addr, sourceAddrs(&cfg, addr), cfg.Timeout, tlsCfg))
		if tlsCfg != nil {
			// One handshake first: a certificate the swarm does not trust
			// is said now, not counted as every request's error.
			c, err := s.pool.dial(&pool{})
			if err != nil {
				return nil, err
			}
			c.Close()
		}
	}

	s.params = Params{
		Target: cfg.Target, API: cfg.API, Devices: cfg.Devices, IntervalS: cfg.Interval.Seconds(),
		JitterS: cfg.Jitter.Seconds(), HatchRate: cfg.HatchRate, DurationS: cfg.Duration.Seconds(),
		Batch: cfg.Batch, ConnMode: mode, Conns: n, SourceIPs: cfg.SourceIPs, SourceAddrs: ipStrings(cfg.SourceAddrs), TimeoutS: cfg.Timeout.Seconds(),
		TLS: tlsCfg != nil, TLSResume: tlsCfg != nil && tlsCfg.ClientSessionCache != nil,
		Seed: cfg.Seed, GOMAXPROCS: runtime.GOMAXPROCS(0), InProcessNote: cfg.InProcessNote,
		SLOP99Ms: float64(cfg.SLOP99) / 1e6, MaxErrorRate: max(cfg.MaxErrorRate, 0),
	}
	if cfg.Protocol == ProtocolMQTT {
		s.params.Protocol, s.params.MQTTTarget, s.params.MQTTInflight = cfg.Protocol, cfg.MQTTTarget, cfg.MQTTInflight
	}
	if err := s.setup(ctx); err != nil {
		return nil, err
	}
	return s.run(ctx)
}

// fleetIndex is kettle i's index in the whole fleet (see Config.First).
func (s *Swarm) fleetIndex(i int) int { return s.cfg.First + i*max(s.cfg.Stride, 1) }

// setup creates the kettles and their credentials.
func (s *Swarm) setup(ctx context.Context) error {
	cfg := &s.cfg
	s.kettles = make([]kettleState, cfg.Devices)
	s.start = time.Now()
	switch {
	case cfg.API == "v0":
		s.params.Provisioning = "login"
	case len(cfg.Secret) > 0:
		s.params.Provisioning = "secret"
	case cfg.Operator != "":
		s.params.Provisioning = "operator"
	default:
		return errors.New("--api v1 needs device tokens: give --secret (offline provisioning), --operator-token (POST /v1/devices) or --data-dir of the server")
	}
	var provisioned []provisionedDevice
	if s.params.Provisioning == "operator" {
		var err error
		if provisioned, err = s.http.provision(ctx, cfg.Devices); err != nil {
			return err
		}
	}
	iv := int64(cfg.Interval)
	for i := range s.kettles {
		k := &s.kettles[i]
		g := s.fleetIndex(i)
		k.rng.Seed(cfg.Seed, uint64(g)*0x9e3779b97f4a7c15+1)
		k.model = NewModel(&k.rng, s.start)
		switch s.params.Provisioning {
		case "secret":
			k.id = uuid.New()
			k.auth = "Authorization: Bearer " + kettle.DeviceToken(cfg.Secret, k.id) + "\r\n"
		case "operator":
			k.id = provisioned[i].ID
			k.auth = "Authorization: Bearer " + provisioned[i].Token + "\r\n"
		}
		if cfg.HatchRate > 0 {
			k.phase = int64(float64(g) / cfg.HatchRate * 1e9)
		} else {
			k.phase = int64(k.rng.Float64() * float64(iv))
		}
		k.pending = make([]kettle.Measurement, 0, cfg.Batch)
		if cfg.Protocol == ProtocolMQTT {
			k.mq = &mqttKettle{owedAt: -1, user: k.id.String(), pass: strings.TrimSuffix(strings.TrimPrefix(k.auth, "Authorization: Bearer "), "\r\n")}
		}
	}
	// The schedule: every kettle's first tick.
	s.heap = make(minheap.Heap[event], 0, cfg.Devices+cfg.Devices/8)
	for i := range s.kettles {
		s.heap.Push(event{at: s.kettles[i].phase, k: int32(i)})
	}
	// Setup's garbage (provisioning answers, token derivation) goes back
	// to the system before the run: the run's RSS is then the kettles'
	// state and what the run itself needs, not a high-water mark of setup.
	debug.FreeOSMemory()
	// The run clock starts now, or at the fleet's common start: phases are
	// relative to it.
	s.start = time.Now()
	if cfg.Ready != nil {
		at, err := cfg.Ready(ctx)
		if err != nil {
			return err
		}
		if late := time.Since(at); late > time.Second {
			return fmt.Errorf("the fleet's start %s passed %s ago: are the machines' clocks in step (NTP)?", at.UTC().Format(time.RFC3339Nano), late.Round(time.Millisecond))
		}
		t := time.NewTimer(time.Until(at))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
		s.start = at
	}
	for i := range s.kettles {
		s.kettles[i].model.Last = s.start
	}
	s.endAt = int64(cfg.Duration)
	return nil
}

func (s *Swarm) run(ctx context.Context) (*Results, error) {
	res := &Results{Schema: SchemaVersion, Params: s.params, Start: s.start}
	s.cpuStart = cpuSeconds()
	collectDone := make(chan struct{})
	collectStop := make(chan struct{})
	go func() { defer close(collectDone); s.collect(res, collectStop) }()

	s.dispatch(ctx)
	s.stop.Store(true)
	// Outstanding exchanges end by their own deadlines.
	waited := make(chan struct{})
	go func() { s.wg.Wait(); close(waited) }()
	select {
	case <-waited:
		close(s.idleStop)
		s.exchangers.Wait()
	case <-time.After(2*s.cfg.Timeout + 5*time.Second):
		fmt.Fprintf(s.cfg.Log, "swarm: %d exchanges still outstanding at the end; their readings count as unacknowledged\n", s.busy.Load())
		close(s.idleStop) // the stuck ones end by their own deadlines
	}
	if s.cfg.Protocol == ProtocolMQTT {
		s.mqttDrain()
	}
	close(collectStop)
	<-collectDone
	s.pool.closeAll()
	if s.cfg.Protocol == ProtocolMQTT {
		s.mqttClose()
	}
	res.End = time.Now()
	s.totals(res)
	if s.cfg.ExportAcked {
		res.Acked = s.ackedDevices()
	}

	if !s.cfg.NoAudit && s.cfg.Operator != "" {
		// An interrupted run is still worth auditing.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		if s.cfg.AuditAfter != nil {
			if err := s.cfg.AuditAfter(actx); err != nil {
				cancel()
				return res, fmt.Errorf("audit: waiting for --audit-after: %w", err)
			}
		}
		a, err := s.audit(actx)
		cancel()
		if err != nil {
			return res, fmt.Errorf("audit: %w", err)
		}
		res.Audit = a
	}
	return res, nil
}

// dispatch is the open-model scheduler: one goroutine pops due events off
// the heap and starts exchanges whether or not earlier ones returned.
func (s *Swarm) dispatch(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var due, next []event
	for {
		now := s.now()
		if now >= s.endAt || ctx.Err() != nil {
			return
		}
		due = due[:0]
		s.heapMu.Lock()
		for len(s.heap) > 0 && s.heap[0].at <= now && s.heap[0].at < s.endAt {
			due = append(due, s.heap.Pop())
		}
		wait := 50 * time.Millisecond
		if len(s.heap) > 0 {
			wait = min(wait, time.Duration(s.heap[0].at-now))
		}
		s.heapMu.Unlock()

		next = next[:0]
		for _, ev := range due {
			s.st.lag(now - ev.at)
			if n, ok := s.fire(ev); ok {
				next = append(next, n)
			}
		}
		if len(next) > 0 {
			s.heapMu.Lock()
			for _, n := range next {
				s.heap.Push(n)
			}
			s.heapMu.Unlock()
		}
		if len(due) > 0 {
			continue // catch up before sleeping
		}
		wait = min(wait, time.Duration(s.endAt-now))
		if wait <= 0 {
			continue
		}
		timer.Reset(wait)
		select {
		case <-timer.C:
		case <-ctx.Done():
			return
		}
	}
}

// tick advances a kettle's model to a due tick, buffers its reading (the
// oldest is dropped past maxPending) and returns its next tick. The caller
// holds k.mu. Shared by the HTTP and MQTT paths.
func (s *Swarm) tick(k *kettleState, ev event) event {
	if k.ticks == 0 {
		s.hatched.Add(1)
	}
	k.model.Step(&k.rng, s.tickTime(k, ev.at))
	if len(k.pending) >= maxPending {
		copy(k.pending, k.pending[1:])
		k.pending = k.pending[:len(k.pending)-1]
		s.st.add(&s.st.dropped, 1)
	}
	k.pending = append(k.pending, k.model.Reading())
	s.st.add(&s.st.readings, 1)
	k.ticks++
	j := int64(0)
	if s.cfg.Jitter > 0 {
		j = int64((2*k.rng.Float64() - 1) * float64(s.cfg.Jitter))
	}
	return event{at: k.phase + int64(k.ticks)*int64(s.cfg.Interval) + j, k: ev.k}
}

// fire handles one due event and returns the kettle's next tick.
func (s *Swarm) fire(ev event) (event, bool) {
	if s.cfg.Protocol == ProtocolMQTT {
		return s.fireMQTT(ev)
	}
	k := &s.kettles[ev.k]
	k.mu.Lock()
	var w work
	var next event
	hasNext := false
	if ev.kind == evTick {
		next, hasNext = s.tick(k, ev), true
		// A command answered with max-age holds until then: the server
		// asked for fewer polls (it does so while overloaded).
		w.poll = ev.at >= k.pollAt
		if !w.poll {
			s.st.add(&s.st.pollsDeferred, 1)
		}
		w.upload = len(k.pending) >= s.cfg.Batch && ev.at >= k.retryAt
	} else {
		w.upload = len(k.pending) > 0 && ev.at >= k.retryAt
	}
	w.at = ev.at
	if w.poll {
		s.st.offer(epCommand)
	}
	if w.upload {
		s.st.offer(epMeasurement)
	}
	switch {
	case !w.upload && !w.poll:
	case k.inflight:
		k.owed.merge(w)
		s.st.add(&s.st.late, 1)
	default:
		k.inflight = true
		s.busy.Add(1)
		s.wg.Add(1)
		s.startExchange(int(ev.k), w)
	}
	k.mu.Unlock()
	return next, hasNext
}

// exchangerIdle is how long an exchanger goroutine waits for its next
// exchange before it ends.
const exchangerIdle = 2 * time.Second

type job struct {
	i int
	w work
}

// startExchange hands kettle i's work to an idle exchanger goroutine, or
// starts one: the open model never waits for a free one. Exchangers
// outlive their exchange by up to exchangerIdle, so their stacks, grown by
// the first request, serve the next ones instead of growing again in a
// fresh goroutine each time.
func (s *Swarm) startExchange(i int, w work) {
	select {
	case s.idle <- job{i, w}:
	default:
		s.exchangers.Add(1)
		go s.exchanger(job{i, w})
	}
}

// exchanger runs exchanges until it has been idle for exchangerIdle or the
// run ends (s.idleStop).
func (s *Swarm) exchanger(j job) {
	defer s.exchangers.Done()
	t := time.NewTimer(exchangerIdle)
	defer t.Stop()
	for {
		s.exchange(j.i, j.w)
		t.Reset(exchangerIdle)
		select {
		case j = <-s.idle:
		case <-t.C:
			return
		case <-s.idleStop:
			return
		}
	}
}

// exchange runs a kettle's work, then whatever came due meanwhile.
func (s *Swarm) exchange(i int, w work) {
	defer s.wg.Done()
	defer s.busy.Add(-1)
	k := &s.kettles[i]
	for {
		s.runWork(i, k, w)
		k.mu.Lock()
		o := k.owed
		k.owed = work{}
		if o.upload && (len(k.pending) == 0 || s.now() < k.retryAt) {
			o.upload = false
		}
		if (o.upload || o.poll) && !s.stop.Load() {
			k.mu.Unlock()
			w = o
			continue
		}
		k.inflight = false
		k.mu.Unlock()
		return
	}
}

// retry schedules kettle i's buffered readings after a failed upload:
// exponential backoff from 1 s with jitter, at least Retry-After, at most the
// interval (by then the next tick uploads anyway).
func (s *Swarm) retryLater(i int, k *kettleState, retryAfter time.Duration) {
	k.mu.Lock()
	if k.attempts < 16 {
		k.attempts++
	}
	back := time.Second << (k.attempts - 1)
	back = time.Duration(float64(back) * (0.5 + k.rng.Float64()))
	back = min(back, s.cfg.Interval)
	back = max(back, retryAfter)
	at := s.now() + int64(back)
	k.retryAt = at
	k.mu.Unlock()
	s.heapMu.Lock()
	s.heap.Push(event{at: at, k: int32(i), kind: evRetry})
	s.heapMu.Unlock()
}

// send does one request on kettle i's slot and records it; intended is the
// time it was due (ns since start).
func (s *Swarm) send(sl *slot, ep int, intended int64, method, path, headers string, body []byte) (response, bool) {
	bp := bufPool.Get().(*[]byte)
	raw := buildRequest((*bp)[:0], method, s.host, s.base+path, headers, body)
	resp, err := s.pool.do(sl, raw, time.Now().Add(s.cfg.Timeout))
	*bp = raw
	bufPool.Put(bp)
	lat := s.now() - intended
	ok := err == nil && resp.status/100 == 2 || resp.status == 304
	s.st.record(ep, lat, resp.status, err)
	return resp, ok
}

func (s *Swarm) runWork(i int, k *kettleState, w work) {
	ep := epCommand
	if w.upload {
		ep = epMeasurement
	}
	sl, err := s.pool.get(i, time.Now().Add(s.cfg.Timeout))
	if err != nil {
		s.st.record(ep, s.now()-w.at, 0, err)
		if w.upload {
			s.retryLater(i, k, 0)
		}
		return
	}
	defer s.pool.put(i, sl)
	at := w.at
	if s.cfg.API == "v0" && !k.loggedIn {
		s.st.offer(epLogin)
		body := fmt.Appendf(nil, `{"username":"kettle-%d"}`, s.fleetIndex(i))
		resp, ok := s.send(sl, epLogin, at, "POST", "/login", "", body)
		at = s.now()
		var lr struct {
			Username string `json:"username"`
		}
		if !ok || json.Unmarshal(resp.body, &lr) != nil {
			s.retryLater(i, k, resp.retryAfter)
			return
		}
		id, err := uuid.Parse(lr.Username)
		if err != nil {
			s.retryLater(i, k, 0)
			return
		}
		k.mu.Lock()
		k.id, k.auth, k.loggedIn = id, "servant-auth-cookie: "+lr.Username+"\r\n", true
		k.mu.Unlock()
	}
	if w.upload {
		at = s.upload(i, k, sl, at)
	}
	if w.poll {
		s.poll(k, sl, at)
	}
}

// upload sends the buffered readings (v1: up to MaxBatch in one request; v0:
// one per request) and returns when the next request may start.
func (s *Swarm) upload(i int, k *kettleState, sl *slot, at int64) int64 {
	var times []int64
	for range 100 {
		k.mu.Lock()
		n := len(k.pending)
		if n == 0 {
			k.mu.Unlock()
			return at
		}
		if s.cfg.API == "v0" {
			n = 1
		}
		n = min(n, kettle.MaxBatch)
		bp := bufPool.Get().(*[]byte)
		body := (*bp)[:0]
		times = times[:0]
		body = appendUpload(body, k.pending[:n], s.cfg.API)
		for _, m := range k.pending[:n] {
			times = append(times, m.Time.UnixMicro())
		}
		auth := k.auth
		k.mu.Unlock()

		path := "/v1/measurements"
		if s.cfg.API == "v0" {
			path = "/measurement"
		}
		resp, ok := s.send(sl, epMeasurement, at, "POST", path, auth, body)
		*bp = body
		bufPool.Put(bp)
		at = s.now()
		if !ok {
			s.retryLater(i, k, resp.retryAfter)
			return at
		}
		if s.cfg.API == "v1" {
			var sr struct {
				Duplicates int64 `json:"duplicates"`
			}
			if json.Unmarshal(resp.body, &sr) == nil && sr.Duplicates > 0 {
				s.st.add(&s.st.dupReported, sr.Duplicates)
			}
		}
		last := times[len(times)-1]
		k.mu.Lock()
		for _, t := range times {
			k.acked.add(t)
		}
		// Readings are buffered in time order; drop those just acknowledged
		// (the buffer may have shifted while the request was out).
		d := 0
		for d < len(k.pending) && k.pending[d].Time.UnixMicro() <= last {
			d++
		}
		k.pending = append(k.pending[:0], k.pending[d:]...)
		k.attempts, k.retryAt = 0, 0
		k.mu.Unlock()
		s.st.add(&s.st.acked, int64(len(times)))
		if s.stop.Load() {
			return at
		}
	}
	return at
}

// poll fetches the command and makes the model obey it.
func (s *Swarm) poll(k *kettleState, sl *slot, at int64) {
	k.mu.Lock()
	headers := k.auth
	if k.etag != "" {
		headers += "If-None-Match: " + k.etag + "\r\n"
	}
	k.mu.Unlock()
	path := "/v1/command"
	if s.cfg.API == "v0" {
		path = "/command"
	}
	resp, ok := s.send(sl, epCommand, at, "GET", path, headers, nil)
	if ok && resp.maxAge > 0 {
		k.mu.Lock()
		k.pollAt = s.now() + int64(resp.maxAge)
		k.mu.Unlock()
	}
	if !ok || resp.status != 200 {
		return
	}
	c, err := parseCommand(resp.body, s.cfg.API)
	if err != nil {
		s.st.record(epCommand, -1, 0, fmt.Errorf("bad command body: %w", err))
		return
	}
	k.mu.Lock()
	k.etag = resp.etag
	k.model.Obey(&k.rng, time.Now(), c)
	k.mu.Unlock()
}

// parseCommand is a command body of api as the model obeys it.
func parseCommand(b []byte, api string) (Command, error) {
	c, err := wire.ParseCommand(b, api)
	return Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.FlushMLPerS}, err
}

// appendUpload appends readings as one upload body of api: v0 takes one
// reading a request, v1 one or an array.
func appendUpload(b []byte, ms []kettle.Measurement, api string) []byte {
	if api == "v0" {
		return wire.AppendV0(b, &ms[0])
	}
	return wire.AppendV1Upload(b, ms)
}

// tickTime is the device time of a reading due at ns: its intended time, but
// strictly after the model's clock. A command obeyed while the dispatcher ran
// late has already moved the clock past that tick's intended time; without
// this the reading would repeat the previous one's device time, and the
// store (idempotent on device and time) would keep only one of the two.
func (s *Swarm) tickTime(k *kettleState, ns int64) time.Time {
	t := s.wall(ns)
	if last := k.model.Last; !t.After(last) {
		t = last.Add(kettle.TimePrecis)
	}
	return t
}
