package sim

import (
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// mqttTransport is kettles publishing their readings over MQTT 5 (QoS 1,
// v1 payloads) to Config.MQTTTarget, one connection each, and taking their
// commands by subscription.
type mqttTransport struct {
	*Swarm
	dial    func() (net.Conn, error) // dials the listener
	readers sync.WaitGroup           // connection attempts, readers, flushers (mqttClose ends them)
}

func (s *mqttTransport) open(budget int) (int, string, error) {
	n, err := s.mqttSetup(budget)
	return n, "per-device", err
}

func (s *mqttTransport) describe(p *Params) {
	p.Protocol, p.MQTTTarget, p.MQTTInflight = s.cfg.Protocol, s.cfg.MQTTTarget, s.cfg.MQTTInflight
}

func (s *mqttTransport) initKettle(i int, k *kettleState) {
	k.mq = &mqttKettle{owedAt: -1, user: k.id.String(), pass: string(s.token(i))}
}

func (s *mqttTransport) fire(ev event) (event, bool) { return s.fireMQTT(ev) }
func (s *mqttTransport) drain(bool)                  { s.mqttDrain() }

func (s *mqttTransport) close() {
	s.pool.closeAll()
	s.mqttClose()
}

// MQTT kettles (Config.Protocol "mqtt"). Each kettle holds one MQTT 5
// connection, authenticated with username = device id and password = device
// token. On each tick it publishes its buffered readings QoS 1 to
// kettles/{id}/measurements, with at most Config.MQTTInflight publishes (and
// at most the server's Receive Maximum) awaiting their PUBACK; a reading
// counts as acknowledged only on a PUBACK with a reason code below 0x80
// (kettle serve sends it after the commit). Commands arrive by subscription
// to kettles/{id}/command (retained, pushed on change): the model obeys the
// last one received, there is no polling.
//
// A publish not acknowledged within Config.Timeout is counted as a timeout
// but stays in flight, holding its place in the window: MQTT 5 resends a
// QoS 1 message only on a new connection, and a live server acknowledges
// every message it read, so sending the readings again on the same
// connection (as the paho client's timeout made us do) only doubled the work
// of a server that was already behind. A kettle that sent nothing for a
// keepalive sends PINGREQ; no PINGRESP within half a keepalive and the
// connection is dead. A lost connection is redialed with backoff (harder
// after a timeout or a busy server, see reconnectLater); the readings it had
// in flight go back to the buffer (bounded, oldest dropped) and are resent
// on the next connection.
//
// The client is ours, the packets are paho.golang's codec (mqttconn.go): one
// reader goroutine and one small read buffer per connection; publishes,
// PINGREQs, PUBACK deadlines and keepalive are the scheduler's events, under
// the kettle's lock. Side by side with the paho client it replaced
// (bench/mqtt-fleet.sh, 10,000 kettles, 2+2 processes, one swarm each):
// 20.2 vs 39.7 KiB RSS per kettle, 13.91 vs 16.11 CPU-s over the run. The CPU
// is mostly the kernel's (a loopback write delivers the packet in the
// sender's syscall) and wake-ups, one per message at a kettle's cadence.
// The scheduler, latency accounting (from the intended send time), late
// starts, lag, results and audit are the HTTP swarm's.

// MQTT topics of one kettle (as in mqttapi).
func measurementTopic(id string) string { return "kettles/" + id + "/measurements" }
func commandTopic(id string) string     { return "kettles/" + id + "/command" }

// MQTT connection states of a kettle.
const (
	mqDown = iota
	mqConnecting
	mqUp
)

// Events of MQTT kettles (besides evTick and evRetry).
const (
	evConnect = 2 // a scheduled (re)connection
	evCheck   = 3 // a connection's PUBACK deadlines and keepalive
)

// mqPub is a publish awaiting its PUBACK.
type mqPub struct {
	batch    []kettle.Measurement
	at       int64 // intended send time, ns since start: latency counts from it
	deadline int64 // counted as a timeout if not acknowledged by then
	id       uint16
	timedOut bool
}

// mqttKettle is an MQTT kettle's connection; guarded by its kettleState.mu.
type mqttKettle struct {
	c        *mqConn // while connecting or up
	inflight []mqPub // oldest first
	user     string  // device id
	pass     string  // device token
	owedAt   int64   // an upload came due but could not start (window full, down); -1: none
	lastSent int64   // the last packet written, ns since start
	pingAt   int64   // a PINGREQ awaits its PINGRESP since then; 0: none
	checkAt  int64   // the earliest evCheck in the heap; 0: none
	gen      uint32  // connection generation: events of an older one are ignored
	window   uint16  // publishes allowed in flight on this connection
	nextID   uint16
	state    uint8
	attempts uint8 // consecutive failed connects
}

// errConnLost is a publish's error when its connection went down first.
var errConnLost = errors.New("connection lost before the PUBACK")

// mqttKeepAlive is the MQTT keepalive: Config.MQTTKeepAlive, or well above
// the interval, so a kettle that publishes on schedule never needs a
// PINGREQ.
func (s *mqttTransport) mqttKeepAlive() time.Duration {
	if ka := s.cfg.MQTTKeepAlive; ka > 0 {
		return max(ka.Truncate(time.Second), time.Second)
	}
	return min(max(2*s.cfg.Interval, 30*time.Second), time.Hour).Truncate(time.Second)
}

// fireMQTT handles one due event of an MQTT kettle and returns its next tick.
func (s *mqttTransport) fireMQTT(ev event) (event, bool) {
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
	case evCheck:
		if ev.at == m.checkAt { // else superseded by an earlier one
			m.checkAt = 0
			s.mqCheck(int(ev.k), k)
		}
		return next, false
	case evTick:
		next, hasNext = s.tick(k, ev), true
		upload = len(k.pending) >= s.batch(int(ev.k), ev.at) && ev.at >= k.retryAt
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
		if m.state == mqUp && len(m.inflight) < int(m.window) {
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
func (s *mqttTransport) startConnect(i int, k *kettleState, at int64) {
	if s.stop.Load() {
		return
	}
	m := k.mq
	m.state = mqConnecting
	m.gen++
	s.st.offer(epMQTTConnect)
	s.readers.Add(1)
	go s.connect(i, k, m.gen, at)
}

// refusal is a CONNACK or SUBACK that said no.
type refusal struct {
	kind string // connack_0x87 …
	busy bool   // the server is overloaded, not refusing this kettle
}

func (r refusal) Error() string { return r.kind }

// connect runs one connection attempt — dial, CONNECT, SUBSCRIBE to the
// command topic — and then reads the connection until it goes down. On
// success it sends what is buffered; on failure it schedules the next
// attempt with backoff.
func (s *mqttTransport) connect(i int, k *kettleState, gen uint32, at int64) {
	defer s.readers.Done()
	m := k.mq
	fail := func(err error) {
		var r refusal
		if errors.As(err, &r) {
			s.st.recordKind(epMQTTConnect, s.now()-at, "", 0, r.kind)
		} else {
			s.st.record(epMQTTConnect, s.now()-at, 0, err)
		}
		k.mu.Lock()
		if m.gen == gen && m.state == mqConnecting {
			m.state, m.c = mqDown, nil
			s.reconnectLater(i, k, r.busy || isTimeout(err))
		}
		k.mu.Unlock()
	}
	nc, err := s.dial()
	if err != nil {
		fail(err)
		return
	}
	s.pool.open.Add(1)
	s.pool.dials.Add(1)
	c := newMQConn(nc)
	k.mu.Lock()
	stale := m.gen != gen || s.stop.Load()
	if !stale {
		m.c = c // from now on mqttClose can close it
	}
	k.mu.Unlock()
	if stale {
		nc.Close()
		s.pool.open.Add(-1)
		return
	}
	recvMax, err := s.handshake(k, c)
	if err != nil {
		nc.Close()
		s.pool.open.Add(-1)
		fail(err)
		return
	}
	s.st.recordKind(epMQTTConnect, s.now()-at, "0x00", 200, "")

	k.mu.Lock()
	if m.gen != gen || m.state != mqConnecting || c.dead {
		k.mu.Unlock() // closed by mqttClose at the end of the run
		nc.Close()
		s.pool.open.Add(-1)
		return
	}
	now := s.now()
	m.state, m.attempts = mqUp, 0
	m.window = uint16(min(s.cfg.MQTTInflight, int(recvMax)))
	m.nextID, m.lastSent, m.pingAt = 1, now, 0 // the SUBSCRIBE was 1
	s.sendOwed(i, k)
	s.armCheck(i, k, now+int64(s.mqttKeepAlive()))
	k.mu.Unlock()
	s.readLoop(i, k, gen, c)
}

// handshake sends CONNECT and SUBSCRIBE and waits for their answers, within
// Config.Timeout; it returns the server's Receive Maximum.
func (s *mqttTransport) handshake(k *kettleState, c *mqConn) (uint16, error) {
	m := k.mq
	_ = c.nc.SetDeadline(time.Now().Add(s.cfg.Timeout))
	cp := packets.NewControlPacket(packets.CONNECT)
	cn := cp.Content.(*packets.Connect)
	recvMax := uint16(4) // commands come at QoS 0; a few at QoS 1 would be fine too
	cn.ClientID, cn.CleanStart, cn.KeepAlive = m.user, true, uint16(s.mqttKeepAlive()/time.Second)
	cn.UsernameFlag, cn.Username, cn.PasswordFlag, cn.Password = true, m.user, true, []byte(m.pass)
	cn.Properties.ReceiveMaximum = &recvMax
	if _, err := c.nc.Write(mqEncode(nil, cp)); err != nil {
		return 0, err
	}
	p, err := packets.ReadPacket(c.br)
	if err != nil {
		return 0, err
	}
	ca, ok := p.Content.(*packets.Connack)
	if !ok {
		return 0, fmt.Errorf("want CONNACK, got %s", p.PacketType())
	}
	if ca.ReasonCode >= 0x80 {
		return 0, refusal{kind: connackKind(ca.ReasonCode), busy: busyCode(ca.ReasonCode)}
	}
	serverMax := uint16(65535)
	if ca.Properties != nil && ca.Properties.ReceiveMaximum != nil && *ca.Properties.ReceiveMaximum > 0 {
		serverMax = *ca.Properties.ReceiveMaximum
	}
	sp := packets.NewControlPacket(packets.SUBSCRIBE)
	sub := sp.Content.(*packets.Subscribe)
	sub.PacketID = 1
	sub.Subscriptions = []packets.SubOptions{{Topic: commandTopic(m.user), QoS: 1}}
	if _, err := c.nc.Write(mqEncode(nil, sp)); err != nil {
		return 0, err
	}
	for {
		p, err := packets.ReadPacket(c.br)
		if err != nil {
			return 0, err
		}
		switch q := p.Content.(type) {
		case *packets.Suback:
			if q.PacketID != 1 || len(q.Reasons) != 1 {
				return 0, fmt.Errorf("SUBACK %d with %d reason codes, want 1 with 1", q.PacketID, len(q.Reasons))
			}
			if q.Reasons[0] >= 0x80 {
				return 0, refusal{kind: fmt.Sprintf("suback_0x%02x", q.Reasons[0]), busy: busyCode(q.Reasons[0])}
			}
			return serverMax, c.nc.SetDeadline(time.Time{})
		case *packets.Publish: // the retained command, if the server sent it before the SUBACK
			s.mqttCommand(k, q.Payload)
			if q.QoS > 0 {
				if _, err := c.nc.Write(mqEncode(nil, pubackFor(q))); err != nil {
					return 0, err
				}
			}
		}
	}
}

// busyCode tells a reason code that means "not now, or not here" (server
// busy or unavailable, quota, rate, use another server) from one that
// refuses the kettle. The swarm has one target, so a kettle sent to another
// server retries this one with the longer backoff.
func busyCode(code byte) bool {
	_, ok := capacityCodes[code]
	return ok
}

// capacityCodes name the CONNACK refusals that are about the server's
// capacity, not the kettle, for the error counts.
var capacityCodes = map[byte]string{
	packets.ConnackServerUnavailable:      "server_unavailable",
	packets.ConnackServerBusy:             "server_busy",
	packets.ConnackQuotaExceeded:          "quota_exceeded",
	packets.ConnackConnectionRateExceeded: "connection_rate_exceeded",
	packets.ConnackUseAnotherServer:       "use_another_server",
	packets.ConnackServerMoved:            "server_moved",
}

// connackKind is the error kind of a refused CONNECT: connack_0x97, and the
// reason's name for a capacity refusal (connack_0x97_quota_exceeded).
func connackKind(code byte) string {
	if name, ok := capacityCodes[code]; ok {
		return fmt.Sprintf("connack_0x%02x_%s", code, name)
	}
	return fmt.Sprintf("connack_0x%02x", code)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func pubackFor(p *packets.Publish) *packets.ControlPacket {
	cp := packets.NewControlPacket(packets.PUBACK)
	cp.Content.(*packets.Puback).PacketID = p.PacketID
	return cp
}

// readLoop reads connection c of kettle i until it goes down.
func (s *mqttTransport) readLoop(i int, k *kettleState, gen uint32, c *mqConn) {
	m := k.mq
	for {
		p, err := packets.ReadPacket(c.br)
		if err != nil {
			s.mqttDown(i, k, gen, c, err)
			return
		}
		switch q := p.Content.(type) {
		case *packets.Puback:
			s.mqttPuback(i, k, gen, q)
		case *packets.Publish:
			s.mqttCommand(k, q.Payload)
			if q.QoS > 0 {
				k.mu.Lock()
				s.mqWrite(k, c, mqEncode(nil, pubackFor(q)))
				k.mu.Unlock()
			}
		case *packets.Pingresp:
			k.mu.Lock()
			if m.gen == gen {
				m.pingAt = 0
			}
			k.mu.Unlock()
		case *packets.Disconnect:
			k.mu.Lock()
			c.hard = busyCode(q.ReasonCode)
			k.mu.Unlock()
			s.mqttDown(i, k, gen, c, fmt.Errorf("server DISCONNECT 0x%02x", q.ReasonCode))
			return
		}
	}
}

// mqttDown handles connection c (generation gen) of kettle i going down:
// publishes awaiting their PUBACK give their readings back to the buffer,
// and a reconnection is scheduled.
func (s *mqttTransport) mqttDown(i int, k *kettleState, gen uint32, c *mqConn, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	c.kill()
	s.pool.open.Add(-1)
	m := k.mq
	if m.gen != gen || m.c != c {
		return
	}
	m.state, m.c = mqDown, nil
	m.pingAt, m.checkAt = 0, 0
	stopping := s.stop.Load()
	now := s.now()
	pubs := m.inflight
	m.inflight = m.inflight[:0]
	for j := range pubs {
		p := &pubs[j]
		s.busy.Add(-1)
		if !p.timedOut && !stopping {
			s.st.record(epMQTTPublish, now-p.at, 0, errors.Join(errConnLost, err))
		}
		s.pubFailed(i, k, p.batch, !stopping)
		pubs[j] = mqPub{}
	}
	if stopping {
		return
	}
	s.st.add(&s.st.mqttLost, 1)
	s.reconnectLater(i, k, c.hard)
}

// mqttPuback settles the publish a PUBACK answers.
func (s *mqttTransport) mqttPuback(i int, k *kettleState, gen uint32, pa *packets.Puback) {
	k.mu.Lock()
	defer k.mu.Unlock()
	m := k.mq
	j := -1
	if m.gen == gen {
		j = m.inFlight(pa.PacketID)
	}
	if j < 0 {
		return
	}
	p := m.inflight[j]
	m.inflight = slices.Delete(m.inflight, j, j+1)
	s.busy.Add(-1)
	lat := s.now() - p.at
	if pa.ReasonCode < 0x80 {
		if !p.timedOut { // else already counted, as a timeout
			s.st.recordKind(epMQTTPublish, lat, "0x00", 200, "")
		}
		for j := range p.batch {
			k.acked.add(p.batch[j].Time.UnixMicro())
		}
		k.attempts, k.retryAt = 0, 0
		s.st.add(&s.st.acked, int64(len(p.batch)))
		s.sendOwed(i, k)
		return
	}
	if !p.timedOut {
		code := fmt.Sprintf("0x%02x", pa.ReasonCode)
		s.st.recordKind(epMQTTPublish, lat, code, 500, "puback_"+code)
	}
	s.pubFailed(i, k, p.batch, true)
}

// inFlight is the index of the publish with packet id id, or -1.
func (m *mqttKettle) inFlight(id uint16) int {
	for j := range m.inflight {
		if m.inflight[j].id == id {
			return j
		}
	}
	return -1
}

// pubFailed puts a batch that was not acknowledged back into the buffer,
// oldest first, and schedules a retry with backoff (a redelivery of a
// reading that was in fact stored is stored once). k.mu held.
func (s *mqttTransport) pubFailed(i int, k *kettleState, batch []kettle.Measurement, retry bool) {
	k.pending = append(batch, k.pending...)
	slices.SortStableFunc(k.pending, func(a, b kettle.Measurement) int { return a.Time.Compare(b.Time) })
	if over := len(k.pending) - maxPending; over > 0 {
		k.pending = append(k.pending[:0], k.pending[over:]...)
		s.st.add(&s.st.dropped, int64(over))
	}
	if !retry {
		return
	}
	if k.attempts < 16 {
		k.attempts++
	}
	back := time.Duration(float64(time.Second<<(k.attempts-1)) * (0.5 + k.rng.Float64()))
	back = min(back, s.cfg.Interval)
	k.retryAt = s.now() + int64(back)
	s.heapMu.Lock()
	s.heap.Push(event{at: k.retryAt, k: int32(i), kind: evRetry})
	s.heapMu.Unlock()
}

// mqCheck counts PUBACKs overdue as timeouts and keeps the connection alive:
// PINGREQ after a keepalive without sending, closed when that PINGREQ is not
// answered within half a keepalive. k.mu held.
func (s *mqttTransport) mqCheck(i int, k *kettleState) {
	m := k.mq
	if m.state != mqUp {
		return
	}
	now := s.now()
	next := int64(math.MaxInt64)
	for j := range m.inflight {
		p := &m.inflight[j]
		switch {
		case p.timedOut:
		case now >= p.deadline:
			p.timedOut = true
			s.st.recordKind(epMQTTPublish, now-p.at, "", 0, "timeout")
		default:
			next = min(next, p.deadline)
		}
	}
	ka := int64(s.mqttKeepAlive())
	switch {
	case m.pingAt > 0 && now >= m.pingAt+ka/2:
		// Dead (or a server so far behind that it dropped us as well): the
		// reader sees the close and reports the loss.
		m.c.hard = true
		m.c.kill()
		return
	case m.pingAt > 0:
		next = min(next, m.pingAt+ka/2)
	case now >= m.lastSent+ka:
		s.mqWrite(k, m.c, pingreq)
		m.lastSent, m.pingAt = now, now
		next = min(next, now+ka/2)
	default:
		next = min(next, m.lastSent+ka)
	}
	s.armCheck(i, k, next)
}

var pingreq = mqEncode(nil, packets.NewControlPacket(packets.PINGREQ))

// armCheck makes sure an evCheck of kettle i is due at or before at. k.mu
// held.
func (s *mqttTransport) armCheck(i int, k *kettleState, at int64) {
	m := k.mq
	if m.checkAt != 0 && m.checkAt <= at {
		return
	}
	m.checkAt = at
	// The dispatcher never holds heapMu while taking a kettle's lock, so
	// taking heapMu under k.mu cannot deadlock.
	s.heapMu.Lock()
	s.heap.Push(event{at: at, k: int32(i), kind: evCheck})
	s.heapMu.Unlock()
}

// sendOwed starts publishes for readings that came due while the kettle could
// not send, within the window. k.mu held.
func (s *mqttTransport) sendOwed(i int, k *kettleState) {
	m := k.mq
	for m.owedAt >= 0 && m.state == mqUp && len(m.inflight) < int(m.window) && len(k.pending) > 0 &&
		s.now() >= k.retryAt && !s.stop.Load() {
		at := m.owedAt
		m.owedAt = -1
		s.startPublish(i, k, at)
	}
}

// reconnectLater schedules a connection attempt: exponential backoff from
// 1 s with jitter, at most 30 s, so a restarted server is not hit by the
// whole fleet at once. After a timeout or a busy server (hard) it starts at
// 8 s and goes up to 2 minutes: a server that is slow, not gone, is only
// slowed further by a fleet reconnecting — each connect costs it a TLS-less
// but still authenticated session, a subscription and a retained push.
// k.mu held.
func (s *mqttTransport) reconnectLater(i int, k *kettleState, hard bool) {
	m := k.mq
	if m.attempts < 16 {
		m.attempts++
	}
	limit := 30 * time.Second
	if hard {
		m.attempts = max(m.attempts, 4)
		limit = 2 * time.Minute
	}
	back := min(time.Second<<(m.attempts-1), limit)
	back = time.Duration(float64(back) * (0.5 + k.rng.Float64()))
	s.heapMu.Lock()
	s.heap.Push(event{at: s.now() + int64(back), k: int32(i), kind: evConnect})
	s.heapMu.Unlock()
}

// startPublish takes the buffered readings (up to MaxBatch) and publishes
// them as one message. k.mu held.
func (s *mqttTransport) startPublish(i int, k *kettleState, at int64) {
	m := k.mq
	n := min(len(k.pending), kettle.MaxBatch)
	if n == 0 {
		return
	}
	batch := slices.Clone(k.pending[:n])
	k.pending = append(k.pending[:0], k.pending[n:]...)
	for {
		if m.nextID++; m.nextID != 0 && m.inFlight(m.nextID) < 0 {
			break
		}
	}
	bp, wp := bufPool.Get().(*[]byte), bufPool.Get().(*[]byte)
	body := wire.AppendV1Upload((*bp)[:0], batch)
	pk := &packets.Publish{Topic: measurementTopic(m.user), QoS: 1, PacketID: m.nextID, Payload: body}
	pkt := mqEncode((*wp)[:0], pk.ToControlPacket())
	now := s.now()
	if m.inflight == nil {
		m.inflight = make([]mqPub, 0, m.window)
	}
	m.inflight = append(m.inflight, mqPub{batch: batch, at: at, deadline: now + int64(s.cfg.Timeout), id: m.nextID})
	s.busy.Add(1)
	s.mqWrite(k, m.c, pkt)
	m.lastSent = now
	*bp, *wp = body, pkt
	bufPool.Put(bp)
	bufPool.Put(wp)
	s.armCheck(i, k, now+int64(s.cfg.Timeout))
}

// mqttCommand makes kettle k obey a command pushed by the server.
func (s *mqttTransport) mqttCommand(k *kettleState, payload []byte) {
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

// mqttDrain waits, at most a request timeout, for the publishes still
// awaiting their PUBACK at the end of the run (no new ones start).
func (s *mqttTransport) mqttDrain() {
	deadline := time.Now().Add(s.cfg.Timeout + time.Second)
	for s.busy.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := s.busy.Load(); n > 0 {
		fmt.Fprintf(s.cfg.Log, "swarm: %d publishes still awaiting their PUBACK at the end; their readings count as unacknowledged\n", n)
	}
}

// mqttClose disconnects every kettle at the end of a run and waits for
// their readers (and any connection attempt still dialing).
func (s *mqttTransport) mqttClose() {
	disconnect := mqEncode(nil, packets.NewControlPacket(packets.DISCONNECT))
	for i := range s.kettles {
		k := &s.kettles[i]
		k.mu.Lock()
		if c := k.mq.c; c != nil {
			if k.mq.state == mqUp {
				s.mqWrite(k, c, disconnect)
			}
			c.kill()
		}
		k.mu.Unlock()
	}
	s.readers.Wait()
}

// mqttSetup checks the MQTT target and the fd budget and prepares dialing;
// it returns the number of connections the run will hold.
func (s *mqttTransport) mqttSetup(budget int) (int, error) {
	cfg := &s.cfg
	addr, err := CheckTargetAddr(cfg.MQTTTarget, cfg.AllowHosts)
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
	checkSourcePorts(cfg.Log, cfg.Devices, src)
	s.pool = newPool(0, false, nil) // only its open/dials counters
	var tlsCfg *tls.Config
	if cfg.TLS != nil { // an https --target: the MQTT listener is TLS too (kettle serve --tls-cert)
		tlsCfg = cfg.TLS.Clone()
		tlsCfg.ServerName, _, _ = net.SplitHostPort(addr)
	}
	dial := dialer(addr, src, cfg.Timeout, tlsCfg)
	s.dial = func() (net.Conn, error) { return dial(s.pool) }
	if tlsCfg != nil {
		// One handshake first: a certificate the swarm does not trust is
		// said now, not counted as every connection's error.
		c, err := dial(&pool{})
		if err != nil {
			return 0, err
		}
		c.Close()
	}
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
