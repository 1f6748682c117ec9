package mqttapi

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// The listener's sessions: an MQTT 3.1.1 and 5 server that knows only what
// a kettle does — CONNECT as itself, PUBLISH its readings, SUBSCRIBE to its
// command topic — on mochi-mqtt's packets codec (decode, validate, encode:
// no packet parsing of our own), with the Broker's authentication and
// ingest, the PUBACK order (ack.go) and the pusher (commands.go).
//
// Memory per connection is what it must be. Between packets no goroutine
// waits for a connected kettle: on Linux, after its CONNECT, a plain-TCP
// connection is held in one epoll set (poller, poll_linux.go), and bytes
// arriving give it a turn on a pooled goroutine that reads and handles the
// packets there (elsewhere, and over TLS, whose records may hold bytes the socket no
// longer shows, one goroutine reads each connection, waiting in a read of a
// 2-byte array through frames of a few hundred bytes: its stack stays at
// Go's minimum, 2 KiB, and each packet is handled on a goroutine of its
// own, off). A packet's bytes are read into a pooled buffer. The stack a
// packet grows (JSON, the store's call chain) goes back to the runtime
// with its goroutine instead of staying with an idle connection until
// collections shrink it (a general broker's reader: 16–32 KiB each). Nothing writes on
// a goroutine of its own: a packet is written whole by whoever has it —
// the reader (CONNACK, SUBACK, PINGRESP), the commit (PUBACKs, ack.go), a
// short-lived goroutine per command push (pushes) — in one Write, which
// the socket serialises, each under its own deadline (conn). The session
// is a devConn (about 170 bytes), found by device id in one map; a
// persistent session (clean session 0, or an MQTT 5 session expiry) leaves
// only its device id, expiry and whether it subscribed.

// devServer is the sessions' shared state.
type devServer struct {
	b *Broker

	mu      sync.Mutex
	live    map[kettle.DeviceID]*devConn // each device's current session
	resume  map[kettle.DeviceID]resumable
	closing bool

	// wg counts writers outside connection goroutines (command pushes,
	// DISCONNECTs of sessions taken over), each bounded by a write deadline.
	wg sync.WaitGroup
	// served is closed when the accept loop has returned.
	served chan struct{}
	// dropLog thins the lines about connections closed without a CONNACK
	// (the CONNECT never came whole, or its CONNACK could not be written).
	dropLog logthin.Limiter
	// poll holds the established plain-TCP connections between packets
	// (poll_linux.go); nil: each keeps a reading goroutine.
	poll *poller
}

// resumable is a disconnected persistent session: a kettle that reconnects
// with clean session 0 before expires (unix seconds) gets session present,
// and its command again if it had subscribed.
type resumable struct {
	expires    int64
	subscribed bool
}

// topicAliasMaximum is the highest inbound topic alias accepted (a kettle
// publishes to one topic).
const topicAliasMaximum = 4

func newDevServer(b *Broker) *devServer {
	d := &devServer{b: b, live: make(map[kettle.DeviceID]*devConn), resume: make(map[kettle.DeviceID]resumable),
		served: make(chan struct{}), dropLog: logthin.Limiter{Burst: 10}}
	b.dev = d
	return d
}

// startPoller starts the poller that holds idle connections (Linux), and
// the keepalive expiry of the connections it holds.
func (d *devServer) startPoller() {
	b := d.b
	p, err := newPoller(func(err error, handedBack int) {
		b.log.Error("mqtt: the connection poller failed; every connection now has a reading goroutine of its own (more memory per kettle; restart the node to get the poller back)",
			"err", err, "connections_handed_back", handedBack)
	})
	if err != nil {
		b.log.Warn("mqtt: no connection poller: every connection keeps a reading goroutine (more memory per kettle)", "err", err)
		return
	}
	if p != nil {
		d.poll = p
		b.bg.Add(1)
		go func() { defer b.bg.Done(); d.expire(b.ctx) }()
	}
}

// close stops accepting and disconnects every kettle (listener.close calls
// closeAll); Broker.Close then waits for the connections, then stops the
// poller (stopPoll).
func (d *devServer) close() {
	d.b.ln.close()
	<-d.served
}

func (d *devServer) stopPoll() {
	if d.poll != nil {
		d.poll.close()
	}
}

// expire ends the poller's connections whose kettle sent nothing for one
// and a half keepalives [MQTT-3.1.2-22]: no read waits on them whose
// deadline would. A connection whose packet is being handled is not
// expired (devConn.due is 0 meanwhile).
func (d *devServer) expire(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var late []*devConn
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			n := now.UnixNano()
			d.mu.Lock()
			for _, dc := range d.live {
				if due := dc.due.Load(); due != 0 && due < n {
					late = append(late, dc)
				}
			}
			d.mu.Unlock()
			for i, dc := range late {
				dc.c.abort()
				late[i] = nil
			}
			late = late[:0]
		}
	}
}

// closeAll tells every connected kettle the server is shutting down (MQTT 5)
// and closes its connection; CONNECTs still in hand are refused.
func (d *devServer) closeAll() {
	d.mu.Lock()
	d.closing = true
	conns := make([]*devConn, 0, len(d.live))
	for _, dc := range d.live {
		conns = append(conns, dc)
	}
	d.mu.Unlock()
	for _, dc := range conns {
		dc.kick(packets.ErrServerShuttingDown)
	}
}

// start is the listener's start: the connection's goroutine is
// devConn.serve, so that nothing but its own small frames lies under the
// read it waits in (device_conn.go).
func (d *devServer) start(c *conn, tc *tls.Conn) {
	if tc == nil {
		c.raw = rawConnOf(c.Conn)
	}
	dc := &devConn{c: c, d: d}
	go dc.serve(tc)
}

// register makes dc its device's session, taking over the one before. It
// reports whether a session was present (clean 0 only) and false for ok
// while the listener shuts down.
func (d *devServer) register(dc *devConn, clean bool) (present, ok bool) {
	now := time.Now().Unix()
	d.mu.Lock()
	if d.closing {
		d.mu.Unlock()
		return false, false
	}
	old := d.live[dc.id]
	d.live[dc.id] = dc
	r, had := d.resume[dc.id]
	delete(d.resume, dc.id)
	if !clean {
		switch {
		case old != nil:
			present = true
			dc.subscribed.Store(old.subscribed.Load())
		case had && r.expires > now:
			present = true
			dc.subscribed.Store(r.subscribed)
		}
	}
	d.mu.Unlock()
	if old != nil {
		old.kick(packets.ErrSessionTakenOver)
	}
	return present, true
}

// unregister ends dc's session unless a newer connection took it over; a
// persistent one is remembered until it expires (at most MaxConns of them:
// past that a reconnecting kettle is told no session is present and
// subscribes again).
func (d *devServer) unregister(dc *devConn) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.live[dc.id] != dc {
		return
	}
	delete(d.live, dc.id)
	if dc.expiry == 0 {
		return
	}
	now := time.Now().Unix()
	if len(d.resume) >= d.b.cfg.MaxConns {
		for id, r := range d.resume { // rare: a fleet of persistent sessions churning
			if r.expires <= now {
				delete(d.resume, id)
			}
		}
		if len(d.resume) >= d.b.cfg.MaxConns {
			return
		}
	}
	d.resume[dc.id] = resumable{expires: now + int64(dc.expiry), subscribed: dc.subscribed.Load()}
}

// publish is the pusher's: it hands the command to the device's connection
// without waiting for the write (commands.go: the pusher never blocks on
// one kettle). A device without a live subscribed session gets nothing: its
// next subscription delivers the then-current command.
func (d *devServer) publish(id kettle.DeviceID, body []byte) error {
	d.mu.Lock()
	dc := d.live[id]
	d.mu.Unlock()
	if dc == nil || !dc.subscribed.Load() || dc.Closed() || d.b.svc.Revoked(id) {
		return nil
	}
	dc.pend.Store(&body)
	if dc.pushing.CompareAndSwap(false, true) {
		d.wg.Add(1)
		go dc.flushPushes()
	}
	return nil
}

// dropped logs (thinned) a connection closed after its CONNECT began
// without a CONNACK, with why.
func (d *devServer) dropped(dc *devConn, why string, err error) {
	d.droppedFrom(dc.c.RemoteAddr(), why, err)
}

func (d *devServer) droppedFrom(remote net.Addr, why string, err error) {
	if ok, skipped := d.dropLog.Allow(time.Now()); ok {
		d.b.log.Info("mqtt: connection closed without a CONNACK", "remote", remote.String(), "why", why, "err", errString(err),
			"not_logged_since_last_line", skipped)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// Packet buffers: a kettle's PUBLISH of one reading is ~300 bytes, a batch
// up to kettle.MaxBody. A buffer is held only while its packet is read and
// handled, so the pools hold about as many as packets are in hand at once.
var bufPools = [...]struct {
	size int
	pool sync.Pool
}{{size: 512}, {size: 4 << 10}, {size: 64 << 10}}

// getBuf returns a buffer of n bytes, pooled up to 64 KiB.
func getBuf(n int) *[]byte {
	for i := range bufPools {
		if p := &bufPools[i]; n <= p.size {
			if b, ok := p.pool.Get().(*[]byte); ok {
				*b = (*b)[:n]
				return b
			}
			b := make([]byte, n, p.size)
			return &b
		}
	}
	b := make([]byte, n)
	return &b
}

func putBuf(b *[]byte) {
	for i := range bufPools {
		if p := &bufPools[i]; cap(*b) == p.size {
			p.pool.Put(b)
			return
		}
	}
}

// encodePacket appends pk to buf with mochi's codec (the packets a device
// listener writes).
func encodePacket(buf *bytes.Buffer, pk *packets.Packet) error {
	switch pk.FixedHeader.Type {
	case packets.Connack:
		return pk.ConnackEncode(buf)
	case packets.Publish:
		return pk.PublishEncode(buf)
	case packets.Puback:
		return pk.PubackEncode(buf)
	case packets.Pubrel:
		return pk.PubrelEncode(buf)
	case packets.Pubcomp:
		return pk.PubcompEncode(buf)
	case packets.Suback:
		return pk.SubackEncode(buf)
	case packets.Unsuback:
		return pk.UnsubackEncode(buf)
	case packets.Disconnect:
		return pk.DisconnectEncode(buf)
	}
	return fmt.Errorf("%w: %v", packets.ErrNoValidPacketAvailable, pk.FixedHeader.Type)
}

// decodePacket decodes the body of a packet a kettle may send after CONNECT.
func decodePacket(pk *packets.Packet, body []byte) error {
	switch pk.FixedHeader.Type {
	case packets.Publish:
		return pk.PublishDecode(body)
	case packets.Subscribe:
		return pk.SubscribeDecode(body)
	case packets.Unsubscribe:
		return pk.UnsubscribeDecode(body)
	case packets.Disconnect:
		return pk.DisconnectDecode(body)
	case packets.Pubrec:
		return pk.PubrecDecode(body)
	case packets.Pubrel:
		return pk.PubrelDecode(body)
	case packets.Auth:
		return pk.AuthDecode(body)
	case packets.Connect:
		return nil // a second CONNECT: refused unread
	}
	return fmt.Errorf("invalid packet type %d", pk.FixedHeader.Type)
}

// lenReader feeds packets.DecodeLength the remaining-length byte already
// read with the packet type, then reads any further ones from the
// connection.
type lenReader struct {
	first byte
	used  bool
	r     io.Reader
}

func (l *lenReader) ReadByte() (byte, error) {
	if !l.used {
		l.used = true
		return l.first, nil
	}
	var b [1]byte
	_, err := io.ReadFull(l.r, b[:])
	return b[0], err
}

// errDisconnected ends a connection whose kettle sent DISCONNECT.
var errDisconnected = errors.New("client disconnected")
