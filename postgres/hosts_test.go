package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kettlefleet/kettlefleet/internal/blackhole"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// dsnFields splits a keyword/value DSN (pgtest's form).
func dsnFields(dsn string) map[string]string {
	kv := map[string]string{}
	for _, f := range strings.Fields(dsn) {
		k, v, _ := strings.Cut(f, "=")
		kv[k] = v
	}
	return kv
}

// TestHostGate: a host of a multi-host DSN that refused, or turned out not
// writable, is not dialled again within the holdoff (the driver goes on to
// the next host, or fails at once when none is left), and is dialled again
// after it.
func TestHostGate(t *testing.T) {
	dsn := pgtest.Start(t)
	kv := dsnFields(dsn)
	network, target := blackhole.Target(dsn)
	bh, err := blackhole.Listen("127.0.0.1:0", network, target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bh.Close)
	_, port, _ := net.SplitHostPort(bh.Addr().String())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, dead, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()

	now := time.Unix(1e9, 0)
	g := newHostGate(time.Second, func() time.Time { return now })
	var dials sync.Map // address → *atomic.Int64
	count := func(addr string) int64 {
		n, _ := dials.LoadOrStore(addr, new(atomic.Int64))
		return n.(*atomic.Int64).Load()
	}
	readOnly := false
	connect := func() error {
		t.Helper()
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%s,%s user=%s dbname=%s sslmode=disable target_session_attrs=read-write connect_timeout=2", dead, port, kv["user"], kv["dbname"]))
		if err != nil {
			t.Fatal(err)
		}
		next := cfg.DialFunc
		cfg.DialFunc = g.dial(func(ctx context.Context, network, addr string) (net.Conn, error) {
			n, _ := dials.LoadOrStore(addr, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return next(ctx, network, addr)
		})
		validate := cfg.ValidateConnect
		if readOnly {
			validate = func(context.Context, *pgconn.PgConn) error { return errors.New("read-only (as a standby)") }
		}
		cfg.ValidateConnect = g.validate(validate)
		c, err := pgconn.ConnectConfig(context.Background(), cfg)
		if err == nil {
			c.Close(context.Background())
		}
		return err
	}
	deadAddr, liveAddr := "127.0.0.1:"+dead, "127.0.0.1:"+port
	f := func(wantErr bool, wantDead, wantLive int64) {
		t.Helper()
		err := connect()
		if (err != nil) != wantErr {
			t.Errorf("connect: %v, want error %v", err, wantErr)
		}
		if got := count(deadAddr); got != wantDead {
			t.Errorf("the refusing host was dialled %d times, want %d", got, wantDead)
		}
		if got := count(liveAddr); got != wantLive {
			t.Errorf("the live host was dialled %d times, want %d", got, wantLive)
		}
	}
	f(false, 1, 1) // the dead host refuses; the live one is the primary
	f(false, 1, 2) // within the holdoff the dead host is skipped
	now = now.Add(2 * time.Second)
	f(false, 2, 3) // after it, tried again
	readOnly = true
	f(true, 2, 4) // the live host is not writable: both held off now
	readOnly = false
	err = connect()
	var held *errHeldOff
	if !errors.As(err, &held) || count(liveAddr) != 4 {
		t.Errorf("within the holdoff of both hosts: %v (live host dialled %d times), want an immediate failure naming the holdoff, no dial", err, count(liveAddr))
	}
	now = now.Add(2 * time.Second)
	f(false, 3, 5) // a primary again: found at the next attempt after the holdoff
}

// TestHungHost: the first host of a multi-host DSN stops answering without
// refusing (a paused or cut-off machine: its connections stay open, its
// kernel or nobody holds them). The pool's idle connections to it are not
// each pinged until the caller's deadline: the first costs at most
// pingTimeout, the host is then held off and the rest are dropped, and the
// writes go to the next host. Against pgxpool's defaults (no ping
// timeout) every write here fails at its 3 s deadline.
func TestHungHost(t *testing.T) {
	kv, ports, proxies := twoHosts(t)
	hung := proxies[0]
	multi := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%s,%s user=%s dbname=%s sslmode=disable target_session_attrs=read-write connect_timeout=2", ports[0], ports[1], kv["user"], kv["dbname"])
	// Every connection is pinged before it is handed out (pingIdle), as
	// each one idle over pgxpool's second is: the rule is met at once
	// instead of waited out.
	s, err := Open(context.Background(), multi, Options{MaxConns: 6, CompactEvery: time.Hour, pingIdle: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Six connections open at once, all to the first host, then idle.
	var wg sync.WaitGroup
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.pool.Exec(context.Background(), "SELECT pg_sleep(0.2)"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := s.pool.Stat().IdleConns(); n < 4 {
		t.Fatalf("%d idle connections, want the pool's several", n)
	}
	hung.Block(true)
	defer hung.Block(false)
	start := time.Now()
	for i := range 4 {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		t0 := time.Now()
		_, err := s.pool.Exec(ctx, "SELECT 1")
		cancel()
		if err != nil {
			t.Errorf("write %d after the first host hung: %v (after %s)", i, err, time.Since(t0).Round(time.Millisecond))
		}
		t.Logf("write %d: %s", i, time.Since(t0).Round(time.Millisecond))
	}
	if took := time.Since(start); took > pingTimeout+2*time.Second {
		t.Errorf("four writes after the first host hung took %s, want ≤ %s (one ping timeout, then the next host)", took.Round(time.Millisecond), pingTimeout+2*time.Second)
	}
}

// TestHungHostProbe: a host that accepts connections and never answers (a
// paused machine) is, once found out, not dialled by the writes again:
// past the hung holdoff a probe in the background asks it for a byte, and
// the writes go straight to the next host meanwhile instead of each
// waiting out a connect_timeout on it. Once it answers the probe it is
// dialled again.
func TestHungHostProbe(t *testing.T) {
	kv, ports, proxies := twoHosts(t)
	paused := proxies[0]
	pausedAddr := "127.0.0.1:" + ports[0]
	var mu sync.Mutex
	now := time.Unix(1e9, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	g := newHostGate(time.Second, clock)
	var toPaused atomic.Int64 // connections the writes (not the probe) opened to the paused host
	connect := func() (time.Duration, error) {
		t.Helper()
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%s,%s user=%s dbname=%s sslmode=disable target_session_attrs=read-write connect_timeout=2", ports[0], ports[1], kv["user"], kv["dbname"]))
		if err != nil {
			t.Fatal(err)
		}
		gated := g.dial(cfg.DialFunc)
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := gated(ctx, network, addr)
			if err == nil && addr == pausedAddr {
				toPaused.Add(1)
			}
			return c, err
		}
		cfg.ValidateConnect = g.validate(cfg.ValidateConnect)
		start := time.Now()
		c, err := pgconn.ConnectConfig(context.Background(), cfg)
		if err == nil {
			c.Close(context.Background())
		}
		return time.Since(start), err
	}
	state := g.state(pausedAddr)
	probed := func(what string) {
		t.Helper()
		if !testkit.Poll(10*time.Second, 10*time.Millisecond, func() bool { return !state.probing.Load() }) {
			t.Fatalf("%s: the probe still out after 10 s (it is bounded by %s)", what, probeTimeout)
		}
	}

	paused.Block(true)
	// Found out the first time: the handshake runs into connect_timeout.
	if _, err := connect(); err != nil {
		t.Fatalf("first connection with the first host paused: %v", err)
	}
	if state.hungSince.Load() == 0 {
		t.Fatal("the paused host is not marked as not answering after a handshake ran into its deadline")
	}
	for i, wait := range []time.Duration{0, hungHoldoff, hungHoldoff} {
		advance(wait)
		before := toPaused.Load()
		took, err := connect()
		if err != nil {
			t.Fatalf("connection %d with the first host paused: %v", i, err)
		}
		if toPaused.Load() != before || took > time.Second {
			t.Errorf("connection %d with the first host paused (%s after it was found out): took %s, dialled it %d times; want it skipped (probed in the background)", i, wait, took.Round(time.Millisecond), toPaused.Load()-before)
		}
		probed("paused")
		if state.hungSince.Load() == 0 {
			t.Errorf("connection %d: a probe of the paused host lifted its hung state", i)
		}
	}

	paused.Block(false)
	advance(hungHoldoff)
	if _, err := connect(); err != nil {
		t.Fatal(err)
	}
	probed("resumed")
	if state.hungSince.Load() != 0 {
		t.Fatal("the resumed host answered the probe, yet it is still marked as not answering")
	}
	before := toPaused.Load()
	if _, err := connect(); err != nil || toPaused.Load() != before+1 {
		t.Errorf("after the resumed host answered: %v, dialled it %d times, want once (it is the first host and writable)", err, toPaused.Load()-before)
	}
}

// twoHosts starts a throwaway PostgreSQL behind two blackhole proxies: the
// two hosts of a multi-host DSN (its fields, the proxies' ports).
func twoHosts(t *testing.T) (map[string]string, []string, []*blackhole.Proxy) {
	t.Helper()
	dsn := pgtest.Start(t)
	network, target := blackhole.Target(dsn)
	var ports []string
	var proxies []*blackhole.Proxy
	for range 2 {
		p, err := blackhole.Listen("127.0.0.1:0", network, target)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		_, port, _ := net.SplitHostPort(p.Addr().String())
		ports, proxies = append(ports, port), append(proxies, p)
	}
	return dsnFields(dsn), ports, proxies
}
