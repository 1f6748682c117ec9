package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultHostHoldoff is Options.HostHoldoff's default.
const DefaultHostHoldoff = 100 * time.Millisecond

// hungHoldoff is how long a host that stopped answering (a read on one of
// its connections ran into its deadline: a handshake past connect_timeout,
// a ping past pingTimeout, a commit past --store-timeout) is not dialled
// by a caller: each try of such a host would cost the waiting write a
// whole connect_timeout before the driver goes on to the next host (and
// hold one of the pool's slots that long), while a refusal costs nothing.
// Past it, a probe in the background (see probeHost) asks the host to
// answer, and callers are still turned away until it has: a paused
// primary costs the writes no more than a dead one. Any answer on any
// connection to it ends the holdoff at once, so a host that was only slow
// (a commit waiting for a synchronous standby) is dialled again as soon as
// it answers anything.
const hungHoldoff = 3 * time.Second

// probeTimeout bounds a probe's wait for a hung host's answer: as long
// as a handshake may take over the slowest link the nemesis makes
// (Toxiproxy's latency, a few hundred ms each way), short enough that a
// host that answers again is used within a few seconds.
const probeTimeout = 2 * time.Second

// pingTimeout bounds the ping the pool sends on a connection that was
// idle over a second before handing it out (pgxpool's default ShouldPing).
// Without it, a connection to a host that neither answers nor refuses (a
// paused or cut-off machine: its kernel, or nobody, holds the socket open)
// is pinged until the caller's deadline, which fails the write instead of
// trying the next connection, once for every such connection in the pool.
const pingTimeout = time.Second

// hostGate paces the connection attempts to the hosts of a multi-host DSN
// (postgres://h1,h2,h3/…?target_session_attrs=read-write). While no host is
// a writable primary (a failover, a switchover), every write finds the pool
// empty and opens a connection, and the driver tries each host in turn: a
// dial, a SCRAM handshake and a backend fork on each standby, only to learn
// it is read-only. At hundreds of uploads a second that takes the cores of
// every node and member away from the polls and from the promotion itself.
// The gate remembers when each host last refused, failed or turned out not
// writable, and for holdoff after that the driver's dial of that host fails
// at once without touching the network: each node tries each host at most
// once per holdoff, and notices a new primary at most holdoff late.
//
// A host that stops answering instead (it accepted the connection, or held
// one open, and then said nothing until a deadline) is held off for
// hungHoldoff, and the pool's idle connections to it are dropped when they
// would be handed out (see stale), rather than each one costing a write
// its deadline.
type hostGate struct {
	holdoff time.Duration
	now     func() time.Time
	mu      sync.Mutex
	failed  map[string]time.Time // address (IP:port) → when it last failed
	hosts   map[string]*hostState
}

// hostState is what the connections to one host share: since when it has
// not answered (UnixNano of the last deadline one of them ran into; 0: it
// answers), and whether a probe of it is out.
type hostState struct {
	hungSince atomic.Int64
	probing   atomic.Bool
}

func newHostGate(holdoff time.Duration, now func() time.Time) *hostGate {
	return &hostGate{holdoff: holdoff, now: now, failed: map[string]time.Time{}, hosts: map[string]*hostState{}}
}

func (g *hostGate) state(addr string) *hostState {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := g.hosts[addr]
	if h == nil {
		h = &hostState{}
		g.hosts[addr] = h
	}
	return h
}

// stale reports whether c is a connection to a host that has stopped
// answering; the pool drops it instead of pinging it (see Open).
func (g *hostGate) stale(c net.Conn) bool {
	addr := c.RemoteAddr() // of the TCP connection under TLS too
	if addr == nil || addr.Network() != "tcp" {
		return false
	}
	g.mu.Lock()
	h := g.hosts[addr.String()]
	g.mu.Unlock()
	return h != nil && h.hungSince.Load() != 0
}

// gatedConn is a connection the gate dialled: its reads tell the gate
// whether the host answers.
type gatedConn struct {
	net.Conn
	host *hostState
	now  func() time.Time
}

func (c *gatedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		if c.host.hungSince.Load() != 0 {
			c.host.hungSince.Store(0)
		}
	} else if errors.Is(err, os.ErrDeadlineExceeded) {
		c.host.hungSince.Store(c.now().UnixNano())
	}
	return n, err
}

// errHeldOff is the dial error of a host within its holdoff.
type errHeldOff struct {
	addr    string
	ago     time.Duration
	holdoff time.Duration
}

func (e *errHeldOff) Error() string {
	return fmt.Sprintf("%s failed %s ago (refused, unreachable or not writable); not tried again before %s have passed", e.addr, e.ago.Round(time.Millisecond), e.holdoff)
}

// errHung is the dial error of a host that stopped answering.
type errHung struct {
	addr string
	ago  time.Duration
}

func (e *errHung) Error() string {
	return fmt.Sprintf("%s did not answer (a connection to it ran into its deadline %s ago); not dialled again before it answers a probe (one every %s)", e.addr, e.ago.Round(time.Millisecond), hungHoldoff)
}

func (g *hostGate) fail(addr string) {
	g.mu.Lock()
	g.failed[addr] = g.now()
	g.mu.Unlock()
}

func (g *hostGate) ok(addr string) {
	g.mu.Lock()
	delete(g.failed, addr)
	g.mu.Unlock()
}

// dial wraps the driver's DialFunc. Unix sockets are not gated.
func (g *hostGate) dial(next pgconn.DialFunc) pgconn.DialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if network != "tcp" {
			return next(ctx, network, addr)
		}
		g.mu.Lock()
		at, failed := g.failed[addr]
		g.mu.Unlock()
		if ago := g.now().Sub(at); failed && ago < g.holdoff {
			return nil, &errHeldOff{addr, ago, g.holdoff}
		}
		h := g.state(addr)
		if since := h.hungSince.Load(); since != 0 {
			ago := g.now().Sub(time.Unix(0, since))
			if ago >= hungHoldoff && h.probing.CompareAndSwap(false, true) {
				go g.probeHost(h, network, addr, next)
			}
			return nil, &errHung{addr, ago}
		}
		c, err := next(ctx, network, addr)
		if err != nil {
			g.fail(addr)
			return nil, err
		}
		return &gatedConn{Conn: c, host: h, now: g.now}, nil
	}
}

// sslRequest is PostgreSQL's SSLRequest message (length 8, code
// 80877103): the postmaster's child answers it with one byte, 'S' or 'N',
// before anything else of the protocol.
var sslRequest = []byte{0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f}

// probeHost asks a hung host for one byte, in the background, and lifts
// the hung state when it answers (or refuses: a host that is down costs
// callers nothing to try). A host that accepts the connection and says
// nothing (a paused machine: its kernel still accepts) stays hung for
// another hungHoldoff. It lasts at most probeTimeout, its own bound: it
// holds nothing of the store, whose Close need not wait for it.
func (g *hostGate) probeHost(h *hostState, network, addr string, dial pgconn.DialFunc) {
	defer h.probing.Store(false)
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	c, err := dial(ctx, network, addr)
	if err != nil {
		if ctx.Err() == nil {
			h.hungSince.Store(0)
			g.fail(addr)
		} else {
			h.hungSince.Store(g.now().UnixNano())
		}
		return
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	_, err = c.Write(sslRequest)
	if err == nil {
		var b [1]byte
		_, err = c.Read(b[:])
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		h.hungSince.Store(g.now().UnixNano())
		return
	}
	// An answer, or the connection closed or reset by the far end: not a
	// host that holds connections silently.
	h.hungSince.Store(0)
}

// validate wraps the driver's ValidateConnect (the read-write check of
// target_session_attrs): a host that is not writable is held off, one that
// is, cleared. The address is the connection's remote one, which for the
// IP addresses the driver dials (it resolves names first) is the one dial
// saw.
func (g *hostGate) validate(next pgconn.ValidateConnectFunc) pgconn.ValidateConnectFunc {
	return func(ctx context.Context, pc *pgconn.PgConn) error {
		var err error
		if next != nil {
			err = next(ctx, pc)
		}
		addr := pc.Conn().RemoteAddr()
		if addr == nil || addr.Network() != "tcp" {
			return err
		}
		if err != nil {
			g.fail(addr.String())
		} else {
			g.ok(addr.String())
		}
		return err
	}
}
