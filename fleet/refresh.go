package fleet

import (
	"context"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
)

// cacheRefresh is the refresher's state. With a store several processes
// write (kettle.Nodes): this node's id in it, the others it saw alive at
// the last beat (-1: not known yet, or the beat failed), the refreshes
// run and the beats that failed.
type cacheRefresh struct {
	stopRefresh chan struct{}
	refreshDone chan struct{}
	node        uuid.UUID
	peers       atomic.Int64
	refreshes   atomic.Uint64
	beatsFailed atomic.Uint64
	wasAlone    bool // at the previous beat (refresher goroutine only)
	decided     bool // a beat has answered (refresher goroutine only)
}

// refresher merges the store's device states into the cache every
// cfg.Refresh until Close. The first refresh comes after a random part of
// the period, and each next one a period after the previous one ended, so
// nodes started together (a deploy, bench/mqtt-fleet.sh) do not all scan
// the store at the same moment: in a 100,000-kettle run the six nodes'
// scans ran in step, every 30 s, and while the machine was saturated they
// all took longer than that, failed and started again together.
func (s *Service) refresher() {
	defer close(s.refreshDone)
	t := time.NewTimer(time.Duration(rand.Int64N(int64(s.cfg.Refresh))) + 1)
	defer t.Stop()
	for {
		select {
		case <-s.stopRefresh:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Refresh)
			if err := s.CheckClock(ctx); err != nil {
				s.log.Debug("could not compare this node's clock with the database's", "err", err)
			}
			if s.needRefresh(ctx) {
				if err := s.Refresh(ctx); err != nil {
					s.log.Warn("device cache refresh failed; polls answer from the last known state", "err", err)
				}
			}
			cancel()
			t.Reset(s.cfg.Refresh)
		}
	}
}

// beat tells a store several processes share (kettle.Nodes) that this node
// is alive and records how many others are; it reports whether it knows.
func (s *Service) beat(ctx context.Context) bool {
	n, ok := s.store.(kettle.Nodes)
	if !ok {
		return false
	}
	others, err := n.Beat(ctx, s.node, "serve", s.cfg.Refresh)
	if err != nil {
		s.beatsFailed.Add(1)
		s.peers.Store(-1)
		// The refresh that follows fails and warns too when the store is
		// down: one warning a beat is enough.
		s.log.Debug("could not tell the store this node is alive; refreshing the device cache as if other nodes wrote", "err", err)
		return false
	}
	s.peers.Store(int64(others))
	return true
}

// needRefresh reports whether the cache may lag the store: whether another
// process writes it (or did until the previous beat, whose last writes a
// refresh must still pick up), or this node cannot tell. A node alone on its
// database has written everything its cache holds and skips the scan.
func (s *Service) needRefresh(ctx context.Context) bool {
	if !s.beat(ctx) {
		return true
	}
	alone := s.peers.Load() == 0
	was, first := s.wasAlone, !s.decided
	s.wasAlone, s.decided = alone, true
	if first || alone != was {
		if alone {
			s.log.Info("no other process writes the store: the device cache refresh pauses after this one")
		} else {
			s.log.Info("other processes write the store: refreshing the device cache from it", "every", s.cfg.Refresh, "others", s.peers.Load())
		}
	}
	return !alone || !was
}

// RefreshStats reports the other processes writing the store seen at the
// last beat (-1: unknown, or the store is not shared), the refreshes run
// since start, and the beats the store did not answer (each is followed by
// a refresh, as if others wrote).
func (s *Service) RefreshStats() (peers int64, refreshes, beatsFailed uint64) {
	return s.peers.Load(), s.refreshes.Load(), s.beatsFailed.Load()
}

// Refresh merges every device's stored state into the cache: a newer latest
// reading, a larger capacity, a later last-seen time, and the stored
// override (unless this node set one after the scan began). The store is the
// truth; the cache only ever moves forward.
func (s *Service) Refresh(ctx context.Context) error {
	s.refreshes.Add(1)
	began := s.now()
	var changed []kettle.DeviceID
	s.mu.Lock()
	s.cache.marks = make([]uint64, (s.cache.used+63)/64)
	s.mu.Unlock()
	err := s.store.Scan(ctx, func(d kettle.DeviceState) error {
		s.mu.Lock()
		moved := s.merge(d, began)
		s.cache.mark(s.cache.index[d.ID])
		s.mu.Unlock()
		if moved {
			changed = append(changed, d.ID)
		}
		return nil
	})
	// Cached devices the whole scan did not show were removed from the
	// store by another node's Prune: drop those that never reported here
	// either (a kettle that did was registered again by its write).
	s.mu.Lock()
	if err == nil {
		s.cache.unmarked(func(id kettle.DeviceID, _ *device) { s.dropNeverReported(id) })
	}
	// What this node pruned during the scan, the scan may have read before
	// the delete and added back: drop it again (counted once, by Prune). A
	// kettle whose first reading committed meanwhile has reported, and stays.
	for _, id := range s.prunedInScan {
		s.removeNeverReported(id)
	}
	s.prunedInScan = nil
	s.cache.marks = nil
	s.cache.compact()
	s.mu.Unlock()
	if len(changed) > 0 {
		s.changed(changed)
	}
	return err
}

// merge folds a device's stored state, read from a store call that began at
// began, into the cache: a newer latest reading, a larger capacity, a later
// last-seen time, a revocation, and the stored override (unless this node
// set one after began). It reports whether the device's command may have
// changed. Caller holds s.mu.
func (s *Service) merge(d kettle.DeviceState, began time.Time) (moved bool) {
	c := s.cache.add(d.ID)
	if d.Latest != nil && c.newer(d.Latest) {
		c.setLatest(d.Latest)
		moved = true
	}
	if d.CapacityML > c.capacityML {
		c.capacityML = d.CapacityML
	}
	if ls := unixNano(d.LastSeen); ls > c.lastSeen {
		c.lastSeen = ls
	}
	if !d.RevokedAt.IsZero() && !c.revoked {
		c.revoked = true
		moved = true
	}
	if o := s.cache.override(d.ID, c); !overrideEqual(o, d.Override) && (o == nil || o.SetAt.Before(began.Add(-time.Second))) {
		s.cache.setOverride(d.ID, c, d.Override)
		moved = true
	}
	return moved
}

func overrideEqual(a, b *kettle.Override) bool {
	if a == nil || b == nil {
		return a == b
	}
	eqb := func(x, y *bool) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	eqf := func(x, y *float64) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	return eqb(a.Charge, b.Charge) && eqb(a.Fill, b.Fill) && eqf(a.FlushMLPerS, b.FlushMLPerS) && a.ExpiresAt.Equal(b.ExpiresAt)
}
