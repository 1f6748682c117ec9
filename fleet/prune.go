package fleet

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// pruning is Prune's state.
type pruning struct {
	pruneMu sync.Mutex   // one Prune at a time
	pruned  atomic.Int64 // devices removed from the cache (Pruned)
	// automatic prunes that failed (PruneErrors)
	pruneErrors atomic.Int64
}

// MinPruneAge is the youngest registration Prune removes: a kettle between
// its POST /login and its first upload (30 s later, or after a reboot) is
// not a stale registration.
const MinPruneAge = 10 * time.Minute

// pruneBatch is how many devices one store transaction of Prune removes at
// most (the writer waits for one such transaction, not for the whole run).
const pruneBatch = 1000

// PruneResult is what a Prune did.
type PruneResult struct {
	Removed int       // devices removed (or, DryRun, that would be)
	Before  time.Time // registered before this and never reported
	DryRun  bool
	Took    time.Duration
}

// Prune removes the devices registered more than olderThan ago that never
// stored a reading and are neither revoked nor under an override (see
// kettle.Store.Prune) from the store, then from this node's cache, in
// transactions of pruneBatch devices; other nodes drop them at their next
// cache refresh. The registry bound (--max-devices) counts only what is
// left. dryRun counts them and removes nothing. Cancelling ctx stops it
// between transactions; what was removed stays removed and is reported.
func (s *Service) Prune(ctx context.Context, olderThan time.Duration, dryRun bool) (PruneResult, error) {
	res, err := s.prune(ctx, olderThan, dryRun)
	if err == nil {
		s.log.Info("devices pruned", "removed", res.Removed, "registered_before", res.Before, "dry_run", dryRun, "took", res.Took, "registered", s.DeviceCount())
	}
	return res, err
}

// prune is Prune without its log line.
func (s *Service) prune(ctx context.Context, olderThan time.Duration, dryRun bool) (PruneResult, error) {
	if olderThan < MinPruneAge {
		return PruneResult{}, &kettle.Error{Code: kettle.EInvalid, Message: "invalid prune",
			Fields: []kettle.FieldError{{Field: "older_than", Message: fmt.Sprintf("must be at least %s (a kettle registered just now has not reported yet), got %s", MinPruneAge, olderThan)}}}
	}
	s.pruneMu.Lock()
	defer s.pruneMu.Unlock()
	start := s.now()
	res := PruneResult{Before: start.Add(-olderThan).UTC().Truncate(kettle.TimePrecis), DryRun: dryRun}
	n, err := PruneStore(ctx, s.store, res.Before, dryRun, s.cfg.StoreTimeout, func(removed []kettle.DeviceID) {
		if dryRun {
			return
		}
		s.mu.Lock()
		for _, id := range removed {
			s.dropNeverReported(id)
		}
		if s.cache.marks != nil {
			// A refresh is scanning the store: it may have read these rows
			// before they were deleted and add them back; it drops them
			// again when its scan ends (Refresh).
			s.prunedInScan = append(s.prunedInScan, removed...)
		}
		s.mu.Unlock()
	})
	s.mu.Lock()
	s.cache.compact()
	s.mu.Unlock()
	res.Removed, res.Took = n, s.now().Sub(start)
	if err != nil {
		return res, s.storeErr("prune devices", err)
	}
	return res, nil
}

// dropNeverReported removes a device from the cache if, as far as the cache
// knows, it never reported and is neither revoked nor overridden: a kettle
// whose first reading committed after the store removed it was registered
// again by that write and stays. Caller holds s.mu.
func (s *Service) dropNeverReported(id kettle.DeviceID) {
	if s.removeNeverReported(id) {
		s.pruned.Add(1)
	}
}

// removeNeverReported is dropNeverReported without counting the device as
// pruned; it reports whether it removed it. Caller holds s.mu.
func (s *Service) removeNeverReported(id kettle.DeviceID) bool {
	if d := s.cache.get(id); d != nil && d.lastSeen == 0 && !d.hasLatest && !d.revoked && !d.hasOverride {
		s.cache.remove(id)
		return true
	}
	return false
}

// Pruned is how many devices this node removed from its registry since
// start (Prune here, or a Refresh that found them pruned by another node).
func (s *Service) Pruned() int64 { return s.pruned.Load() }

// PruneStore runs st.Prune over every device, pruneBatch devices a
// transaction, and calls removed with each transaction's ids once it
// committed (dryRun: the ids it would remove). It returns how many there
// were; on an error (or ctx cancelled between transactions), how many
// before it. timeout, when > 0, bounds each transaction (--store-timeout).
func PruneStore(ctx context.Context, st kettle.Store, before time.Time, dryRun bool, timeout time.Duration, removed func([]kettle.DeviceID)) (int, error) {
	n, after := 0, uuid.Nil
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		tctx, cancel := ctx, context.CancelFunc(func() {})
		if timeout > 0 {
			tctx, cancel = context.WithTimeout(ctx, timeout)
		}
		ids, next, err := st.Prune(tctx, before, after, pruneBatch, dryRun)
		cancel()
		if err != nil {
			return n, err
		}
		n += len(ids)
		if len(ids) > 0 && removed != nil {
			removed(ids)
		}
		if next == uuid.Nil {
			return n, nil
		}
		after = next
	}
}
