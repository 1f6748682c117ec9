package mqttapi

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mochi-mqtt/server/v2/listeners"
)

var _ listeners.Listener = (*listener)(nil)

// listener replaces mochi's TCP listener, which returns from its accept loop
// on the first error (EMFILE under load would end MQTT for good). This one
// backs off and retries like net/http, bounds the time to the CONNECT packet
// (mochi sets no deadline before it), caps open connections, and lets Close
// wait for every connection goroutine (so in-flight ingests finish before
// the fleet service closes).
type listener struct {
	id, addr       string
	ln             net.Listener
	log            *slog.Logger
	connectTimeout time.Duration
	maxConns       int64

	open   atomic.Int64
	closed atomic.Bool
	wg     sync.WaitGroup
}

func (l *listener) Init(log *slog.Logger) error {
	ln, err := net.Listen("tcp", l.addr)
	if err != nil {
		return err
	}
	l.ln = ln
	return nil
}

func (l *listener) Serve(establish listeners.EstablishFn) {
	var delay time.Duration
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if l.closed.Load() || errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE, ENFILE, ECONNABORTED…: wait and try again.
			if delay == 0 {
				delay = 5 * time.Millisecond
			} else if delay *= 2; delay > time.Second {
				delay = time.Second
			}
			l.log.Warn("mqtt: accept failed; retrying", "err", err, "retry_in", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		if l.open.Add(1) > l.maxConns {
			l.open.Add(-1)
			conn.Close() // over the cap: no CONNACK, the client backs off and retries
			continue
		}
		_ = conn.SetDeadline(time.Now().Add(l.connectTimeout))
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			defer l.open.Add(-1)
			_ = establish(l.id, conn) // refusals are counted and logged by the hook
		}()
	}
}

func (l *listener) ID() string       { return l.id }
func (l *listener) Protocol() string { return "tcp" }

func (l *listener) Address() string {
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.addr
}

func (l *listener) Close(closeClients listeners.CloseFn) {
	if l.closed.Swap(true) {
		return
	}
	if l.ln != nil {
		l.ln.Close()
	}
	closeClients(l.id)
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
