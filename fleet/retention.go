package fleet

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// expiry is the retention loop's state.
type expiry struct {
	cancel context.CancelFunc // stops the loop and its round in flight
	done   chan struct{}      // closed when the loop returned

	mu sync.Mutex
	st ExpiryStats
}

// ExpiryStats counts the retention loop's work since start.
type ExpiryStats struct {
	Runs, Errors uint64
	Removed      int64         // measurements expired
	LastDuration time.Duration // of the last run
	LastSuccess  time.Time     // zero: none yet
}

// Window is the device time a reading must fall in to be accepted now
// (Oldest set by Config.Retention). While this node's clock is past
// Config.MaxClockSkew from the store's (clock.go) it is judged by the
// store's clock: a reading it would wrongly call too old is not refused
// as invalid (an MQTT 3.1.1 kettle's invalid reading is acknowledged and
// dropped), but waits, like every other, for Ingest's 503.
func (s *Service) Window() kettle.Window {
	now := s.now()
	if s.clock.skewed.Load() {
		now = now.Add(-time.Duration(s.clock.skew.Load()))
	}
	w := kettle.Window{Now: now}
	if s.cfg.Retention > 0 {
		w.Oldest = now.Add(-s.cfg.Retention)
	}
	return w
}

// ExpiryStats reports the retention loop's counters.
func (s *Service) ExpiryStats() ExpiryStats {
	s.expiry.mu.Lock()
	defer s.expiry.mu.Unlock()
	return s.expiry.st
}

// Expire removes the days of readings wholly older than the retention
// window now (Config.Retention must be > 0) and returns how many readings
// went. The retention loop calls it every ExpireEvery.
func (s *Service) Expire(ctx context.Context) (int64, error) {
	if s.cfg.Retention <= 0 {
		return 0, fmt.Errorf("expire: no retention configured")
	}
	// Expiry deletes by this node's clock: compare it with the store's
	// right before (a clock stepped since the last beat counts too).
	if err := s.CheckClock(ctx); err != nil {
		if ctx.Err() != nil {
			return 0, err // shutting down: not a failed round
		}
		return 0, s.expireFailed(fmt.Errorf("expire: %w", err))
	}
	if err := s.clockErr("expiring readings older than the retention window"); err != nil {
		return 0, s.expireFailed(err)
	}
	start := time.Now()
	before := kettle.ExpireBefore(s.now(), s.cfg.Retention)
	n, err := s.store.Expire(ctx, before)
	d := time.Since(start)
	busy := errors.Is(err, kettle.ErrExpiring) // another node is at it: its run is ours
	if busy {
		err = nil
	}
	stopped := err != nil && ctx.Err() != nil // shutting down: interrupted, not failed
	s.expiry.mu.Lock()
	s.expiry.st.Runs++
	s.expiry.st.Removed += n
	s.expiry.st.LastDuration = d
	switch {
	case err == nil:
		s.expiry.st.LastSuccess = time.Now()
	case !stopped:
		s.expiry.st.Errors++
	}
	s.expiry.mu.Unlock()
	switch {
	case stopped:
		s.log.Info("expiring readings older than the retention window interrupted; the next start goes on", "before", before, "removed", n, "err", err)
	case busy:
		s.log.Info("another process is expiring readings older than the retention window; skipped this round", "before", before)
	case err != nil:
		s.log.Warn("expiring readings older than the retention window failed; trying again next round",
			"before", before, "removed", n, "err", err, "next_in", s.cfg.ExpireEvery)
	case n > 0:
		s.log.Info("expired readings older than the retention window", "before", before, "removed", n, "took", d.Round(time.Millisecond))
	}
	return n, err
}

// expireFailed counts and logs an expiry that did not run, and returns err.
func (s *Service) expireFailed(err error) error {
	s.expiry.mu.Lock()
	s.expiry.st.Runs++
	s.expiry.st.Errors++
	s.expiry.mu.Unlock()
	s.log.Warn("expiring readings older than the retention window failed; trying again next round", "err", err, "next_in", s.cfg.ExpireEvery)
	return err
}

// autoPrune is the housekeeping loop's prune (Config.PruneUnreported).
// Every node on a shared store runs it; their transactions skip the rows
// another holds, so two at once remove each device once.
func (s *Service) autoPrune(ctx context.Context) {
	res, err := s.prune(ctx, s.cfg.PruneUnreported, false)
	switch {
	case err != nil && ctx.Err() == nil:
		s.pruneErrors.Add(1)
		s.log.Warn("pruning devices that never reported failed; trying again next round",
			"older_than", s.cfg.PruneUnreported, "removed", res.Removed, "err", err, "next_in", s.cfg.ExpireEvery)
	case res.Removed > 0: // quiet when there was nothing to do: this runs every round
		s.log.Info("devices pruned (--prune-unreported)", "removed", res.Removed, "registered_before", res.Before, "took", res.Took, "registered", s.DeviceCount())
	}
}

// PruneErrors counts the automatic prunes that failed (Config.PruneUnreported).
func (s *Service) PruneErrors() int64 { return s.pruneErrors.Load() }

func (s *Service) startExpirer() {
	ctx, cancel := context.WithCancel(context.Background())
	s.expiry.cancel, s.expiry.done = cancel, make(chan struct{})
	go func() {
		defer close(s.expiry.done)
		t := time.NewTimer(0)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if s.cfg.Retention > 0 {
				s.Expire(ctx)
			}
			if s.cfg.PruneUnreported > 0 {
				s.autoPrune(ctx)
			}
			t.Reset(s.cfg.ExpireEvery)
		}
	}()
}

func (s *Service) stopExpirer() {
	if s.expiry.cancel == nil {
		return
	}
	s.expiry.cancel()
	<-s.expiry.done
}
