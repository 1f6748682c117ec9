package server

import (
	"net"
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
}

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
			c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			c.Write(refusal)
			c.Close()
			continue
		}
		return &trackedConn{Conn: c, l: l}, nil
	}
}

// Active is the number of open connections; Refused counts those turned away.
func (l *limitListener) Active() int64  { return l.active.Load() }
func (l *limitListener) Refused() int64 { return l.refused.Load() }

type trackedConn struct {
	net.Conn
	l    *limitListener
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() { c.l.active.Add(-1) })
	return c.Conn.Close()
}
