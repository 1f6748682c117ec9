package fleet

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"
	"golang.org/x/sync/singleflight"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/minheap"
)

// A case-study kettle gets its id from POST /login on one node and sends
// it to whichever node the balancer picks next. A node that has not seen
// the registration yet (its cache refreshes every Config.Refresh) asks the
// store instead of refusing an id the fleet issued: the node that answered
// the login did so after its commit, and the lookup reads the primary
// (kettle.Store.Device), so the store always has it. Lookups are shared
// per id (singleflight), at most maxLookups run at once, each bounded by
// Config.StoreTimeout, and ids the store does not hold are remembered for
// LookupMissTTL (at most maxMisses of them), so a client repeating a
// made-up or pruned id is answered from memory, not by the database.
//
// Self-verifying ids (a MAC under the fleet's secret) would need no store,
// but every id issued before them would stop working; the store holds the
// truth already.

const (
	// maxLookups bounds the store lookups in flight; more wait for a slot
	// within Config.StoreTimeout.
	maxLookups = 8
	// maxMisses bounds the ids remembered as unknown.
	maxMisses = 4096
)

// LookupMissTTL is how long a node remembers an id the store did not hold
// (Issued answers false for it without a lookup meanwhile).
const LookupMissTTL = 10 * time.Second

// lookups is Issued's state.
type lookups struct {
	flight singleflight.Group
	slots  *semaphore.Weighted
	missMu sync.Mutex
	misses missCache
	// what the lookups found (LookupStats)
	lookupFound, lookupUnknown, lookupFailed, missHits atomic.Int64
}

// LookupStats counts, since start, the credentials this node did not have
// in memory and looked up in the store.
type LookupStats struct {
	Found   int64 // registered (by another node since this one's refresh)
	Unknown int64 // not in the store: refused, and remembered for LookupMissTTL
	Failed  int64 // the store could not say (503 + Retry-After)
	// refused from the remembered misses, without a lookup
	MissHits int64
	// ids remembered as unknown now, and at most
	Misses, MissesMax int
}

// Lookups reports the store lookups of unknown credentials.
func (s *Service) Lookups() LookupStats {
	s.missMu.Lock()
	n := len(s.misses.until)
	s.missMu.Unlock()
	return LookupStats{s.lookupFound.Load(), s.lookupUnknown.Load(), s.lookupFailed.Load(), s.missHits.Load(), n, maxMisses}
}

// Issued reports whether id is a device the fleet registered and did not
// revoke (the case-study credential check). It answers from memory for a
// device this node knows or remembers as unknown, and otherwise from the
// store (see lookups); when the store cannot say, it returns an
// EUnavailable error (503 + Retry-After), never false.
func (s *Service) Issued(ctx context.Context, id kettle.DeviceID) (bool, error) {
	if ok, known := s.issuedHere(id); known {
		return ok, nil
	}
	ch := s.flight.DoChan(string(id[:]), func() (any, error) {
		// A flight that ended between this caller's look and its DoChan
		// has cached its answer: no second store lookup.
		if ok, known := s.issuedHere(id); known {
			return ok, nil
		}
		return s.lookup(id)
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return false, r.Err
		}
		return r.Val.(bool), nil
	case <-ctx.Done():
		// The client went away or its deadline passed; the lookup goes
		// on for the others waiting on it.
		return false, s.unavailable("look up device", ctx.Err())
	}
}

// issuedHere answers Issued from this node alone: known reports whether
// the device is cached or remembered as unknown, ok whether it is issued.
func (s *Service) issuedHere(id kettle.DeviceID) (ok, known bool) {
	s.mu.RLock()
	d := s.cache.get(id)
	ok = d != nil && !d.revoked
	s.mu.RUnlock()
	if d != nil {
		return ok, true
	}
	now := s.now().UnixNano()
	s.missMu.Lock()
	miss := s.misses.has(id, now)
	s.missMu.Unlock()
	if miss {
		s.missHits.Add(1)
		return false, true
	}
	return false, false
}

// lookup asks the store about id, once for every caller waiting on it, and
// caches the answer. It does not run on a caller's context: the first
// caller leaving must not fail the others; Config.StoreTimeout bounds it.
func (s *Service) lookup(id kettle.DeviceID) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.StoreTimeout)
	defer cancel()
	if err := s.slots.Acquire(ctx, 1); err != nil {
		s.lookupFailed.Add(1)
		return false, s.unavailable("look up device", err)
	}
	began := s.now()
	d, err := s.store.Device(ctx, id)
	s.slots.Release(1)
	switch {
	case err == nil:
		s.lookupFound.Add(1)
		s.mu.Lock()
		moved := s.merge(d, began)
		s.mu.Unlock()
		if moved {
			s.changed([]kettle.DeviceID{id})
		}
		return d.RevokedAt.IsZero(), nil
	case kettle.ErrorCode(err) == kettle.ENotFound:
		s.lookupUnknown.Add(1)
		s.missMu.Lock()
		s.misses.add(id, s.now().UnixNano())
		s.missMu.Unlock()
		return false, nil
	default:
		s.lookupFailed.Add(1)
		return false, s.unavailable("look up device", err)
	}
}

// missCache is the ids the store did not hold, each until its expiry (unix
// ns), at most maxMisses: when full, the one that expires first goes.
type missCache struct {
	until map[kettle.DeviceID]int64
	order minheap.Heap[miss]
}

type miss struct {
	id    kettle.DeviceID
	until int64
}

func (m miss) When() int64 { return m.until }

func (c *missCache) has(id kettle.DeviceID, now int64) bool {
	u, ok := c.until[id]
	return ok && now < u
}

// add remembers id as unknown from now (unix ns) for LookupMissTTL,
// dropping the expired entries first and then, when full, the one closest
// to expiry.
func (c *missCache) add(id kettle.DeviceID, now int64) {
	if c.until == nil {
		c.until = make(map[kettle.DeviceID]int64)
	}
	for len(c.order) > 0 && (len(c.order) >= maxMisses || c.order[0].until <= now) {
		e := c.order.Pop()
		if c.until[e.id] == e.until { // not since remembered again
			delete(c.until, e.id)
		}
	}
	until := now + int64(LookupMissTTL)
	c.until[id] = until
	c.order.Push(miss{id, until})
}
