package sim

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/minheap"
)

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
	// gen is the kettle's join generation its tick belongs to (a shaped
	// fleet): a tick left from before the kettle last left is dropped.
	gen uint16
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
	acked    ackLog      // device times of acknowledged readings
	etag     string      // of the command obeyed
	mq       *mqttKettle // MQTT kettles only
	// A shaped fleet (Config.Stages): in the fleet now, and how many
	// times it joined. Only the dispatcher touches them.
	active bool
	gen    uint16
	// dropConn: it left while its exchange held its connection, which
	// closes when the exchange ends (k.mu).
	dropConn bool
}

// Swarm is one run in progress.
type Swarm struct {
	cfg     Config
	base    string // path prefix of the target
	host    string
	pool    *pool
	kettles []kettleState
	// The kettles' device tokens end to end, kettle i's ending at
	// tokenEnd[i]: one allocation for the fleet instead of one each.
	tokens   []byte
	tokenEnd []uint32
	start    time.Time
	endAt    int64
	heapMu   sync.Mutex
	heap     minheap.Heap[event]
	wg       sync.WaitGroup // exchanges outstanding
	stop     atomic.Bool
	st       *stats
	shape    *shape // nil: the fleet hatches (Config.HatchRate) and stays
	hatched  atomic.Int64
	busy     atomic.Int64
	params   Params
	http     *httpClient
	tr       transport
	// cpuStart is the process CPU when the run started.
	cpuStart float64
	// clock is the wall clock the kettles' models start from (nil:
	// time.Now); tests fix it, since a model's ambient temperature follows
	// the time of day.
	clock func() time.Time
}

func (s *Swarm) now() int64              { return int64(time.Since(s.start)) }
func (s *Swarm) wall(ns int64) time.Time { return s.start.Add(time.Duration(ns)) }

// Run runs a swarm to the end of its duration (or ctx), audits it unless
// NoAudit, and returns the results. An error means the run could not be done;
// a bad audit or latency is in the results, for the caller to judge.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	if errs := cfg.Validate(); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	cfg.defaults()
	u, err := CheckTarget(cfg.Target, cfg.AllowHosts)
	if err != nil {
		return nil, err
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
	s := &Swarm{cfg: cfg, base: strings.TrimRight(u.Path, "/"), host: u.Host, st: newStats(cfg.API, cfg.Protocol)}
	s.st.obs = cfg.Observer
	s.http = newHTTPClient(strings.TrimRight(cfg.Target, "/"), cfg.Operator, tlsCfg)

	if cfg.Protocol == ProtocolMQTT {
		s.tr = &mqttTransport{Swarm: s}
	} else {
		s.tr = &httpTransport{Swarm: s, addr: addr, tls: tlsCfg, idle: make(chan job), idleStop: make(chan struct{})}
	}
	n, mode, err := s.tr.open(FDBudget(cfg.ReserveFDs))
	if err != nil {
		return nil, err
	}

	s.params = cfg.params()
	s.params.ConnMode, s.params.Conns, s.params.SourceIPs, s.params.SourceAddrs = mode, n, cfg.SourceIPs, ipStrings(cfg.SourceAddrs)
	s.params.TLS, s.params.TLSResume = tlsCfg != nil, tlsCfg != nil && tlsCfg.ClientSessionCache != nil
	s.params.InProcessNote = cfg.InProcessNote
	s.tr.describe(&s.params)
	if err := s.setup(ctx); err != nil {
		return nil, err
	}
	return s.run(ctx)
}

// token is kettle i's device token (empty: none, API v0).
func (s *Swarm) token(i int) []byte {
	from := uint32(0)
	if i > 0 {
		from = s.tokenEnd[i-1]
	}
	return s.tokens[from:s.tokenEnd[i]]
}

// fleetIndex is kettle i's index in the whole fleet (see Config.First).
func (s *Swarm) fleetIndex(i int) int { return s.cfg.First + i*max(s.cfg.Stride, 1) }

// setup creates the kettles and their credentials.
func (s *Swarm) setup(ctx context.Context) error {
	cfg := &s.cfg
	s.kettles = make([]kettleState, cfg.Devices)
	s.start = time.Now()
	if s.clock != nil {
		s.start = s.clock()
	}
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
	s.tokenEnd = make([]uint32, cfg.Devices)
	switch s.params.Provisioning {
	case "secret":
		s.tokens = make([]byte, 0, cfg.Devices*len(kettle.DeviceToken(cfg.Secret, uuid.UUID{})))
	case "operator":
		n := 0
		for _, p := range provisioned {
			n += len(p.Token)
		}
		s.tokens = make([]byte, 0, n)
	}
	for i := range s.kettles {
		k := &s.kettles[i]
		g := s.fleetIndex(i)
		k.rng.Seed(cfg.Seed, uint64(g)*0x9e3779b97f4a7c15+1)
		k.model = NewModel(&k.rng, s.start)
		switch s.params.Provisioning {
		case "secret":
			k.id = uuid.New()
			s.tokens = append(s.tokens, kettle.DeviceToken(cfg.Secret, k.id)...)
		case "operator":
			k.id = provisioned[i].ID
			s.tokens = append(s.tokens, provisioned[i].Token...)
		}
		s.tokenEnd[i] = uint32(len(s.tokens))
		if cfg.HatchRate > 0 {
			k.phase = int64(float64(g) / cfg.HatchRate * 1e9)
		} else {
			k.phase = int64(k.rng.Float64() * float64(iv))
		}
		s.tr.initKettle(i, k)
	}
	// The schedule: every kettle's first tick, or first join.
	s.heap = make(minheap.Heap[event], 0, cfg.Devices+cfg.Devices/8)
	s.endAt = int64(cfg.Duration)
	if len(cfg.Stages) > 0 {
		s.shape = newShape(cfg.Stages)
		s.shapeSetup()
	} else {
		for i := range s.kettles {
			s.heap.Push(event{at: s.kettles[i].phase, k: int32(i)})
		}
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
	finished := true
	select {
	case <-waited:
	case <-time.After(2*s.cfg.Timeout + 5*time.Second):
		fmt.Fprintf(s.cfg.Log, "swarm: %d exchanges still outstanding at the end; their readings count as unacknowledged\n", s.busy.Load())
		finished = false // the stuck ones end by their own deadlines
	}
	s.tr.drain(finished)
	close(collectStop)
	<-collectDone
	s.tr.close()
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
			if s.shape != nil && !s.shapeFire(ev, &next) {
				continue
			}
			if n, ok := s.tr.fire(ev); ok {
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
	if k.ticks == 0 && s.shape == nil {
		s.hatched.Add(1) // a shaped fleet counts its joins
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
	return event{at: k.phase + int64(k.ticks)*int64(s.cfg.Interval) + j, k: ev.k, gen: ev.gen}
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
