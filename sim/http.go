package sim

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// transport is how kettles talk to the server; the scheduler (swarm.go)
// hands it due events and knows nothing of the protocol. httpTransport
// speaks HTTP (the case-study protocol, v0, or v1), mqttTransport MQTT 5.
type transport interface {
	// open prepares the connections within budget file descriptors and
	// returns how many the run holds and how they are shared.
	open(budget int) (n int, mode string, err error)
	// describe records the transport's parameters in the results.
	describe(p *Params)
	// initKettle prepares kettle i, whose credentials are set.
	initKettle(i int, k *kettleState)
	// fire handles one due event and returns the kettle's next tick.
	fire(ev event) (event, bool)
	// join and leave are kettle i joining the fleet in a step at ns, and
	// leaving it (a shaped fleet, see shape.go).
	join(i int, k *kettleState, ns int64)
	leave(i int, k *kettleState)
	// drain ends the run's exchanges (finished: none is outstanding).
	drain(finished bool)
	// close closes every connection.
	close()
}

// httpTransport is kettles polling and uploading over HTTP/1.1 keep-alive
// connections, v0 or v1 (Config.API).
type httpTransport struct {
	*Swarm
	addr string      // host:port dialed
	tls  *tls.Config // nil: plain HTTP
	// Shared connections (--conns N): one worker goroutine per connection
	// takes the kettles' exchanges from jobs in order. A kettle waiting for
	// a connection is then a queued job of 24 bytes, not a parked
	// goroutine with its stack: with 200,000 kettles on 1,000 connections
	// and a slow server, the waiting ones outnumber the connections a
	// hundred times over. jobs holds one entry per kettle at most (a
	// kettle has one exchange outstanding), so a send never blocks.
	jobs chan job
	// Per-device connections: exchanger goroutines (see startExchange),
	// idle ones wait on idle.
	idle       chan job
	idleStop   chan struct{}
	exchangers sync.WaitGroup
}

func (s *httpTransport) open(budget int) (n int, mode string, err error) {
	cfg := &s.cfg
	addr, tlsCfg := s.addr, s.tls
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
	checkSourcePorts(cfg.Log, n, sourceAddrs(cfg, addr))
	s.pool = newPool(n, perDevice, dialer(addr, sourceAddrs(cfg, addr), cfg.Timeout, tlsCfg))
	if tlsCfg != nil {
		// One handshake first: a certificate the swarm does not trust
		// is said now, not counted as every request's error.
		c, err := s.pool.dial(&pool{})
		if err != nil {
			return 0, "", err
		}
		c.Close()
	}
	if !perDevice {
		s.jobs = make(chan job, cfg.Devices)
		for range n {
			s.exchangers.Add(1)
			go s.connWorker(<-s.pool.shared)
		}
	}
	return n, mode, nil
}

func (s *httpTransport) describe(*Params)             {}
func (s *httpTransport) initKettle(int, *kettleState) {}

func (s *httpTransport) drain(finished bool) {
	close(s.idleStop)
	if finished {
		s.exchangers.Wait()
	}
}

func (s *httpTransport) close() { s.pool.closeAll() }

// fire handles one due event and returns the kettle's next tick.
func (s *httpTransport) fire(ev event) (event, bool) {
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
		w.upload = len(k.pending) >= s.batch(int(ev.k), ev.at) && ev.at >= k.retryAt
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

// job is a kettle's exchange waiting to run; queued is when it was handed
// over (ns since start), from which its wait for a connection is bounded.
type job struct {
	at, queued   int64
	i            int32
	upload, poll bool
}

func (j job) work() work { return work{upload: j.upload, poll: j.poll, at: j.at} }

// startExchange hands kettle i's work to the connection workers' queue
// (shared connections) or to an idle exchanger goroutine, or starts one:
// the open model never waits for a free one. Exchangers outlive their
// exchange by up to exchangerIdle, so their stacks, grown by the first
// request, serve the next ones instead of growing again in a fresh
// goroutine each time.
func (s *httpTransport) startExchange(i int, w work) {
	j := job{at: w.at, queued: s.now(), i: int32(i), upload: w.upload, poll: w.poll}
	if s.jobs != nil {
		s.jobs <- j
		return
	}
	select {
	case s.idle <- j:
	default:
		s.exchangers.Add(1)
		go s.exchanger(j)
	}
}

// connWorker runs queued exchanges on its own connection (slot sl, given
// back to the pool at the end for closeAll) until the run ends (s.idleStop).
func (s *httpTransport) connWorker(sl *slot) {
	defer s.exchangers.Done()
	defer s.pool.put(0, sl)
	for {
		select {
		case j := <-s.jobs:
			s.exchange(j, sl)
		case <-s.idleStop:
			return
		}
	}
}

// exchanger runs exchanges until it has been idle for exchangerIdle or the
// run ends (s.idleStop).
func (s *httpTransport) exchanger(j job) {
	defer s.exchangers.Done()
	t := time.NewTimer(exchangerIdle)
	defer t.Stop()
	for {
		s.exchange(j, nil)
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

// exchange runs a kettle's work, then whatever came due meanwhile, on the
// connection sl (nil: the kettle's slot of the pool).
func (s *httpTransport) exchange(j job, sl *slot) {
	defer s.wg.Done()
	defer s.busy.Add(-1)
	i, w := int(j.i), j.work()
	k := &s.kettles[i]
	// A job that waited longer than the request timeout for a connection
	// fails as a request that found none would.
	var waited time.Duration
	if sl != nil {
		waited = time.Duration(s.now() - j.queued)
	}
	for {
		if waited > s.cfg.Timeout {
			s.noConn(i, k, w, errPoolTimeout)
		} else {
			s.runWork(i, k, w, sl)
		}
		waited = 0
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
func (s *httpTransport) retryLater(i int, k *kettleState, retryAfter time.Duration) {
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

// do sends the requests built in raw (request j ends at ends[j], for
// endpoint eps[j]) pipelined on the slot and records each answer: its
// latency runs from at, the time the first was due, for the first, and
// from the previous answer for the next (the server answers them in turn).
// got sees each answer with ok: 2xx or 304.
func (s *httpTransport) do(sl *slot, raw []byte, ends, eps []int, at int64, got func(j int, r response, ok bool)) {
	s.pool.do(sl, raw, ends, time.Now().Add(s.cfg.Timeout), func(j int, r response, err error) {
		now := s.now()
		s.st.record(eps[j], now-at, r.status, err)
		at = now
		got(j, r, err == nil && (r.status/100 == 2 || r.status == 304))
	})
}

// noConn fails kettle i's work for want of a connection.
func (s *httpTransport) noConn(i int, k *kettleState, w work, err error) {
	ep := epCommand
	if w.upload {
		ep = epMeasurement
	}
	s.st.record(ep, s.now()-w.at, 0, err)
	if w.upload {
		s.retryLater(i, k, 0)
	}
}

// runWork does kettle i's work on the connection sl, or on its slot of the
// pool when sl is nil: its buffered readings and its poll pipelined in one
// write, then, while more readings are buffered than one request carries,
// the rest.
func (s *httpTransport) runWork(i int, k *kettleState, w work, sl *slot) {
	if sl == nil {
		var err error
		if sl, err = s.pool.get(i, time.Now().Add(s.cfg.Timeout)); err != nil {
			s.noConn(i, k, w, err)
			return
		}
		defer s.release(i, k, sl)
	}
	at := w.at
	if s.cfg.API == "v0" && !k.loggedIn {
		if !s.login(i, k, sl, at) {
			return
		}
		at = s.now()
	}
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	var tbuf [8]int64
	times := tbuf[:0]
	upload, poll := w.upload, w.poll
	for range 100 {
		raw := (*bp)[:0]
		var ends, eps [2]int
		n := 0
		if upload {
			if raw, times = s.appendUpload(raw, i, k, times); len(times) > 0 {
				ends[n], eps[n] = len(raw), epMeasurement
				n++
			}
		}
		if poll {
			raw = s.appendPoll(raw, i, k)
			ends[n], eps[n] = len(raw), epCommand
			n++
		}
		*bp = raw
		if n == 0 {
			return
		}
		upload, poll = false, false
		s.do(sl, raw, ends[:n], eps[:n], at, func(j int, r response, ok bool) {
			if eps[j] == epMeasurement {
				upload = s.uploaded(i, k, r, ok, times)
			} else {
				s.polled(k, r, ok)
			}
		})
		at = s.now()
	}
}

// login does the case study's POST /login (v0) for kettle i and reports
// whether it is now logged in (if not, it tries again later).
func (s *httpTransport) login(i int, k *kettleState, sl *slot, at int64) (ok bool) {
	s.st.offer(epLogin)
	body := fmt.Appendf(nil, `{"username":"kettle-%d"}`, s.fleetIndex(i))
	raw := endRequest(appendRequestLine(nil, "POST", s.host, s.base, "/login"), body)
	var retryAfter time.Duration
	s.do(sl, raw, []int{len(raw)}, []int{epLogin}, at, func(_ int, r response, answered bool) {
		retryAfter = r.retryAfter
		var lr struct {
			Username string `json:"username"`
		}
		if !answered || json.Unmarshal(r.body, &lr) != nil {
			return
		}
		id, err := uuid.Parse(lr.Username)
		if err != nil {
			return
		}
		k.mu.Lock()
		k.id, k.loggedIn = id, true
		k.mu.Unlock()
		ok = true
	})
	if !ok {
		s.retryLater(i, k, retryAfter)
	}
	return ok
}

// appendAuth appends kettle i's credential header: the case study's
// cookie (v0, once logged in) or its device token. The caller holds k.mu.
func (s *httpTransport) appendAuth(dst []byte, i int, k *kettleState) []byte {
	if s.cfg.API == "v0" {
		if !k.loggedIn {
			return dst
		}
		dst = append(dst, "servant-auth-cookie: "...)
		dst = append(dst, k.id.String()...)
		return append(dst, "\r\n"...)
	}
	dst = append(dst, "Authorization: Bearer "...)
	dst = append(dst, s.token(i)...)
	return append(dst, "\r\n"...)
}

// appendUpload appends kettle i's next upload request to dst — its
// buffered readings, up to MaxBatch in one request (v1) or one (v0) — and
// sets times to the device times it carries (µs); with none buffered, dst
// is returned as it was and times empty.
func (s *httpTransport) appendUpload(dst []byte, i int, k *kettleState, times []int64) ([]byte, []int64) {
	times = times[:0]
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	k.mu.Lock()
	n := len(k.pending)
	if n == 0 {
		k.mu.Unlock()
		return dst, times
	}
	path := "/v1/measurements"
	if s.cfg.API == "v0" {
		n, path = 1, "/measurement"
	}
	n = min(n, kettle.MaxBatch)
	body := appendUploadBody((*bp)[:0], k.pending[:n], s.cfg.API)
	for _, m := range k.pending[:n] {
		times = append(times, m.Time.UnixMicro())
	}
	dst = appendRequestLine(dst, "POST", s.host, s.base, path)
	dst = s.appendAuth(dst, i, k)
	k.mu.Unlock()
	*bp = body
	return endRequest(dst, body), times
}

// uploaded handles the answer to an upload of the readings of times: the
// acknowledged ones leave the buffer and join the audit's log; a failure
// schedules a retry. It reports whether more readings wait to go now.
func (s *httpTransport) uploaded(i int, k *kettleState, r response, ok bool, times []int64) (more bool) {
	if !ok {
		s.retryLater(i, k, r.retryAfter)
		return false
	}
	if s.cfg.API == "v1" {
		if d := duplicates(r.body); d > 0 {
			s.st.add(&s.st.dupReported, d)
		}
	}
	last := times[len(times)-1]
	k.mu.Lock()
	for _, t := range times {
		k.acked.add(t)
	}
	// Readings are buffered in time order; drop those just acknowledged
	// (the buffer may have shifted while the request was out). An empty
	// buffer is let go: most kettles, most of the time, have nothing
	// unacknowledged, and 200,000 of them would otherwise each hold one.
	d := 0
	for d < len(k.pending) && k.pending[d].Time.UnixMicro() <= last {
		d++
	}
	if d == len(k.pending) {
		k.pending = nil
	} else {
		k.pending = append(k.pending[:0], k.pending[d:]...)
	}
	k.attempts, k.retryAt = 0, 0
	more = len(k.pending) > 0
	k.mu.Unlock()
	s.st.add(&s.st.acked, int64(len(times)))
	return more && !s.stop.Load()
}

// duplicates is the "duplicates" count of a v1 upload's answer
// ({"duplicates":N,"stored":M}); 0 when absent.
func duplicates(body []byte) int64 {
	_, rest, found := bytes.Cut(body, []byte(`"duplicates":`))
	if !found {
		return 0
	}
	var n int64
	for _, c := range bytes.TrimLeft(rest, " ") {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int64(c-'0')
	}
	return n
}

// appendPoll appends kettle i's command poll to dst, conditional on the
// ETag of the command it obeys.
func (s *httpTransport) appendPoll(dst []byte, i int, k *kettleState) []byte {
	path := "/v1/command"
	if s.cfg.API == "v0" {
		path = "/command"
	}
	dst = appendRequestLine(dst, "GET", s.host, s.base, path)
	k.mu.Lock()
	dst = s.appendAuth(dst, i, k)
	if k.etag != "" {
		dst = append(dst, "If-None-Match: "...)
		dst = append(dst, k.etag...)
		dst = append(dst, "\r\n"...)
	}
	k.mu.Unlock()
	return endRequest(dst, nil)
}

// polled makes the model obey a poll's answer: a new command (200), the
// same (304), or none (a failure).
func (s *httpTransport) polled(k *kettleState, r response, ok bool) {
	if ok && r.maxAge > 0 {
		k.mu.Lock()
		k.pollAt = s.now() + int64(r.maxAge)
		k.mu.Unlock()
	}
	if !ok || r.status != 200 {
		return
	}
	c, err := parseCommand(r.body, s.cfg.API)
	if err != nil {
		s.st.record(epCommand, -1, 0, fmt.Errorf("bad command body: %w", err))
		return
	}
	k.mu.Lock()
	if k.etag != string(r.etag) {
		k.etag = string(r.etag)
	}
	k.model.Obey(&k.rng, time.Now(), c)
	k.mu.Unlock()
}

// parseCommand is a command body of api as the model obeys it.
func parseCommand(b []byte, api string) (Command, error) {
	c, err := wire.ParseCommand(b, api)
	return Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.FlushMLPerS}, err
}

// appendUploadBody appends readings as one upload body of api: v0 takes
// one reading a request, v1 one or an array.
func appendUploadBody(b []byte, ms []kettle.Measurement, api string) []byte {
	if api == "v0" {
		return wire.AppendV0(b, &ms[0])
	}
	return wire.AppendV1Upload(b, ms)
}
