package storetest

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// testLookup pins what a node's credential lookup (fleet.Service.Issued)
// relies on: Device finds a device as soon as the Register or Write that
// made it has returned, read on other connections while more registrations
// commit; an id never registered is ENotFound; and a store that cannot
// answer (here: the caller's deadline already passed) says so with any
// other code — a kettle is told 401 only on ENotFound.
func testLookup(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	const n = 200
	v := ids(21, n+1)
	unknown := v[n]
	rng := rand.New(rand.NewPCG(21, 1))
	made := make(chan kettle.DeviceID, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var missing []kettle.DeviceID
	for range 4 {
		wg.Go(func() {
			for id := range made {
				if _, err := s.Device(ctx, id); err != nil {
					mu.Lock()
					missing = append(missing, id)
					mu.Unlock()
					t.Errorf("Device(%s) right after its registration returned: %v (code %q)", id, err, kettle.ErrorCode(err))
				}
			}
		})
	}
	for i, id := range v[:n] {
		// Half registered as POST /login does, half by a first reading
		// (a v1 kettle's upload).
		if i%2 == 0 {
			if err := s.Register(ctx, []kettle.DeviceID{id}, at(time.Duration(i)*time.Second)); err != nil {
				t.Fatal(err)
			}
		} else {
			write(t, s, []kettle.Measurement{reading(rng, id, at(time.Duration(i)*time.Second))}, at(time.Hour))
		}
		made <- id
	}
	close(made)
	wg.Wait()
	if len(missing) > 0 {
		t.Fatalf("%d of %d devices not found right after their registration", len(missing), n)
	}
	if _, err := s.Device(ctx, unknown); kettle.ErrorCode(err) != kettle.ENotFound {
		t.Errorf("Device(never registered) = %v (code %q), want %q", err, kettle.ErrorCode(err), kettle.ENotFound)
	}
	gone, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	for _, id := range []kettle.DeviceID{v[0], unknown} {
		if _, err := s.Device(gone, id); err == nil || kettle.ErrorCode(err) == kettle.ENotFound {
			t.Errorf("Device(%s) past its deadline = %v (code %q): want an error other than %q (the store could not say)", id, err, kettle.ErrorCode(err), kettle.ENotFound)
		}
	}
}
