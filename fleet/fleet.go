// Package fleet is the heart of kettle serve between the wire adapters
// (httpapi, mqttapi) and the store: the bounded ingest queue and its batcher
// (one store transaction per batch, ack after commit), and the in-memory
// caches that answer command polls without waiting on the store.
package fleet

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// Config sizes the ingest pipeline.
type Config struct {
	// QueueRows bounds the readings waiting for a transaction. When full,
	// Ingest fails fast with EUnavailable (HTTP 503 + Retry-After).
	QueueRows int
	// BatchRows is the most readings committed in one transaction.
	BatchRows int
	// BatchWait is how long the batcher waits for more readings after the
	// first one before committing a partial batch (0: commit what is there;
	// batches still grow under load while the previous commit runs).
	BatchWait time.Duration
	// Writers is the number of concurrent batch transactions (1 for SQLite,
	// which has one writer; a few for PostgreSQL). Each writer has its own
	// queue and owns the devices hashed to it, so two transactions never
	// lock the same device row and one device's readings commit in order.
	Writers int
	// PollInterval is the poll_after_s a kettle is told when nothing
	// time-dependent is due sooner.
	PollInterval time.Duration
	// RetryAfter is what a refused client is told to wait.
	RetryAfter time.Duration
	// Refresh, when > 0, reloads the device cache from the store this
	// often, so that a node sharing its store with other nodes (PostgreSQL)
	// answers polls with what the others committed. 0: never (one node).
	// With a store that knows who writes it (kettle.Nodes), the node beats
	// this often and reloads only while another process writes (and once
	// after the last one stopped).
	Refresh time.Duration
	// Retention, when > 0, is how long readings are kept, by device time:
	// readings older than now − Retention are refused (kettle.Window), and
	// every ExpireEvery the store expires the days wholly older than that
	// (kettle.ExpireBefore). 0 keeps everything.
	Retention time.Duration
	// ExpireEvery is how often the expiry runs when Retention > 0, and
	// the automatic prune when PruneUnreported > 0 (default 1h); the first
	// run is at start.
	ExpireEvery time.Duration
	// PruneUnreported, when > 0 (at least MinPruneAge), prunes every
	// ExpireEvery the devices registered longer ago that never stored a
	// reading (Prune). 0: only when the operator asks.
	PruneUnreported time.Duration
	// DeviceRate, when > 0, is the requests a second one device may make
	// (Allow, Pace), with bursts of DeviceBurst (default 10). 0: no limit.
	DeviceRate  float64
	DeviceBurst int
	// LoginRate, when > 0, is the case-study registrations (POST /login)
	// a second over all clients (AllowLogin), in bursts of LoginBurst
	// (default 1). 0: no limit.
	LoginRate  float64
	LoginBurst int
	// LoginSourceRate, when > 0, is the case-study registrations a second
	// from one source address (an IPv4 address, an IPv6 /64) in bursts of
	// LoginSourceBurst (default 1), checked before LoginRate: one client
	// looping on POST /login is refused on its own and leaves the shared
	// rate to the others. 0: no limit.
	LoginSourceRate  float64
	LoginSourceBurst int
	// MaxDevices, when > 0, bounds the registry: Register refuses devices
	// past it (EForbidden). Devices a v1 token registers by uploading are
	// not refused (their tokens come from the operator's secret).
	MaxDevices int
	// StoreTimeout bounds every store call the service and the adapters'
	// reads make (a batch commit, a registration, an override, one prune
	// transaction, a read): with the database unreachable (packets
	// dropped, not refused) a call would otherwise wait until TCP gives up,
	// minutes, and every upload with it. 0: DefaultStoreTimeout.
	StoreTimeout time.Duration
	// Log, when set (kettle serve --log), takes validated readings in
	// place of the ingest queue and the store (log.go).
	Log Log
}

// DefaultStoreTimeout is Config.StoreTimeout's default (--store-timeout):
// longer than any healthy commit of a full batch, short enough that a kettle
// hears 503 + Retry-After long before its own request times out.
const DefaultStoreTimeout = 5 * time.Second

func (c *Config) defaults() {
	if c.QueueRows <= 0 {
		c.QueueRows = 65536
	}
	if c.BatchRows <= 0 {
		c.BatchRows = 2000
	}
	if c.Writers <= 0 {
		c.Writers = 1
	}
	if c.PollInterval <= 0 {
		c.PollInterval = 30 * time.Second
	}
	if c.RetryAfter <= 0 {
		c.RetryAfter = time.Second
	}
	if c.ExpireEvery <= 0 {
		c.ExpireEvery = time.Hour
	}
	if c.DeviceBurst <= 0 {
		c.DeviceBurst = 10
	}
	if c.LoginBurst <= 0 {
		c.LoginBurst = 1
	}
	if c.LoginSourceBurst <= 0 {
		c.LoginSourceBurst = 1
	}
	if c.StoreTimeout <= 0 {
		c.StoreTimeout = DefaultStoreTimeout
	}
}

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

	queues     []chan *request // one per writer, by device hash (writerOf)
	writerSeed maphash.Seed
	queued     atomic.Int64 // readings in the queues
	committing atomic.Int32 // batchers in a store write
	closed     atomic.Bool
	wg         sync.WaitGroup
	sendMu     sync.RWMutex // held (R) while sending to queue; (W) to close it

	mu          sync.RWMutex
	cache       cache
	registering int // slots held by registrations in flight (Register; under mu)
	// devices this node pruned while a refresh scanned the store (under mu;
	// Refresh drops them again when its scan ends)
	prunedInScan []kettle.DeviceID

	pruneMu sync.Mutex   // one Prune at a time
	pruned  atomic.Int64 // devices removed from the cache (Pruned)
	// automatic prunes that failed (PruneErrors)
	pruneErrors atomic.Int64

	stored     atomic.Int64
	duplicates atomic.Int64

	// Per-device and login rates (ratelimit.go).
	deviceRate, loginRate                 gcra
	loginTAT                              atomic.Int64
	rateRefused, ratePaced, loginsRefused atomic.Int64
	registryRefused                       atomic.Int64
	rateLog                               logthin.Limiter // logOverRate
	loginSource                           gcra
	sources                               sourceTable // --login-rate-per-source
	sourceRefused                         atomic.Int64

	watchMu  sync.RWMutex
	watchers []ChangeFunc

	stopRefresh chan struct{}
	refreshDone chan struct{}
	expiry      expiry
	// With a store several processes write (kettle.Nodes), this node's id
	// in it, the others it saw alive at the last beat (-1: not known yet,
	// or the beat failed), and the refreshes run.
	node      uuid.UUID
	peers     atomic.Int64
	refreshes atomic.Uint64
	wasAlone  bool // at the previous beat (refresher goroutine only)
	decided   bool // a beat has answered (refresher goroutine only)

	errMu       sync.Mutex
	errLogged   time.Time
	errSkipped  int
	errSkippedR int
}

// logStoreError logs a failed batch at most once a second (an outage would
// otherwise log hundreds of lines a second), with how many were folded in.
func (s *Service) logStoreError(rows int, err error) {
	s.errMu.Lock()
	defer s.errMu.Unlock()
	if now := time.Now(); now.Sub(s.errLogged) >= time.Second {
		s.log.Error("store write failed; readings refused with 503", "rows", rows, "err", err,
			"similar_failures_since_last_line", s.errSkipped, "their_rows", s.errSkippedR)
		s.errLogged, s.errSkipped, s.errSkippedR = now, 0, 0
		return
	}
	s.errSkipped++
	s.errSkippedR += rows
}

// OnChange registers fn to be told of device state changes (MQTT pushes
// commands with it).
func (s *Service) OnChange(fn ChangeFunc) {
	s.watchMu.Lock()
	s.watchers = append(s.watchers, fn)
	s.watchMu.Unlock()
}

func (s *Service) changed(ids []kettle.DeviceID) {
	s.watchMu.RLock()
	defer s.watchMu.RUnlock()
	for _, fn := range s.watchers {
		fn(ids)
	}
}

type request struct {
	rows []kettle.Measurement
	dup  []bool
	err  error
	done chan struct{}
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
		store:      store,
		cfg:        cfg,
		log:        log,
		now:        now,
		hooks:      hooks,
		cache:      newCache(),
		writerSeed: maphash.MakeSeed(),
	}
	s.deviceRate = newGCRA(cfg.DeviceRate, cfg.DeviceBurst)
	s.loginRate = newGCRA(cfg.LoginRate, cfg.LoginBurst)
	s.loginSource = newGCRA(cfg.LoginSourceRate, cfg.LoginSourceBurst)
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
	if cfg.Retention > 0 || cfg.PruneUnreported > 0 {
		s.startExpirer()
	}
	return s, nil
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
// last beat (-1: unknown, or the store is not shared) and the refreshes
// run since start.
func (s *Service) RefreshStats() (peers int64, refreshes uint64) {
	return s.peers.Load(), s.refreshes.Load()
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
		c := s.cache.add(d.ID)
		s.cache.mark(s.cache.index[d.ID])
		moved := false
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

func overrideEqual(a, b *kettle.Override) bool {
	if a == nil || b == nil {
		return a == b
	}
	eqb := func(x, y *bool) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	eqf := func(x, y *float64) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	return eqb(a.Charge, b.Charge) && eqb(a.Fill, b.Fill) && eqf(a.FlushMLPerS, b.FlushMLPerS) && a.ExpiresAt.Equal(b.ExpiresAt)
}

// Config returns the effective configuration.
func (s *Service) Config() Config { return s.cfg }

// Store returns the store behind the service.
func (s *Service) Store() kettle.Store { return s.store }

// Now is the service clock.
func (s *Service) Now() time.Time { return s.now() }

// QueueLen is the number of readings waiting for a transaction.
func (s *Service) QueueLen() int { return int(s.queued.Load()) }

// Counters returns readings stored and duplicates seen since start.
func (s *Service) Counters() (stored, duplicates int64) {
	return s.stored.Load(), s.duplicates.Load()
}

// Ingest queues readings (already validated and normalized) and returns
// after the transaction holding them committed: how many were stored and how
// many were duplicates. A full queue fails at once with EUnavailable.
func (s *Service) Ingest(ctx context.Context, rows []kettle.Measurement) (stored, dups int, err error) {
	if len(rows) == 0 {
		return 0, 0, nil
	}
	if s.cfg.Log != nil {
		return s.ingestLog(ctx, rows)
	}
	n := int64(len(rows))
	if s.queued.Add(n) > int64(s.cfg.QueueRows) {
		s.queued.Add(-n)
		s.reject("queue_full", len(rows))
		return 0, 0, &kettle.Error{
			Code:       kettle.EUnavailable,
			Message:    fmt.Sprintf("ingest queue full (%d readings); retry after %s or raise --ingest-queue", s.cfg.QueueRows, s.cfg.RetryAfter),
			RetryAfter: s.cfg.RetryAfter,
		}
	}
	req := &request{rows: rows, done: make(chan struct{})}
	s.sendMu.RLock()
	if s.closed.Load() {
		s.sendMu.RUnlock()
		s.queued.Add(-n)
		s.reject("shutting_down", len(rows))
		return 0, 0, &kettle.Error{Code: kettle.EUnavailable, Message: "server is shutting down; retry on another node or after restart", RetryAfter: s.cfg.RetryAfter}
	}
	s.queues[s.writerOf(rows[0].Device)] <- req // never blocks: capacity ≥ QueueRows ≥ queued requests
	s.sendMu.RUnlock()
	<-req.done // not ctx: the commit decides; a gone client simply retries into a duplicate
	if req.err != nil {
		return 0, 0, req.err
	}
	for _, d := range req.dup {
		if d {
			dups++
		}
	}
	return len(rows) - dups, dups, nil
}

func (s *Service) reject(reason string, rows int) {
	if s.hooks.Rejected != nil {
		s.hooks.Rejected(reason, rows)
	}
}

// busyMinRows and busyWait: while another batcher is committing, a batcher
// holding fewer than busyMinRows readings waits up to busyWait for more
// before it starts its transaction (with BatchWait 0).
const (
	busyMinRows = 32
	busyWait    = time.Millisecond
)

// writerOf is the writer that owns device id (a request of several devices
// goes to the first one's: still correct, the store locks devices in order).
// Writers partition the devices instead of sharing one queue: with a shared
// queue, the two PostgreSQL writers' batches of single readings from 256
// connections held overlapping devices, and each waited on the other's row
// locks (SELECT … FOR UPDATE averaged 6.2 ms a call), so they committed one
// after the other.
func (s *Service) writerOf(id kettle.DeviceID) int {
	if len(s.queues) == 1 {
		return 0
	}
	return int(maphash.Comparable(s.writerSeed, id) % uint64(len(s.queues)))
}

// batcher takes whatever is queued on its queue, up to BatchRows, commits it
// in one transaction, updates the caches and wakes every waiter.
func (s *Service) batcher(queue chan *request) {
	defer s.wg.Done()
	var (
		reqs  []*request
		batch []kettle.Measurement
	)
	for {
		first, ok := <-queue
		if !ok {
			return
		}
		reqs = append(reqs[:0], first)
		batch = append(batch[:0], first.rows...)
		var (
			deadline <-chan time.Time
			timer    *time.Timer
		)
		switch {
		case s.cfg.BatchWait > 0:
			timer = time.NewTimer(s.cfg.BatchWait)
			deadline = timer.C
		case len(batch) < busyMinRows && s.committing.Load() > 0:
			// Another writer is committing: the store is busy, so do not
			// start a transaction for a handful of readings; wait briefly
			// for more (trickles of single readings made half the
			// PostgreSQL transactions hold one reading, paying a
			// transaction's fixed cost each). When no writer is busy, commit
			// at once: an idle server adds no latency.
			timer = time.NewTimer(busyWait)
			deadline = timer.C
		}
		limit := s.cfg.BatchRows
		if s.cfg.BatchWait <= 0 && deadline != nil {
			limit = min(limit, busyMinRows) // enough to go: stop waiting
		}
	gather:
		for len(batch) < limit {
			select {
			case r, ok := <-queue:
				if !ok {
					break gather
				}
				reqs = append(reqs, r)
				batch = append(batch, r.rows...)
			default:
				if deadline == nil {
					break gather
				}
				select {
				case r, ok := <-queue:
					if !ok {
						break gather
					}
					reqs = append(reqs, r)
					batch = append(batch, r.rows...)
				case <-deadline:
					break gather
				}
			}
		}
		if timer != nil {
			timer.Stop()
		}
		// take what else is queued, without waiting, up to BatchRows
	more:
		for len(batch) < s.cfg.BatchRows {
			select {
			case r, ok := <-queue:
				if !ok {
					break more
				}
				reqs = append(reqs, r)
				batch = append(batch, r.rows...)
			default:
				break more
			}
		}
		s.committing.Add(1)
		err := s.commit(reqs, batch)
		s.committing.Add(-1)
		if err != nil {
			s.failQueued(queue, err)
		}
	}
}

// failQueued answers at once, with err, every request that queued while a
// commit failed. They would otherwise each wait for a commit of their own
// against a store that just did not answer within StoreTimeout: with the
// database unreachable, an upload behind k batches would wait k timeouts.
// Failing them keeps every upload's wait under two timeouts (the commit in
// progress when it arrived, then its own); the next arrival tries the store
// again.
func (s *Service) failQueued(queue chan *request, err error) {
	n := 0
	for {
		select {
		case r, ok := <-queue:
			if !ok {
				return
			}
			s.queued.Add(-int64(len(r.rows)))
			r.err = err
			close(r.done)
			if n++; n%wakeChunk == 0 {
				runtime.Gosched()
			}
		default:
			return
		}
	}
}

// commit writes one batch and wakes its waiters; it returns the error they
// were answered with.
func (s *Service) commit(reqs []*request, batch []kettle.Measurement) error {
	start := time.Now()
	received := s.now()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.StoreTimeout)
	dup, err := s.store.Write(ctx, batch, received)
	cancel()
	took := time.Since(start)
	s.queued.Add(-int64(len(batch)))
	ndup := 0
	rawErr := err
	if err != nil {
		s.logStoreError(len(batch), err)
		err = s.unavailable("store readings", err)
	} else {
		var changed []kettle.DeviceID
		s.mu.Lock()
		// A run of one device's readings (an upload) is folded into the
		// cache once: its newest reading, its greatest level.
		for i := 0; i < len(batch); {
			newest := -1
			j := i
			for ; j < len(batch) && batch[j].Device == batch[i].Device; j++ {
				if dup[j] {
					ndup++
					continue
				}
				if newest < 0 || batch[j].Time.After(batch[newest].Time) {
					newest = j
				}
			}
			if newest >= 0 {
				maxLevel := batch[newest].LevelML
				for k := i; k < j; k++ {
					if !dup[k] {
						maxLevel = max(maxLevel, batch[k].LevelML)
					}
				}
				s.apply(&batch[newest], maxLevel, received)
				changed = append(changed, batch[i].Device)
			}
			i = j
		}
		s.mu.Unlock()
		s.stored.Add(int64(len(batch) - ndup))
		s.duplicates.Add(int64(ndup))
		if len(changed) > 0 {
			s.changed(changed)
		}
	}
	if s.hooks.Batch != nil {
		s.hooks.Batch(len(batch), ndup, took, rawErr)
	}
	off := 0
	for i, r := range reqs {
		if err != nil {
			r.err = err
		} else {
			r.dup = dup[off : off+len(r.rows)]
		}
		off += len(r.rows)
		close(r.done)
		if (i+1)%wakeChunk == 0 {
			// A commit may wake a thousand waiters. Goroutines readied here
			// run before the scheduler looks at the network again, so every
			// request arriving meanwhile (a poll, an upload to refuse) would
			// wait behind all their responses: tens of milliseconds on a
			// busy CPU. Yielding every wakeChunk lets them in between.
			runtime.Gosched()
		}
	}
	return err
}

// wakeChunk is how many waiters a commit wakes before it yields the CPU
// (below the scheduler's local run queue of 256, so they stay there).
const wakeChunk = 64

// apply folds a device's newest committed reading of a batch (m) and its
// greatest level into the cache, with the same rules as the store (latest
// only if newer). Caller holds s.mu.
func (s *Service) apply(m *kettle.Measurement, maxLevelML float64, received time.Time) {
	d := s.cache.add(m.Device)
	d.lastSeen = unixNano(received)
	if maxLevelML > d.capacityML {
		d.capacityML = maxLevelML
	}
	if d.newer(m) {
		d.setLatest(m)
	}
}

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

// Register creates new devices with fresh random ids, durably, and returns
// their ids; past Config.MaxDevices it refuses them (EForbidden). The bound
// is exact on this node: registrations in flight hold their slots
// (s.registering) from the check until they are cached or have failed.
func (s *Service) Register(ctx context.Context, n int) ([]kettle.DeviceID, error) {
	reserved := 0
	if s.cfg.MaxDevices > 0 {
		s.mu.Lock()
		full := s.cache.len()+s.registering+n > s.cfg.MaxDevices
		if !full {
			s.registering += n
			reserved = n
		}
		s.mu.Unlock()
		if full {
			return nil, s.registryFull(n)
		}
	}
	ids := make([]kettle.DeviceID, n)
	for i := range ids {
		ids[i] = uuid.New()
	}
	return ids, s.register(ctx, ids, reserved)
}

// RegisterIDs creates the given devices (existing ones are left alone).
func (s *Service) RegisterIDs(ctx context.Context, ids []kettle.DeviceID) error {
	return s.register(ctx, ids, 0)
}

// register stores ids and caches them, releasing the reserved slots (see
// Register) in the same critical section as the devices take theirs. The
// store call does not run on the client's context: a client that goes away
// while the registration commits must not leave it stored but unknown to
// this node (its count, the registry bound and a prune all go by the
// cache); Config.StoreTimeout bounds it instead.
func (s *Service) register(ctx context.Context, ids []kettle.DeviceID, reserved int) error {
	at := s.now().UTC().Truncate(kettle.TimePrecis)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.StoreTimeout)
	defer cancel()
	err := s.store.Register(ctx, ids, at)
	s.mu.Lock()
	s.registering -= reserved
	if err == nil {
		for _, id := range ids {
			s.cache.add(id)
		}
	}
	s.mu.Unlock()
	if err != nil {
		return s.unavailable("register devices", err)
	}
	return nil
}

// Registered reports whether the device is known and not revoked (the
// case-study protocol's only credential check). Answered from memory.
func (s *Service) Registered(id kettle.DeviceID) bool {
	s.mu.RLock()
	d := s.cache.get(id)
	ok := d != nil && !d.revoked
	s.mu.RUnlock()
	return ok
}

// Revoked reports whether the device was decommissioned: its credentials
// (v1 token, MQTT password, case-study UUID) are refused. From memory.
func (s *Service) Revoked(id kettle.DeviceID) bool {
	s.mu.RLock()
	d := s.cache.get(id)
	r := d != nil && d.revoked
	s.mu.RUnlock()
	return r
}

// Revoke decommissions a device durably, then in the cache: from then on its
// credentials are refused; its history stays in the statistics.
func (s *Service) Revoke(ctx context.Context, id kettle.DeviceID) error {
	ctx, cancel := s.StoreContext(ctx)
	defer cancel()
	if err := s.store.Revoke(ctx, id, s.now().UTC().Truncate(kettle.TimePrecis)); err != nil {
		return s.StoreErr("revoke", err)
	}
	s.mu.Lock()
	s.cache.add(id).revoked = true
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}

// DeviceCount is the number of registered devices in the cache.
func (s *Service) DeviceCount() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cache.len()
}

// ReportingSince counts devices whose last stored reading was committed at
// or after t, from memory.
func (s *Service) ReportingSince(t time.Time) int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n, since := 0, t.UnixNano()
	s.cache.each(func(d *device) {
		if d.lastSeen != 0 && d.lastSeen >= since {
			n++
		}
	})
	return n
}

// Command is the device's current command, from memory: the policy applied
// to the cached latest reading, capacity and override at the service clock.
// An unknown device gets the policy's answer for a kettle with no reading.
func (s *Service) Command(id kettle.DeviceID) (kettle.Command, time.Duration) {
	now := s.now()
	s.mu.RLock()
	in := kettle.PolicyInput{Now: now}
	var latest kettle.Measurement
	if d := s.cache.get(id); d != nil {
		if d.hasLatest {
			latest = d.latest.measurement(id)
			in.Latest = &latest
		}
		in.CapacityML, in.Override = d.capacityML, s.cache.override(id, d)
	}
	s.mu.RUnlock()
	return kettle.Decide(in), kettle.NextChange(now, in.Override, s.cfg.PollInterval)
}

// SetOverride stores an override durably, then applies it to the cache so
// the kettle's next poll sees it.
func (s *Service) SetOverride(ctx context.Context, id kettle.DeviceID, o kettle.Override) error {
	ctx, cancel := s.StoreContext(ctx)
	defer cancel()
	if err := s.store.SetOverride(ctx, id, o); err != nil {
		return s.StoreErr("set override", err)
	}
	s.mu.Lock()
	if d := s.cache.get(id); d != nil {
		c := o
		s.cache.setOverride(id, d, &c)
	}
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}

// ClearOverride removes a device's override, durably, then from the cache.
func (s *Service) ClearOverride(ctx context.Context, id kettle.DeviceID) error {
	ctx, cancel := s.StoreContext(ctx)
	defer cancel()
	if _, err := s.store.Device(ctx, id); err != nil {
		return s.StoreErr("clear override", err)
	}
	if err := s.store.ClearOverride(ctx, id); err != nil {
		return s.StoreErr("clear override", err)
	}
	s.mu.Lock()
	if d := s.cache.get(id); d != nil {
		s.cache.setOverride(id, d, nil)
	}
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}

// StoreContext is ctx bounded by Config.StoreTimeout: every store call of
// the service and of the adapters' reads runs on one.
func (s *Service) StoreContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.StoreTimeout)
}

// StoreErr keeps the domain errors a store returns (not found, invalid,
// forbidden: their messages are the store's own words about the request)
// and turns anything else into a retryable 503 whose message names what
// failed but not why: the driver's text (host, user, database, file path,
// SQL) stays in Cause, for the log.
func (s *Service) StoreErr(what string, err error) error {
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
