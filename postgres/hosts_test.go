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
)

// TestHostGate: a host of a multi-host DSN that refused, or turned out not
// writable, is not dialled again within the holdoff (the driver goes on to
// the next host, or fails at once when none is left), and is dialled again
// after it.
func TestHostGate(t *testing.T) {
	dsn := pgtest.Start(t)
	kv := map[string]string{}
	for _, f := range strings.Fields(dsn) {
		k, v, _ := strings.Cut(f, "=")
		kv[k] = v
	}
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
