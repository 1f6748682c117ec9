// Package fleet is the heart of kettle serve between the wire adapters
// (httpapi, mqttapi) and the store: the bounded ingest queue and its batcher
// (one store transaction per batch, ack after commit), and the in-memory
// caches that answer command polls without waiting on the store. The
// adapters see it through small interfaces of their own; it is the only
// code that talks to the store.
//
// One file per concern: ingest.go (queues, batchers, commit), registry.go
// (devices, overrides, commands), ratelimit.go (limits), refresh.go (what
// other nodes wrote), lookup.go (credentials other nodes issued), prune.go
// and retention.go (expiry), reads.go (the store reads the adapters answer
// with), config.go.
package fleet

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/semaphore"

	"github.com/kettlefleet/kettlefleet"
)

// Hooks lets the server observe the pipeline (metrics) without this package
// importing a metrics library. Any field may be nil.
type Hooks struct {
	Batch    func(rows, dups int, commit time.Duration, err error)
	Rejected func(reason string, rows int)
}

// ChangeFunc is told which devices' state changed (a committed reading, an
// override set or cleared), after the change is durable and cached. It runs
// on the committing goroutine: keep it short and non-blocking.
type ChangeFunc func(ids []kettle.DeviceID)

// Service owns the ingest queue, the batcher goroutines and the caches.
type Service struct {
	store kettle.Store
	cfg   Config
	log   *slog.Logger
	now   func() time.Time
	hooks Hooks

	// One part per concern, each in its own file; they share the
	// configuration, the clock, the log and the store above.
	ingestQueue             // ingest.go: the bounded queues, the batchers
	registry                // registry.go: the device cache, overrides, watchers
	rateLimits              // ratelimit.go: per-device and login rates
	cacheRefresh            // refresh.go: merging what other nodes wrote
	pruning                 // prune.go: removing devices that never reported
	lookups                 // lookup.go: credentials this node has not seen yet
	expiry       expiry     // retention.go: expiring old readings
	clock        clockCheck // clock.go: this node's clock against the store's
}

// New loads every device from the store into memory and starts the batchers.
// now is the clock (a field, so tests can fake it).
func New(ctx context.Context, store kettle.Store, cfg Config, log *slog.Logger, now func() time.Time, hooks Hooks) (*Service, error) {
	cfg.defaults()
	if cfg.PruneUnreported != 0 && cfg.PruneUnreported < MinPruneAge {
		return nil, fmt.Errorf("--prune-unreported %s: must be at least %s (a kettle registered just now has not reported yet)", cfg.PruneUnreported, MinPruneAge)
	}
	if now == nil {
		now = time.Now
	}
	s := &Service{
		store: store,
		cfg:   cfg,
		log:   log,
		now:   now,
		hooks: hooks,
	}
	s.cache = newCache()
	s.writerSeed = maphash.MakeSeed()
	s.deviceRate = newGCRA(cfg.DeviceRate, cfg.DeviceBurst)
	s.loginRate = newGCRA(cfg.LoginRate, cfg.LoginBurst)
	s.loginSource = newGCRA(cfg.LoginSourceRate, cfg.LoginSourceBurst)
	s.slots = semaphore.NewWeighted(maxLookups)
	err := store.Scan(ctx, func(d kettle.DeviceState) error {
		c := s.cache.add(d.ID)
		c.lastSeen = unixNano(d.LastSeen)
		if d.Latest != nil {
			c.setLatest(d.Latest)
		}
		c.capacityML = d.CapacityML
		c.revoked = !d.RevokedAt.IsZero()
		s.cache.setOverride(d.ID, c, d.Override)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("load device cache: %w", err)
	}
	for range cfg.Writers {
		// capacity ≥ QueueRows ≥ queued requests: a send never blocks
		q := make(chan *request, cfg.QueueRows)
		s.queues = append(s.queues, q)
		s.wg.Add(1)
		go s.batcher(q)
	}
	s.peers.Store(-1)
	if cfg.Refresh > 0 {
		if _, ok := store.(kettle.Nodes); ok {
			// Say at once that this node writes, so that the others
			// refresh from their next beat on.
			s.node = uuid.New()
			s.beat(ctx)
		}
		s.stopRefresh = make(chan struct{})
		s.refreshDone = make(chan struct{})
		go s.refresher()
	}
	// Before the first expiry, which runs at once: a node started with a
	// wrong clock must not delete by it.
	if err := s.CheckClock(ctx); err != nil {
		s.log.Warn("could not compare this node's clock with the database's; comparing again at the next beat", "err", err)
	}
	if cfg.Retention > 0 || cfg.PruneUnreported > 0 {
		s.startExpirer()
	}
	return s, nil
}

// Config returns the effective configuration.
func (s *Service) Config() Config { return s.cfg }

// PollInterval is how long a kettle is told to wait before its next poll
// when nothing time-dependent is due sooner (Config.PollInterval).
func (s *Service) PollInterval() time.Duration { return s.cfg.PollInterval }

// Now is the service clock.
func (s *Service) Now() time.Time { return s.now() }

// Close stops accepting readings, commits everything queued and stops the
// batchers. Call it after the wire adapters stopped.
func (s *Service) Close() {
	s.stopExpirer()
	if s.stopRefresh != nil {
		select {
		case <-s.stopRefresh:
		default:
			close(s.stopRefresh)
		}
		<-s.refreshDone
	}
	s.sendMu.Lock()
	if !s.closed.Swap(true) {
		for _, q := range s.queues {
			close(q)
		}
	}
	s.sendMu.Unlock()
	s.wg.Wait()
}

// storeContext is ctx bounded by Config.StoreTimeout: every store call of
// the service and of the adapters' reads runs on one.
func (s *Service) storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.StoreTimeout)
}

// storeErr keeps the domain errors a store returns (not found, invalid,
// forbidden: their messages are the store's own words about the request)
// and turns anything else into a retryable 503 whose message names what
// failed but not why: the driver's text (host, user, database, file path,
// SQL) stays in Cause, for the log.
func (s *Service) storeErr(what string, err error) error {
	switch kettle.ErrorCode(err) {
	case kettle.EInternal, kettle.EUnavailable:
		return s.unavailable(what, err)
	default:
		return err
	}
}

// unavailable is the 503 for a failed store call: what failed, when to
// retry, and the cause kept for the log only.
func (s *Service) unavailable(what string, err error) error {
	ra := s.cfg.RetryAfter
	var e *kettle.Error
	if errors.As(err, &e) && e.RetryAfter > ra {
		ra = e.RetryAfter
	}
	msg := fmt.Sprintf("%s: the store is unavailable; retry after %s", what, ra)
	if errors.Is(err, context.DeadlineExceeded) {
		msg = fmt.Sprintf("%s: the store did not answer within %s (--store-timeout); retry after %s", what, s.cfg.StoreTimeout, ra)
	}
	return &kettle.Error{Code: kettle.EUnavailable, Message: msg, RetryAfter: ra, Cause: err}
}
