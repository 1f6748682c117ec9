package sim

import (
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
	// initKettle prepares a kettle whose credentials are set.
	initKettle(k *kettleState)
	// fire handles one due event and returns the kettle's next tick.
	fire(ev event) (event, bool)
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
	// Exchanger goroutines (see startExchange): idle ones wait on idle.
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
	return n, mode, nil
}

func (s *httpTransport) describe(*Params)          {}
func (s *httpTransport) initKettle(k *kettleState) {}

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
func (s *httpTransport) startExchange(i int, w work) {
	select {
	case s.idle <- job{i, w}:
	default:
		s.exchangers.Add(1)
		go s.exchanger(job{i, w})
	}
}

// exchanger runs exchanges until it has been idle for exchangerIdle or the
// run ends (s.idleStop).
func (s *httpTransport) exchanger(j job) {
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
func (s *httpTransport) exchange(i int, w work) {
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

// send does one request on kettle i's slot and records it; intended is the
// time it was due (ns since start).
func (s *httpTransport) send(sl *slot, ep int, intended int64, method, path, headers string, body []byte) (response, bool) {
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

func (s *httpTransport) runWork(i int, k *kettleState, w work) {
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
func (s *httpTransport) upload(i int, k *kettleState, sl *slot, at int64) int64 {
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
func (s *httpTransport) poll(k *kettleState, sl *slot, at int64) {
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
