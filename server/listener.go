package server

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// limitListener caps open connections below the process's file limit. The
// excess is accepted, told 503 with Retry-After, and closed at once, so a
// flood of connections neither kills the process (EMFILE) nor queues without
// bound in the kernel's backlog.
type limitListener struct {
	net.Listener
	max     int64
	active  atomic.Int64
	refused atomic.Int64
	held    atomic.Int64 // background reads answered at once (trackedConn.Read), the evidence TestUploadHoldsBackgroundRead reads

	// tls, when set, is the server's TLS configuration: a refusal then
	// needs a handshake before its 503 can be read (refuseTLS).
	tls         *tls.Config
	refusingTLS atomic.Int64 // refusals in a handshake now
	refusalsMu  sync.Mutex
	refusals    map[net.Conn]struct{} // those connections, closed by Close
	refusalsWG  sync.WaitGroup
	closed      bool // under refusalsMu
}

// maxTLSRefusals bounds the handshakes spent on refusals at once: past it
// an excess connection is closed without an answer (a client sees the
// connection reset and retries), so that a flood over the cap cannot buy
// unbounded handshake CPU and file descriptors.
const maxTLSRefusals = 64

func newLimitListener(l net.Listener, max int) *limitListener {
	return &limitListener{Listener: l, max: int64(max)}
}

var refusal = []byte("HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: 91\r\n\r\n" +
	`{"error":"unavailable","message":"connection limit reached; retry after 1s or add a node"}` + "\n")

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.active.Add(1) > l.max {
			l.active.Add(-1)
			l.refused.Add(1)
			if l.tls != nil {
				l.refuseTLS(c)
				continue
			}
			c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			c.Write(refusal)
			c.Close()
			continue
		}
		tc := &trackedConn{Conn: c, l: l}
		tc.unhold = func() { tc.holding.Store(false) } // once per connection, not per upload
		return tc, nil
	}
}

// refuseTLS answers a connection over the cap with the 503 over TLS, in
// its own goroutine with a 1 s bound, at most maxTLSRefusals at once.
func (l *limitListener) refuseTLS(c net.Conn) {
	if l.refusingTLS.Add(1) > maxTLSRefusals {
		l.refusingTLS.Add(-1)
		c.Close()
		return
	}
	l.refusalsMu.Lock()
	if l.closed {
		l.refusalsMu.Unlock()
		l.refusingTLS.Add(-1)
		c.Close()
		return
	}
	if l.refusals == nil {
		l.refusals = map[net.Conn]struct{}{}
	}
	l.refusals[c] = struct{}{}
	l.refusalsWG.Add(1)
	l.refusalsMu.Unlock()
	go func() {
		defer l.refusalsWG.Done()
		defer l.refusingTLS.Add(-1)
		defer func() {
			l.refusalsMu.Lock()
			delete(l.refusals, c)
			l.refusalsMu.Unlock()
			c.Close()
		}()
		c.SetDeadline(time.Now().Add(time.Second))
		tc := tls.Server(c, l.tls)
		if tc.Handshake() == nil {
			tc.Write(refusal)
		}
		tc.Close()
	}()
}

// Close stops accepting, and ends the refusals in progress (their
// goroutines are gone when it returns).
func (l *limitListener) Close() error {
	err := l.Listener.Close()
	l.refusalsMu.Lock()
	l.closed = true
	for c := range l.refusals {
		c.Close()
	}
	l.refusalsMu.Unlock()
	l.refusalsWG.Wait()
	return err
}

// Active is the number of open connections; Refused counts those turned away.
func (l *limitListener) Active() int64  { return l.active.Load() }
func (l *limitListener) Refused() int64 { return l.refused.Load() }

type trackedConn struct {
	net.Conn
	l       *limitListener
	once    sync.Once
	holding atomic.Bool
	unhold  func()
}

// Read is the connection's Read, except that net/http's background read is
// answered at once, having read nothing, while an upload on the connection
// waits for its commit (hold).
//
// During every handler, once the request's body is read, net/http reads one
// byte of the connection in the background, to notice the client going away
// (it then cancels the request's context) or a pipelined request. An upload
// waits 10–30 ms for its commit under load; meanwhile that read parks on the
// socket, and answering must wake it through a read deadline: ~3 µs of CPU
// a request (kettle serve 33–36 µs a single reading at 1,024 connections
// with it, 30–32 without; bench/pg-ab.sh, docs/performance.md). An upload does not need it: the
// commit decides its answer whether or not the client stays (one that went
// away sends the reading again and is told it is a duplicate). net/http's
// background read takes (0, nil) as "nothing happened" and ends; a pipelined
// request's bytes stay in the socket for the next ordinary read. Only 1-byte
// reads are answered so: net/http's own reads of requests and bodies go
// through its 4 KiB bufio.Reader, and TestUploadHoldsBackgroundRead checks
// that the background read is still one read per request and that the
// connection is still whole after it.
func (c *trackedConn) Read(p []byte) (int, error) {
	if len(p) == 1 && c.holding.Load() {
		c.l.held.Add(1)
		return 0, nil
	}
	return c.Conn.Read(p)
}

// hold marks the connection's upload as waiting for its commit until the
// returned func is called (before the upload is answered).
func (c *trackedConn) hold() (unhold func()) {
	c.holding.Store(true)
	return c.unhold
}

func (c *trackedConn) Close() error {
	c.once.Do(func() { c.l.active.Add(-1) })
	return c.Conn.Close()
}

type connKey struct{}

// withConn is http.Server.ConnContext: a request's context carries its
// connection, so that an upload can hold the connection's background read.
func withConn(ctx context.Context, c net.Conn) context.Context {
	if tc, ok := c.(*trackedConn); ok {
		return context.WithValue(ctx, connKey{}, tc)
	}
	return ctx
}

// holdReads holds the background read of r's connection (trackedConn.Read)
// until the returned func is called.
func holdReads(r *http.Request) (unhold func()) {
	if c, ok := r.Context().Value(connKey{}).(*trackedConn); ok {
		return c.hold()
	}
	return func() {}
}
