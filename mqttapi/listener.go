package mqttapi

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/pires/go-proxyproto"

	"github.com/kettlefleet/kettlefleet/internal/backoff"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// listener accepts kettles' connections: it backs off and retries on an
// Accept error (EMFILE under load) like net/http, bounds the time to the
// CONNECT packet, bounds every write (conn), caps open connections, and
// lets Close wait for every connection goroutine (so in-flight ingests
// finish before the fleet service closes).
type listener struct {
	addr           string
	ln             net.Listener
	log            *slog.Logger
	connectTimeout time.Duration
	writeTimeout   time.Duration
	maxConns       int64
	// tls, when set, makes every connection TLS: the handshake is done on
	// the connection's goroutine within connectTimeout.
	tls       *tls.Config
	tlsFailed func() // nil: not counted
	// proxies are the balancers whose PROXY protocol v2 header names the
	// client (Config.TrustedProxies): from them a connection begins with
	// one; a PROXY header from anyone else is refused (proxy.go).
	proxies  []netip.Prefix
	proxyLog logthin.Limiter

	open   atomic.Int64
	closed atomic.Bool
	wg     sync.WaitGroup
	// closeAll disconnects every established connection at close.
	closeAll func()
	// overCap builds the CONNACK refusing a CONNECT over maxConns (and
	// counts it); nil: such connections are closed at accept.
	overCap func(version byte) packets.Packet
	// refusing bounds the connections being refused at once: each holds a
	// file descriptor until its CONNACK is out (refuse).
	refusing chan struct{}
	// start serves an accepted connection on a goroutine of its own (tc:
	// its TLS side, nil without TLS, handshake not yet done), which calls
	// l.wg.Done and l.open.Add(-1) at its end.
	start func(c *conn, tc *tls.Conn)
	// dropped, when set, logs a connection closed without a CONNACK after
	// its CONNECT began (thinned by the sessions, devServer.droppedFrom).
	dropped func(remote net.Addr, why string, err error)
}

// maxRefusing is how many connections over the cap are answered at once;
// past it the listener stops accepting until one is done, so refusals hold
// at most this many file descriptors beyond the cap, and a storm waits in
// the kernel's accept queue instead.
const maxRefusing = 256

// refuseTimeout bounds a refusal: the TLS handshake and the CONNECT must
// arrive within it (a kettle sends CONNECT at once).
const refuseTimeout = 3 * time.Second

// maxConnectBytes is the largest CONNECT a refusal reads: a kettle's is a
// few hundred bytes (no Will: refused anyway).
const maxConnectBytes = 4 << 10

// listen binds the listen address.
func (l *listener) listen() error {
	ln, err := net.Listen("tcp", l.addr)
	if err != nil {
		return err
	}
	l.ln = ln
	return nil
}

// serve accepts connections until close.
func (l *listener) serve() {
	retry := backoff.Backoff{Initial: 5 * time.Millisecond, Max: time.Second}
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			if l.closed.Load() || errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE, ENFILE, ECONNABORTED…: wait and try again.
			delay := retry.Next(0)
			l.log.Warn("mqtt: accept failed; retrying", "err", err, "retry_in", delay)
			time.Sleep(delay)
			continue
		}
		retry.Reset()
		if l.open.Add(1) > l.maxConns {
			l.open.Add(-1)
			if l.overCap == nil {
				nc.Close()
				continue
			}
			// Over the cap: read its CONNECT and say why in a CONNACK, so
			// the kettle backs off (or goes where it is told) instead of
			// retrying a bare close at once.
			l.refusing <- struct{}{} // at most maxRefusing at once: accepting waits
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				defer func() { <-l.refusing }()
				l.refuse(nc)
			}()
			continue
		}
		var tc *tls.Conn
		if l.tls != nil {
			tc = tls.Server(nc, l.tls)
			_ = nc.SetDeadline(time.Now().Add(l.connectTimeout)) // the handshake's writes too
		}
		c := &conn{Conn: nc, timeout: l.writeTimeout}
		if tc != nil {
			c.Conn = tc
		}
		_ = c.SetDeadline(time.Now().Add(l.connectTimeout))
		l.wg.Add(1)
		l.start(c, tc)
	}
}

// handshake completes a TLS connection's handshake (within the connect
// timeout set at accept); a failure is counted and the connection closed.
func (l *listener) handshake(tc *tls.Conn, remote net.Addr) error {
	nc := tc.NetConn()
	if err := tc.Handshake(); err != nil {
		l.log.Debug("mqtt: TLS handshake failed", "remote", remote.String(), "err", err)
		if l.tlsFailed != nil {
			l.tlsFailed()
		}
		nc.Close()
		return err
	}
	return nc.SetWriteDeadline(time.Time{}) // each write sets its own (conn.Write)
}

// refuse answers nc's CONNECT with the over-the-cap CONNACK and closes it.
// A connection that sends no valid CONNECT within refuseTimeout is closed.
func (l *listener) refuse(nc net.Conn) {
	defer nc.Close()
	_ = nc.SetDeadline(time.Now().Add(refuseTimeout))
	remote, err := l.client(nc)
	if err != nil {
		return
	}
	c := nc
	if l.tls != nil {
		tc := tls.Server(nc, l.tls)
		if err := tc.Handshake(); err != nil {
			if l.tlsFailed != nil {
				l.tlsFailed()
			}
			return
		}
		c = tc
	}
	br := bufio.NewReaderSize(c, 512)
	hb, err := br.ReadByte()
	if err != nil {
		if isTimeout(err) {
			l.drop(remote, "over the cap: no CONNECT within the refusal's timeout", err)
		}
		return
	}
	var fh packets.FixedHeader
	if fh.Decode(hb) != nil || fh.Type != packets.Connect {
		if hb == proxyproto.SIGV2[0] || hb == proxyproto.SIGV1[0] {
			l.refuseProxy(remote, "from a peer not in --trusted-proxies")
		}
		return
	}
	// A CONNECT began: whatever happens now, its kettle gets a CONNACK or
	// the node logs why not (l.dropped).
	n, _, err := packets.DecodeLength(br)
	if err != nil || n > maxConnectBytes {
		l.drop(remote, "over the cap: CONNECT malformed or larger than a kettle's", err)
		return
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(br, body); err != nil {
		l.drop(remote, "over the cap: the CONNECT did not arrive whole", err)
		return
	}
	fh.Remaining = n
	pk := packets.Packet{FixedHeader: fh}
	if err := pk.ConnectDecode(body); err != nil {
		l.drop(remote, "over the cap: malformed CONNECT", err)
		return
	}
	ack := l.overCap(pk.ProtocolVersion)
	var buf bytes.Buffer
	if err := ack.ConnackEncode(&buf); err != nil {
		l.drop(remote, "over the cap: its refusal could not be encoded", err)
		return
	}
	if _, err := c.Write(buf.Bytes()); err != nil {
		l.drop(remote, "over the cap: its refusal could not be written", err)
	}
}

// drop reports a connection closed without a CONNACK after its CONNECT
// began (nil dropped: not reported).
func (l *listener) drop(remote net.Addr, why string, err error) {
	if l.dropped != nil {
		l.dropped(remote, why, err)
	}
}

func (l *listener) address() string {
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.addr
}

// close stops accepting and disconnects every established connection.
func (l *listener) close() {
	if l.closed.Swap(true) {
		return
	}
	if l.ln != nil {
		l.ln.Close()
	}
	l.closeAll()
}

// wait waits for every connection goroutine, at most d.
func (l *listener) wait(d time.Duration) bool {
	ch := make(chan struct{})
	go func() { l.wg.Wait(); close(ch) }()
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

// conn bounds every write to a kettle. The keepalive's deadline (1.5 ×
// keepalive after the last packet read, none at keepalive 0) applies to
// reads only (SetDeadline); each write gets its own, so a kettle that stops
// reading while its socket stays open (hung firmware, a half-open
// connection) holds up nobody who writes to it for longer than that, and a
// write that fails ends the connection (a partial packet may be out: the
// stream is unusable); its reader then sees the error and ends the session.
type conn struct {
	net.Conn
	timeout time.Duration
	// remote is the kettle's address when a trusted proxy's PROXY header
	// named it (nil: the peer's).
	remote net.Addr

	mu  sync.Mutex // orders a Write's deadline against cut's
	cut bool       // the session is being taken over: writes get takeoverGrace

	ack *acker // pipelined QoS 1 PUBACKs (ack.go); set on the read goroutine at the first one

	// raw is the plain-TCP socket the listener reads and writes with
	// raw system calls (poll_linux.go; nil: through Conn); writing keeps
	// each Write's bytes together when part of them must wait.
	raw     syscall.RawConn
	writing sync.Mutex
}

// takeoverGrace is how long the connection of a session being taken over may
// still take to accept a write (its DISCONNECT, or a write already under
// way).
const takeoverGrace = time.Second

func (c *conn) Write(p []byte) (int, error) {
	if c.raw == nil {
		return c.write(p)
	}
	// The socket usually takes a packet at once: one write(2), without a
	// deadline to set or the scheduler's syscall bookkeeping (writeNow).
	// What it does not take goes out under a deadline, before anyone
	// else's bytes (writing): a packet is never interleaved.
	c.writing.Lock()
	defer c.writing.Unlock()
	n, err := writeNow(c.raw, p)
	if err != nil {
		c.abort()
		return n, err
	}
	if n == len(p) {
		return n, nil
	}
	m, err := c.write(p[n:])
	if err == nil {
		c.mu.Lock()
		if !c.cut {
			_ = c.Conn.SetWriteDeadline(time.Time{}) // the next writeNow must not fail on this one's
		}
		c.mu.Unlock()
	}
	return n + m, err
}

// write is one Write under its own deadline.
func (c *conn) write(p []byte) (int, error) {
	c.mu.Lock()
	d := c.timeout
	if c.cut {
		d = min(d, takeoverGrace)
	}
	_ = c.Conn.SetWriteDeadline(time.Now().Add(d))
	c.mu.Unlock()
	n, err := c.Conn.Write(p)
	if err != nil {
		c.abort()
	}
	return n, err
}

// abort ends the connection from outside its reading: it shuts the socket
// down both ways, which wakes whoever reads it (its goroutine, or the
// poller) to close it and end its session. Closing the fd
// here instead would take it out of the poller's set unseen, and its
// session would never end.
func (c *conn) abort() {
	nc := c.Conn
	if tc, ok := nc.(*tls.Conn); ok {
		nc = tc.NetConn()
	}
	if tcp, ok := nc.(*net.TCPConn); ok && tcp.CloseRead() == nil {
		_ = tcp.CloseWrite()
		return
	}
	_ = c.Conn.Close()
}

// RemoteAddr is the kettle's address: the one a trusted proxy's PROXY
// header named, or the peer's.
func (c *conn) RemoteAddr() net.Addr {
	if c.remote != nil {
		return c.remote
	}
	return c.Conn.RemoteAddr()
}

// SetDeadline is the keepalive's deadline: reads only.
func (c *conn) SetDeadline(t time.Time) error { return c.Conn.SetReadDeadline(t) }

// cutWrites gives a write in progress, and every later one, at most
// takeoverGrace.
func (c *conn) cutWrites() {
	c.mu.Lock()
	c.cut = true
	_ = c.Conn.SetWriteDeadline(time.Now().Add(min(c.timeout, takeoverGrace)))
	c.mu.Unlock()
}
