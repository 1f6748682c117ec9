package fleet_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// clock is a fake time source the test moves by hand.
type clock struct{ ns atomic.Int64 }

func (c *clock) now() time.Time      { return time.Unix(0, c.ns.Load()) }
func (c *clock) add(d time.Duration) { c.ns.Add(int64(d)) }
func newClock(t time.Time) *clock    { c := &clock{}; c.ns.Store(t.UnixNano()); return c }
func rateService(t testing.TB, cfg fleet.Config, now func() time.Time) *fleet.Service {
	t.Helper()
	svc, _ := newServiceWith(t, cfg, now, io.Discard)
	return svc
}

// TestDeviceRate: with --device-rate 2 and --device-burst 3, a kettle gets 3
// requests at once, then one every 500 ms; a refused request takes nothing
// and says how long to wait; other kettles are not touched; Pace never
// refuses and spaces a burst of publishes 500 ms apart; concurrent requests
// never get more than the rate allows. Without --device-rate nothing is
// limited.
func TestDeviceRate(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	svc := rateService(t, fleet.Config{DeviceRate: 2, DeviceBurst: 3}, clk.now)
	ids, err := svc.Register(context.Background(), 3)
	if err != nil {
		t.Fatal(err)
	}
	a, b, c := ids[0], ids[1], ids[2]
	allow := func(id kettle.DeviceID, wantWait time.Duration) {
		t.Helper()
		err := svc.Allow(id)
		var ke *kettle.Error
		switch {
		case wantWait == 0 && err != nil:
			t.Errorf("at +%s: Allow = %v, want allowed", time.Duration(clk.ns.Load()%int64(time.Minute)), err)
		case wantWait > 0 && (!errors.As(err, &ke) || ke.Code != kettle.ETooMany || ke.RetryAfter != wantWait):
			t.Errorf("at +%s: Allow = %#v, want ETooMany with RetryAfter %s", time.Duration(clk.ns.Load()%int64(time.Minute)), err, wantWait)
		}
	}
	allow(a, 0)
	allow(a, 0)
	allow(a, 0)
	allow(a, 500*time.Millisecond) // the burst is spent
	allow(a, 500*time.Millisecond) // refused requests take nothing
	allow(b, 0)                    // another kettle has its own
	clk.add(200 * time.Millisecond)
	allow(a, 300*time.Millisecond)
	clk.add(300 * time.Millisecond)
	allow(a, 0)
	allow(a, 500*time.Millisecond)
	clk.add(10 * time.Second) // idle: the burst is back, no more
	allow(a, 0)
	allow(a, 0)
	allow(a, 0)
	allow(a, 500*time.Millisecond)
	allow(uuid.New(), 0) // not in the cache: not limited (its credential is checked elsewhere)

	// Pace: the first 3 at once, then each 500 ms after the one before.
	for i, want := range []time.Duration{0, 0, 0, 500 * time.Millisecond, time.Second, 1500 * time.Millisecond} {
		if got := svc.Pace(c); got != want {
			t.Errorf("Pace #%d = %s, want %s", i+1, got, want)
		}
	}
	if l := svc.Limits(); l.DeviceRefused != 5 || l.DevicePaced != 3 {
		t.Errorf("Limits() = %+v; want 5 refused, 3 paced", l)
	}

	// Concurrent requests of one kettle at one instant: exactly the burst.
	var ok atomic.Int64
	var wg sync.WaitGroup
	clk.add(time.Minute)
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if svc.Allow(b) == nil {
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	if ok.Load() != 3 {
		t.Errorf("64 concurrent requests of one kettle: %d allowed, want the burst, 3", ok.Load())
	}

	// The log names a kettle over its rate, once a second at most.
	var buf bytes.Buffer
	logged, _ := newServiceWith(t, fleet.Config{DeviceRate: 1, DeviceBurst: 1}, clk.now, &buf)
	ids, _ = logged.Register(context.Background(), 1)
	for range 100 {
		logged.Allow(ids[0])
	}
	if n := strings.Count(buf.String(), "kettle over --device-rate"); n != 1 || !strings.Contains(buf.String(), "device="+ids[0].String()) {
		t.Errorf("99 requests over the rate in a moment: %d log lines, want 1 naming the device:\n%s", n, buf.String())
	}

	off := rateService(t, fleet.Config{}, clk.now)
	ids, _ = off.Register(context.Background(), 1)
	for range 1000 {
		if err := off.Allow(ids[0]); err != nil || off.Pace(ids[0]) != 0 {
			t.Fatalf("without --device-rate: Allow %v", err)
		}
	}
}

// TestLoginRateAndRegistryBound: --login-rate 1 with bursts of 3 over all
// clients (fake clock); --max-devices 5 refuses registrations past it,
// counted.
func TestLoginRateAndRegistryBound(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	svc := rateService(t, fleet.Config{LoginRate: 1, LoginBurst: 3, MaxDevices: 5}, clk.now)
	login := func(wantWait time.Duration) {
		t.Helper()
		err := svc.AllowLogin(netip.Addr{})
		var ke *kettle.Error
		if wantWait == 0 && err != nil || wantWait > 0 && (!errors.As(err, &ke) || ke.Code != kettle.ETooMany || ke.RetryAfter != wantWait || !strings.Contains(ke.Message, "--login-rate")) {
			t.Errorf("AllowLogin = %v, want a wait of %s", err, wantWait)
		}
	}
	login(0)
	login(0)
	login(0)
	login(time.Second)
	clk.add(400 * time.Millisecond)
	login(600 * time.Millisecond)
	clk.add(600 * time.Millisecond)
	login(0)

	if _, err := svc.Register(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	_, err := svc.Register(context.Background(), 2)
	var ke *kettle.Error
	if !errors.As(err, &ke) || ke.Code != kettle.EForbidden || !strings.Contains(ke.Message, "--max-devices") || svc.DeviceCount() != 4 {
		t.Errorf("registering 2 past --max-devices 5 with 4 held: %v, %d devices", err, svc.DeviceCount())
	}
	if _, err := svc.Register(context.Background(), 1); err != nil || svc.DeviceCount() != 5 {
		t.Errorf("the 5th: %v, %d devices", err, svc.DeviceCount())
	}
	if _, err := svc.Register(context.Background(), 1); kettle.ErrorCode(err) != kettle.EForbidden {
		t.Errorf("the 6th: %v, want EForbidden", err)
	}
	if l := svc.Limits(); l.LoginsRefused != 2 || l.RegistryFull != 2 {
		t.Errorf("Limits() = %+v, want 2 logins refused, 2 registrations past the bound", l)
	}
}

// TestLoginRatePerSource: --login-rate-per-source 1 with bursts of 2 (fake
// clock): each IPv4 address and each IPv6 /64 has its own; a login refused
// by it does not take from --login-rate over all clients (here bursts of 5),
// which still applies after it.
func TestLoginRatePerSource(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	svc := rateService(t, fleet.Config{LoginSourceRate: 1, LoginSourceBurst: 2, LoginRate: 1, LoginBurst: 5}, clk.now)
	login := func(from string, wantWait time.Duration, wantFlag string) {
		t.Helper()
		err := svc.AllowLogin(netip.MustParseAddr(from))
		var ke *kettle.Error
		if wantWait == 0 && err != nil || wantWait > 0 && (!errors.As(err, &ke) || ke.Code != kettle.ETooMany || ke.RetryAfter != wantWait || !strings.Contains(ke.Message, "("+wantFlag+",")) {
			t.Errorf("AllowLogin(%s) = %v, want a wait of %s naming %s", from, err, wantWait, wantFlag)
		}
	}
	login("192.0.2.1", 0, "")
	login("::ffff:192.0.2.1", 0, "") // the same address, IPv4-mapped
	login("192.0.2.1", time.Second, "--login-rate-per-source")
	login("2001:db8::1", 0, "")
	login("2001:db8::2", 0, "") // the same /64
	login("2001:db8::3", time.Second, "--login-rate-per-source")
	login("2001:db8:0:1::1", 0, "")                    // the 5th of the burst over all clients
	login("198.51.100.7", time.Second, "--login-rate") // a fresh address: the shared rate
	clk.add(time.Second)
	login("192.0.2.1", 0, "")
	if l := svc.Limits(); l.SourceRefused != 2 || l.LoginsRefused != 1 {
		t.Errorf("Limits() = %+v, want 2 refused by source, 1 by the shared rate", l)
	}
	if err := svc.AllowLogin(netip.Addr{}); err == nil {
		t.Errorf("a login from an unknown address past --login-rate: allowed")
	}
}

// TestLoginSourcesBounded: the per-source table holds at most 65,536
// addresses. Full of sources within their bursts, a new one is held to the
// shared rate only (counted); once their TATs have passed, the next new
// source sweeps them out and is limited again.
func TestLoginSourcesBounded(t *testing.T) {
	clk := newClock(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	svc := rateService(t, fleet.Config{LoginSourceRate: 1, LoginSourceBurst: 1}, clk.now)
	for i := range 65536 {
		if err := svc.AllowLogin(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})); err != nil {
			t.Fatalf("source %d: %v", i, err)
		}
	}
	extra := netip.MustParseAddr("10.1.0.1")
	for i := range 3 {
		if err := svc.AllowLogin(extra); err != nil {
			t.Errorf("login %d from a new source, the table full: %v; want allowed (untracked)", i+1, err)
		}
	}
	if l := svc.Limits(); l.SourcesUntracked != 3 {
		t.Errorf("SourcesUntracked = %d, want 3", l.SourcesUntracked)
	}
	clk.add(time.Second)
	if err := svc.AllowLogin(extra); err != nil {
		t.Errorf("after the others' TATs passed: %v", err)
	}
	if err := svc.AllowLogin(extra); kettle.ErrorCode(err) != kettle.ETooMany {
		t.Errorf("its second login at once, bursts of 1: %v; want refused (tracked again)", err)
	}
	if l := svc.Limits(); l.SourcesUntracked != 3 || l.SourceRefused != 1 {
		t.Errorf("Limits() = %+v, want 3 untracked, 1 refused", l)
	}
}

// TestRegistryBoundConcurrent: --max-devices is exact on a node however
// many registrations race for the last slots (each a store transaction):
// 40 of 200 concurrent logins get one with 10 held, the rest are refused,
// and the node holds 50.
func TestRegistryBoundConcurrent(t *testing.T) {
	svc := rateService(t, fleet.Config{MaxDevices: 50}, nil)
	if _, err := svc.Register(context.Background(), 10); err != nil {
		t.Fatal(err)
	}
	var ok, refused, other atomic.Int64
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := svc.Register(context.Background(), 1)
			switch kettle.ErrorCode(err) {
			case "":
				ok.Add(1)
			case kettle.EForbidden:
				refused.Add(1)
			default:
				other.Add(1)
				t.Error(err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if ok.Load() != 40 || refused.Load() != 160 || other.Load() != 0 || svc.DeviceCount() != 50 {
		t.Errorf("200 concurrent registrations with 10 of 50 held: %d registered, %d refused, %d failed; the node holds %d, want 40, 160, 0 and 50",
			ok.Load(), refused.Load(), other.Load(), svc.DeviceCount())
	}
}

// BenchmarkAllow: the cost --device-rate adds to every device request
// (off: one comparison; on: the cache's read lock, a map lookup and a
// compare-and-swap), many kettles from all processors.
func BenchmarkAllow(b *testing.B) {
	for _, rate := range []float64{0, 1e6} {
		b.Run(fmt.Sprintf("rate=%g", rate), func(b *testing.B) {
			svc := rateService(b, fleet.Config{DeviceRate: rate, DeviceBurst: 10}, nil)
			ids, err := svc.Register(context.Background(), 10_000)
			if err != nil {
				b.Fatal(err)
			}
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					svc.Allow(ids[next.Add(1)%int64(len(ids))])
				}
			})
		})
	}
}

// lateAckStore commits a registration only after the caller's context ends
// (or 100 ms), then reports that context's error: as a PostgreSQL commit
// whose answer arrives after the client cancelled — stored, but the call
// failed.
type lateAckStore struct{ kettle.Store }

func (s lateAckStore) Register(ctx context.Context, ids []kettle.DeviceID, at time.Time) error {
	select {
	case <-ctx.Done():
	case <-time.After(100 * time.Millisecond):
	}
	if err := s.Store.Register(context.Background(), ids, at); err != nil {
		return err
	}
	return ctx.Err()
}

// TestRegisterOutlivesClient: a login whose client goes away while its
// registration commits still counts on the node (the registry bound, the
// registered gauge, a later prune), because the registration does not run
// on the client's context: the node holds what the store holds.
func TestRegisterOutlivesClient(t *testing.T) {
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	svc, err := fleet.New(context.Background(), lateAckStore{st}, fleet.Config{MaxDevices: 10}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Close(); st.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	_, regErr := svc.Register(ctx, 3)
	stored := 0
	if err := st.Scan(context.Background(), func(kettle.DeviceState) error { stored++; return nil }); err != nil {
		t.Fatal(err)
	}
	if stored != 3 || svc.DeviceCount() != stored || regErr != nil {
		t.Errorf("registering 3 devices, the client gone after 10 ms: the store holds %d, the node counts %d (Register: %v); want 3, 3 and no error",
			stored, svc.DeviceCount(), regErr)
	}
}
