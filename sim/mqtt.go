package sim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/kettlefleet/kettlefleet"
)

// MQTT kettles (Config.Protocol "mqtt"). Each kettle holds one MQTT 5
// connection (paho.golang's low-level client), authenticated with username =
// device id and password = device token. On each tick it publishes its
// buffered readings QoS 1 to kettles/{id}/measurements, with at most
// Config.MQTTInflight publishes awaiting their PUBACK; a reading counts as
// acknowledged only on a PUBACK with a reason code below 0x80 (kettle serve
// sends it after the commit). Commands arrive by subscription to
// kettles/{id}/command (retained, pushed on change): the model obeys the last
// one received, there is no polling. A lost connection is redialed with
// backoff; readings meanwhile stay buffered (bounded, oldest dropped).
//
// The scheduler, latency accounting (from the intended send time), late
// starts, lag, results and audit are the HTTP swarm's. Cost: the paho client
// keeps three goroutines per connection (reader, router, pinger), its session
// state and one fd: measured ~33 KiB RSS per connected kettle (5,000 kettles:
// 177 MiB), so 100,000 kettles ≈ 3.3 GiB over the ≥ 6 processes the fd limit
// asks for anyway.

// MQTT topics of one kettle (as in mqttapi).
func measurementTopic(id string) string { return "kettles/" + id + "/measurements" }
func commandTopic(id string) string     { return "kettles/" + id + "/command" }

// MQTT connection states of a kettle.
const (
	mqDown = iota
	mqConnecting
	mqUp
)

// evConnect is a scheduled (re)connection of an MQTT kettle.
const evConnect = 2

// mqttKettle is an MQTT kettle's connection; guarded by its kettleState.mu.
type mqttKettle struct {
	cl       *paho.Client
	state    uint8
	attempts uint8  // consecutive failed connects
	gen      uint32 // connection generation: callbacks of an older one are ignored
	inflight int    // publishes awaiting their PUBACK
	owedAt   int64  // an upload came due but could not start (window full, down); -1: none
	user     string // device id
	pass     string // device token
}

// kconn is a kettle's TCP connection as paho sees it: reads are buffered
// (paho reads a packet a few bytes at a time) and each packet is written in
// one syscall. paho takes Lock around every packet it writes (it checks for
// sync.Locker), so writes between Lock and Unlock are one packet: they are
// gathered and sent on Unlock. A write error closes the connection, which
// paho's reader then reports as a lost connection.
type kconn struct {
	net.Conn
	br   *bufio.Reader
	mu   sync.Mutex
	wbuf []byte
	werr error
}

func newKConn(c net.Conn) *kconn { return &kconn{Conn: c, br: bufio.NewReaderSize(c, 512)} }

func (c *kconn) Read(p []byte) (int, error) { return c.br.Read(p) }

func (c *kconn) Lock() { c.mu.Lock() }

// Write is called by paho only between Lock and Unlock.
func (c *kconn) Write(p []byte) (int, error) {
	if c.werr != nil {
		return 0, c.werr
	}
	c.wbuf = append(c.wbuf, p...)
	return len(p), nil
}

func (c *kconn) Unlock() {
	if len(c.wbuf) > 0 && c.werr == nil {
		if _, err := c.Conn.Write(c.wbuf); err != nil {
			c.werr = err
			c.Conn.Close()
		}
	}
	if cap(c.wbuf) > 4096 {
		c.wbuf = nil // a big batch: do not keep its buffer per kettle
	} else {
		c.wbuf = c.wbuf[:0]
	}
	c.mu.Unlock()
}

// mqttKeepAlive is the MQTT keepalive: well above the interval, so a kettle
// that publishes on schedule never needs a PINGREQ.
func (s *Swarm) mqttKeepAlive() uint16 {
	ka := 2 * s.cfg.Interval
	ka = min(max(ka, 30*time.Second), time.Hour)
	return uint16(ka / time.Second)
}

// fireMQTT handles one due event of an MQTT kettle and returns its next tick.
func (s *Swarm) fireMQTT(ev event) (event, bool) {
	k := &s.kettles[ev.k]
	m := k.mq
	k.mu.Lock()
	defer k.mu.Unlock()
	var next event
	hasNext, upload := false, false
	switch ev.kind {
	case evConnect:
		if m.state == mqDown {
			s.startConnect(int(ev.k), k, ev.at)
		}
		return next, false
	case evTick:
		next, hasNext = s.tick(k, ev), true
		upload = len(k.pending) >= s.cfg.Batch && ev.at >= k.retryAt
		if k.ticks == 1 && m.state == mqDown {
			// First tick: the kettle comes online now; its reading goes out
			// once connected, latency still counted from now.
			s.startConnect(int(ev.k), k, ev.at)
		}
	default: // evRetry
		upload = len(k.pending) > 0 && ev.at >= k.retryAt
	}
	if upload {
		s.st.offer(epMQTTPublish)
		if m.state == mqUp && m.inflight < s.cfg.MQTTInflight {
			s.startPublish(int(ev.k), k, ev.at)
		} else {
			if m.owedAt < 0 || ev.at < m.owedAt {
				m.owedAt = ev.at
			}
			if m.state == mqUp {
				// The window is full: a late start, as an HTTP kettle's
				// send due while its exchange is outstanding. (While
				// connecting, the wait shows in the latency instead.)
				s.st.add(&s.st.late, 1)
			}
		}
	}
	return next, hasNext
}

// startConnect dials kettle i in the background; at is the intended time.
// k.mu held.
func (s *Swarm) startConnect(i int, k *kettleState, at int64) {
	if s.stop.Load() {
		return
	}
	m := k.mq
	m.state = mqConnecting
	m.gen++
	s.st.offer(epMQTTConnect)
	s.wg.Add(1)
	go s.connect(i, k, m.gen, at)
}

// connect runs one connection attempt: dial, CONNECT, SUBSCRIBE to the
// command topic. On success it sends what is buffered; on failure it
// schedules the next attempt with backoff.
func (s *Swarm) connect(i int, k *kettleState, gen uint32, at int64) {
	defer s.wg.Done()
	m := k.mq
	fail := func(kind string, err error) {
		if kind != "" {
			s.st.recordKind(epMQTTConnect, s.now()-at, "", 0, kind)
		} else {
			s.st.record(epMQTTConnect, s.now()-at, 0, err)
		}
		k.mu.Lock()
		if m.gen == gen && m.state == mqConnecting {
			m.state = mqDown
			s.reconnectLater(i, k)
		}
		k.mu.Unlock()
	}
	nc, err := s.mqDial()
	if err != nil {
		fail("", err)
		return
	}
	s.pool.open.Add(1)
	s.pool.dials.Add(1)
	kc := newKConn(nc)
	lost := func() { s.mqttLost(i, k, gen) }
	cl := paho.NewClient(paho.ClientConfig{
		Conn:          kc,
		ClientID:      m.user,
		PacketTimeout: s.cfg.Timeout,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			s.mqttCommand(k, pr.Packet.Payload)
			return true, nil
		}},
		OnClientError:      func(error) { lost() },
		OnServerDisconnect: func(*paho.Disconnect) { lost() },
	})
	// Receive Maximum sizes paho's queue of incoming publishes (a channel
	// allocated per client; 65,535 by default = 512 KiB per kettle).
	recvMax := uint16(4)
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	ca, err := cl.Connect(ctx, &paho.Connect{
		ClientID: m.user, CleanStart: true, KeepAlive: s.mqttKeepAlive(),
		UsernameFlag: true, Username: m.user, PasswordFlag: true, Password: []byte(m.pass),
		Properties: &paho.ConnectProperties{ReceiveMaximum: &recvMax},
	})
	if err != nil {
		s.pool.open.Add(-1)
		nc.Close()
		if ca != nil && ca.ReasonCode >= 0x80 {
			fail(fmt.Sprintf("connack_0x%02x", ca.ReasonCode), nil)
		} else {
			fail("", err)
		}
		return
	}
	sa, err := cl.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: commandTopic(m.user), QoS: 1}}})
	if err != nil || len(sa.Reasons) != 1 || sa.Reasons[0] >= 0x80 {
		k.mu.Lock()
		cur := m.gen == gen && m.state == mqConnecting
		k.mu.Unlock()
		_ = cl.Disconnect(&paho.Disconnect{})
		if cur { // else the connection was already reported lost
			s.pool.open.Add(-1)
		}
		if err == nil {
			fail(fmt.Sprintf("suback_0x%02x", sa.Reasons[0]), nil)
		} else {
			fail("", err)
		}
		return
	}
	s.st.recordKind(epMQTTConnect, s.now()-at, "0x00", 200, "")

	k.mu.Lock()
	defer k.mu.Unlock()
	if m.gen != gen || m.state != mqConnecting {
		return // lost between SUBACK and here: mqttLost has rescheduled
	}
	if s.stop.Load() {
		m.state = mqDown
		s.pool.open.Add(-1)
		go cl.Disconnect(&paho.Disconnect{})
		return
	}
	m.cl, m.state, m.attempts = cl, mqUp, 0
	s.sendOwed(i, k)
}

// sendOwed starts publishes for readings that came due while the kettle could
// not send, within the window. k.mu held.
func (s *Swarm) sendOwed(i int, k *kettleState) {
	m := k.mq
	for m.owedAt >= 0 && m.state == mqUp && m.inflight < s.cfg.MQTTInflight && len(k.pending) > 0 &&
		s.now() >= k.retryAt && !s.stop.Load() {
		at := m.owedAt
		m.owedAt = -1
		s.startPublish(i, k, at)
	}
}

// mqttLost handles a connection of generation gen going down.
func (s *Swarm) mqttLost(i int, k *kettleState, gen uint32) {
	k.mu.Lock()
	defer k.mu.Unlock()
	m := k.mq
	if m.gen != gen || m.state == mqDown || s.stop.Load() {
		return
	}
	if m.state == mqUp {
		s.st.add(&s.st.mqttLost, 1)
	}
	m.state, m.cl = mqDown, nil
	s.pool.open.Add(-1)
	s.reconnectLater(i, k)
}

// reconnectLater schedules a connection attempt: exponential backoff from
// 1 s with jitter, at most 30 s, so a restarted server is not hit by the
// whole fleet at once. k.mu held.
func (s *Swarm) reconnectLater(i int, k *kettleState) {
	m := k.mq
	if m.attempts < 16 {
		m.attempts++
	}
	back := min(time.Second<<(m.attempts-1), 30*time.Second)
	back = time.Duration(float64(back) * (0.5 + k.rng.Float64()))
	at := s.now() + int64(back)
	// The dispatcher never holds heapMu while taking a kettle's lock, so
	// taking heapMu under k.mu cannot deadlock.
	s.heapMu.Lock()
	s.heap.Push(event{at: at, k: int32(i), kind: evConnect})
	s.heapMu.Unlock()
}

// startPublish takes the buffered readings (up to MaxBatch) and publishes
// them as one message in the background. k.mu held.
func (s *Swarm) startPublish(i int, k *kettleState, at int64) {
	m := k.mq
	n := min(len(k.pending), kettle.MaxBatch)
	if n == 0 {
		return
	}
	batch := slices.Clone(k.pending[:n])
	k.pending = append(k.pending[:0], k.pending[n:]...)
	m.inflight++
	s.busy.Add(1)
	s.wg.Add(1)
	go s.publish(i, k, m.cl, m.gen, batch, at)
}

// publish sends one message and waits for its PUBACK; at is the intended
// send time, from which latency counts.
func (s *Swarm) publish(i int, k *kettleState, cl *paho.Client, gen uint32, batch []kettle.Measurement, at int64) {
	defer s.wg.Done()
	defer s.busy.Add(-1)
	m := k.mq
	bp := bufPool.Get().(*[]byte)
	body := (*bp)[:0]
	if len(batch) > 1 {
		body = append(body, '[')
	}
	for j := range batch {
		if j > 0 {
			body = append(body, ',')
		}
		body = appendReading(body, &batch[j], "v1")
	}
	if len(batch) > 1 {
		body = append(body, ']')
	}
	// No context of ours: paho bounds the wait for the PUBACK by
	// PacketTimeout (= Config.Timeout) itself, and a second deadline
	// context per publish (a timer, and a child registered with paho's)
	// cost a tenth of the swarm's CPU.
	pr, err := cl.Publish(context.Background(), &paho.Publish{Topic: measurementTopic(m.user), QoS: 1, Payload: body})
	*bp = body
	bufPool.Put(bp)
	lat := s.now() - at
	ok := err == nil && pr != nil && pr.ReasonCode < 0x80
	switch {
	case ok:
		s.st.recordKind(epMQTTPublish, lat, "0x00", 200, "")
	case pr != nil && pr.ReasonCode >= 0x80:
		code := fmt.Sprintf("0x%02x", pr.ReasonCode)
		s.st.recordKind(epMQTTPublish, lat, code, 500, "puback_"+code)
	case errors.Is(err, context.DeadlineExceeded):
		s.st.recordKind(epMQTTPublish, lat, "", 0, "timeout")
	default:
		s.st.record(epMQTTPublish, lat, 0, err)
	}

	var retryAt int64
	k.mu.Lock()
	m.inflight--
	if ok {
		for j := range batch {
			k.acked = append(k.acked, batch[j].Time.UnixMicro())
		}
		k.attempts, k.retryAt = 0, 0
	} else {
		// Put the readings back, oldest first, and try again later (a
		// redelivery of a reading that was in fact stored is stored once).
		k.pending = append(batch, k.pending...)
		slices.SortStableFunc(k.pending, func(a, b kettle.Measurement) int { return a.Time.Compare(b.Time) })
		if over := len(k.pending) - maxPending; over > 0 {
			k.pending = append(k.pending[:0], k.pending[over:]...)
			s.st.add(&s.st.dropped, int64(over))
		}
		if k.attempts < 16 {
			k.attempts++
		}
		back := time.Duration(float64(time.Second<<(k.attempts-1)) * (0.5 + k.rng.Float64()))
		back = min(back, s.cfg.Interval)
		retryAt = s.now() + int64(back)
		k.retryAt = retryAt
		if pr == nil && m.gen == gen && m.state == mqUp && !errors.Is(err, context.DeadlineExceeded) {
			// The client failed (connection lost): make sure it is redialed
			// even if paho's callbacks have not run yet.
			m.state, m.cl = mqDown, nil
			s.pool.open.Add(-1)
			s.st.add(&s.st.mqttLost, 1)
			go cl.Disconnect(&paho.Disconnect{})
			s.reconnectLater(i, k)
		}
	}
	if ok {
		s.st.add(&s.st.acked, int64(len(batch)))
		s.sendOwed(i, k)
	}
	k.mu.Unlock()
	if retryAt > 0 {
		s.heapMu.Lock()
		s.heap.Push(event{at: retryAt, k: int32(i), kind: evRetry})
		s.heapMu.Unlock()
	}
}

// mqttCommand makes kettle k obey a command pushed by the server.
func (s *Swarm) mqttCommand(k *kettleState, payload []byte) {
	c, err := parseCommand(payload, "v1")
	if err != nil {
		s.st.recordKind(epMQTTPublish, -1, "", 0, "bad_command")
		return
	}
	s.st.add(&s.st.commands, 1)
	k.mu.Lock()
	k.model.Obey(&k.rng, time.Now(), c)
	k.mu.Unlock()
}

// mqttClose disconnects every kettle at the end of a run, 64 at a time.
func (s *Swarm) mqttClose() {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := range s.kettles {
		k := &s.kettles[i]
		k.mu.Lock()
		m := k.mq
		cl := m.cl
		if m.state == mqUp {
			m.state, m.cl = mqDown, nil
			s.pool.open.Add(-1)
		}
		k.mu.Unlock()
		if cl == nil {
			continue
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = cl.Disconnect(&paho.Disconnect{})
			<-sem
		}()
	}
	wg.Wait()
}

// mqttSetup checks the MQTT target and the fd budget and prepares dialing;
// it returns the number of connections the run will hold.
func (s *Swarm) mqttSetup(budget int) (int, error) {
	cfg := &s.cfg
	addr, err := CheckLoopbackAddr(cfg.MQTTTarget)
	if err != nil {
		return 0, err
	}
	cfg.MQTTTarget = addr
	if cfg.Devices > budget {
		return 0, fmt.Errorf("--devices %d: an MQTT kettle needs its own connection, and the open-file limit leaves %d (ulimit -n; %d reserved); "+
			"run several swarm processes of at most %d kettles, against several kettle serve processes (each holds at most --mqtt-max-conns)",
			cfg.Devices, budget, cfg.ReserveFDs, budget)
	}
	src := sourceAddrs(cfg, addr)
	if cfg.Devices > 28000*max(len(src), 1) {
		fmt.Fprintf(cfg.Log, "swarm: %d connections need more than %d source address(es) (~28,000 ephemeral ports each); consider --source-ips %d or more --source-addrs\n", cfg.Devices, max(len(src), 1), cfg.Devices/28000+1)
	}
	s.mqDial = dialer(addr, src, cfg.Timeout)
	s.pool = newPool(0, false, nil) // only its open/dials counters
	return cfg.Devices, nil
}

// CheckLoopbackAddr parses host:port (tcp:// or mqtt:// prefix allowed) and
// refuses anything but this machine. localhost becomes 127.0.0.1.
func CheckLoopbackAddr(hostport string) (string, error) {
	a := hostport
	for _, p := range []string{"tcp://", "mqtt://"} {
		a = strings.TrimPrefix(a, p)
	}
	h, port, err := net.SplitHostPort(a)
	if err != nil || port == "" {
		return "", fmt.Errorf("--mqtt-target %q: want HOST:PORT", hostport)
	}
	if strings.EqualFold(h, "localhost") {
		h = "127.0.0.1"
	}
	ip := net.ParseIP(h)
	if ip == nil || !ip.IsLoopback() {
		return "", fmt.Errorf("refusing --mqtt-target %s: the swarm only loads this machine (127.0.0.0/8, ::1 or localhost)", hostport)
	}
	return net.JoinHostPort(h, port), nil
}
