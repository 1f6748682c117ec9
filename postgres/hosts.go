package postgres

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultHostHoldoff is Options.HostHoldoff's default.
const DefaultHostHoldoff = 100 * time.Millisecond

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
type hostGate struct {
	holdoff time.Duration
	now     func() time.Time
	mu      sync.Mutex
	failed  map[string]time.Time // address (IP:port) → when it last failed
}

func newHostGate(holdoff time.Duration, now func() time.Time) *hostGate {
	return &hostGate{holdoff: holdoff, now: now, failed: map[string]time.Time{}}
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
		c, err := next(ctx, network, addr)
		if err != nil {
			g.fail(addr)
		}
		return c, err
	}
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
