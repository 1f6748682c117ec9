package fleet

import (
	"context"
	"fmt"
	"hash/maphash"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// ingestQueue is the ingest pipeline's state: one bounded queue per
// writer, the readings waiting in them, and the counts of what committed.
type ingestQueue struct {
	queues     []chan *request // one per writer, by device hash (writerOf)
	writerSeed maphash.Seed
	queued     atomic.Int64 // readings in the queues
	committing atomic.Int32 // batchers in a store write
	closed     atomic.Bool
	wg         sync.WaitGroup
	sendMu     sync.RWMutex // held (R) while sending to queue; (W) to close it

	stored     atomic.Int64
	duplicates atomic.Int64

	// logStoreError's thinning
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

type request struct {
	at   time.Time // queued (BatchWait runs from the first request's)
	rows []kettle.Measurement
	dup  []bool
	err  error
	done chan struct{}
}

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
	if err := s.clockErr("readings refused"); err != nil {
		s.reject("clock_skew", len(rows))
		return 0, 0, err
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
	req := &request{at: time.Now(), rows: rows, done: make(chan struct{})}
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
			// From the first reading's arrival, not from now: readings
			// that queued while the previous batch committed have waited
			// that long already (a full BatchWait on top made the wait
			// BatchWait + a commit for most readings under load).
			timer = time.NewTimer(max(s.cfg.BatchWait-time.Since(first.at), 0))
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
