package fleet_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
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

// gatedStore counts Device calls, the most in flight at once, and holds
// each until gate is closed (nil: no hold).
type gatedStore struct {
	kettle.Store
	gate             chan struct{}
	calls, now, most atomic.Int64
	entered          chan struct{} // one send per call, if not nil
}

func (s *gatedStore) Device(ctx context.Context, id kettle.DeviceID) (kettle.DeviceState, error) {
	s.calls.Add(1)
	n := s.now.Add(1)
	defer s.now.Add(-1)
	for m := s.most.Load(); n > m && !s.most.CompareAndSwap(m, n); m = s.most.Load() {
	}
	if s.entered != nil {
		s.entered <- struct{}{}
	}
	if s.gate != nil {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return kettle.DeviceState{}, &kettle.Error{Code: kettle.EUnavailable, Message: "device lookup", Cause: ctx.Err()}
		}
	}
	return s.Store.Device(ctx, id)
}

func lookupService(t *testing.T, cfg fleet.Config, now func() time.Time) (*fleet.Service, kettle.Store, *gatedStore) {
	t.Helper()
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	gs := &gatedStore{Store: st}
	svc, err := fleet.New(context.Background(), gs, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), now, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Close(); st.Close() })
	return svc, st, gs
}

// TestIssuedLooksUpTheStore: a device another process registered after
// this node loaded its cache (a case-study login on another node) is
// issued: found in the store, then cached with its stored state (a poll
// gets the command of its latest reading); a revoked one is not, and is
// cached as revoked; an id the store does not hold is not, and is
// remembered for fleet.LookupMissTTL (no second lookup meanwhile).
func TestIssuedLooksUpTheStore(t *testing.T) {
	clk := newClock(time.Now())
	svc, st, gs := lookupService(t, fleet.Config{}, clk.now)
	ctx := context.Background()
	other, revoked, never := uuid.New(), uuid.New(), uuid.New()
	if err := st.Register(ctx, []kettle.DeviceID{other, revoked}, clk.now()); err != nil {
		t.Fatal(err)
	}
	low := reading(other, clk.now().Add(-time.Minute).UTC().Truncate(time.Microsecond), 900)
	low.ChargeMWh = 5
	if _, err := st.Write(ctx, []kettle.Measurement{low}, clk.now()); err != nil {
		t.Fatal(err)
	}
	if err := st.Revoke(ctx, revoked, clk.now()); err != nil {
		t.Fatal(err)
	}
	if svc.Registered(other) || svc.Revoked(revoked) {
		t.Fatal("the node knew of the other process's devices before a lookup (no refresh runs here)")
	}
	f := func(id kettle.DeviceID, want bool, wantCalls int64, want1 fleet.LookupStats) {
		t.Helper()
		ok, err := svc.Issued(ctx, id)
		if err != nil || ok != want {
			t.Fatalf("Issued(%s) = %v, %v; want %v, nil", id, ok, err, want)
		}
		got := svc.Lookups()
		got.Misses, got.MissesMax = 0, 0
		if c := gs.calls.Load(); c != wantCalls || got != want1 {
			t.Fatalf("Issued(%s): %d store lookups, %+v; want %d, %+v", id, c, got, wantCalls, want1)
		}
	}
	f(other, true, 1, fleet.LookupStats{Found: 1})
	f(other, true, 1, fleet.LookupStats{Found: 1}) // cached
	if !svc.Registered(other) || !mustCommand(svc, other).Charge {
		t.Errorf("after the lookup: registered %v, command %+v; want registered, charging (its stored reading)", svc.Registered(other), mustCommand(svc, other))
	}
	f(revoked, false, 2, fleet.LookupStats{Found: 2})
	f(revoked, false, 2, fleet.LookupStats{Found: 2})
	if !svc.Revoked(revoked) {
		t.Error("a revoked device looked up is not cached as revoked")
	}
	f(never, false, 3, fleet.LookupStats{Found: 2, Unknown: 1})
	f(never, false, 3, fleet.LookupStats{Found: 2, Unknown: 1, MissHits: 1})
	if m := svc.Lookups(); m.Misses != 1 || m.MissesMax < 1000 {
		t.Errorf("remembered misses %d of %d, want 1 of some thousands", m.Misses, m.MissesMax)
	}
	clk.add(fleet.LookupMissTTL)
	f(never, false, 4, fleet.LookupStats{Found: 2, Unknown: 2, MissHits: 1})
	// Registered since (as a v1 upload does on another node): found once
	// the miss expired.
	if err := st.Register(ctx, []kettle.DeviceID{never}, clk.now()); err != nil {
		t.Fatal(err)
	}
	clk.add(fleet.LookupMissTTL)
	f(never, true, 5, fleet.LookupStats{Found: 3, Unknown: 2, MissHits: 1})
}

// TestIssuedWhenTheStoreCannotSay: a lookup the store does not answer
// within --store-timeout, or answers with an error, is a 503 with
// Retry-After naming what to do, never "not issued", and is not remembered
// as a miss.
func TestIssuedWhenTheStoreCannotSay(t *testing.T) {
	svc, st, gs := lookupService(t, fleet.Config{StoreTimeout: 50 * time.Millisecond}, nil)
	ctx := context.Background()
	id := uuid.New()
	if err := st.Register(ctx, []kettle.DeviceID{id}, time.Now()); err != nil {
		t.Fatal(err)
	}
	gs.gate = make(chan struct{}) // the store does not answer
	check := func(what, says string) {
		t.Helper()
		ok, err := svc.Issued(ctx, id)
		var ke *kettle.Error
		if ok || !errors.As(err, &ke) || ke.Code != kettle.EUnavailable || ke.RetryAfter <= 0 {
			t.Fatalf("%s: Issued = %v, %v; want an unavailable error with a Retry-After", what, ok, err)
		}
		if !strings.Contains(ke.Message, says) {
			t.Errorf("%s: %q does not say %q", what, ke.Message, says)
		}
	}
	check("store silent", "did not answer within 50ms (--store-timeout); retry after 1s")
	st.Close() // the store fails at once
	gs.gate = nil
	check("store closed", "the store is unavailable; retry after 1s")
	if m := svc.Lookups(); m.Failed != 2 || m.Unknown != 0 || m.Misses != 0 {
		t.Errorf("%+v: want 2 failed lookups, none unknown or remembered", m)
	}
}

// TestIssuedSharesAndBoundsLookups: many requests for one id not yet known
// make one store lookup; requests for many such ids hold at most a few
// lookups in flight at once, the rest waiting for a slot; a caller that
// goes away leaves the lookup to the others.
func TestIssuedSharesAndBoundsLookups(t *testing.T) {
	svc, st, gs := lookupService(t, fleet.Config{}, nil)
	ctx := context.Background()
	ids := make([]kettle.DeviceID, 40)
	for i := range ids {
		ids[i] = uuid.New()
	}
	if err := st.Register(ctx, ids, time.Now()); err != nil {
		t.Fatal(err)
	}
	gs.gate, gs.entered = make(chan struct{}), make(chan struct{}, 100)
	var wg sync.WaitGroup
	var bad atomic.Int64
	ask := func(id kettle.DeviceID) {
		if ok, err := svc.Issued(ctx, id); !ok || err != nil {
			bad.Add(1)
			t.Errorf("Issued(%s) = %v, %v", id, ok, err)
		}
	}
	// One id, 50 callers (and one that leaves), one lookup.
	gone, cancel := context.WithCancel(ctx)
	left := make(chan error, 1)
	go func() { _, err := svc.Issued(gone, ids[0]); left <- err }()
	<-gs.entered
	for range 50 {
		wg.Go(func() { ask(ids[0]) })
	}
	cancel()
	if err := <-left; err == nil {
		t.Error("a caller that went away got no error")
	}
	close(gs.gate)
	wg.Wait()
	if n := gs.calls.Load(); n != 1 {
		t.Errorf("51 concurrent checks of one id: %d store lookups, want 1", n)
	}
	// 39 ids at once: at most 8 lookups in flight.
	gs.gate = make(chan struct{})
	for _, id := range ids[1:] {
		wg.Go(func() { ask(id) })
	}
	for range 8 {
		<-gs.entered
	}
	select {
	case <-gs.entered:
		t.Error("a ninth lookup entered the store while eight were held")
	case <-time.After(100 * time.Millisecond):
	}
	close(gs.gate)
	wg.Wait()
	if most, n := gs.most.Load(), gs.calls.Load(); most != 8 || n != 40 || bad.Load() != 0 {
		t.Errorf("39 ids at once: at most %d lookups in flight (want 8), %d in all (want 40)", most, n)
	}
}
