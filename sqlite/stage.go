package sqlite

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// A write appends its new rows to the staged table, keyed by (bucket, t,
// device): a batch of readings from a thousand kettles dirties a few
// neighbouring pages at the right edge of each bucket, where measurements,
// keyed by (device, t) for history reads, would take one page per kettle,
// each written whole to the WAL at commit: that page traffic is most of the
// writer's CPU time per row (BenchmarkWriteFleet).
//
// A merge starts once staged holds mergeRows rows (or mergeEvery has
// passed). It moves the staged rows to measurements in (device, t) order,
// one bucket per transaction: by then each kettle has several rows, which
// share its pages. With the rows it writes the devices rows of the bucket's
// kettles that reported since their last merge (from the writer's cache:
// until then a batch does not touch them) and deletes the bucket's staged
// rows, a contiguous key range. Each bucket's transaction holds the writer
// lock for about 1/stageBuckets of what merging everything at once would, so
// batches wait less.
//
// Invariant: every stored measurement is in exactly one of measurements and
// staged; a devices row describes its kettle's rows in measurements, and a
// reader folds the kettle's staged rows on top (foldStaged). A bucket's
// merge moves all of its rows, so afterwards its kettles have none staged
// and their devices rows equal the cache.

// stageBuckets is how many buckets staged is cut into, by the first byte of
// the device id (uniform for random UUIDs).
const stageBuckets = 64

// bucketOf is the staged bucket of device id.
func bucketOf(id kettle.DeviceID) int { return int(id[0]) * stageBuckets / 256 }

// stage is the writer's bookkeeping of the staged table. Guarded by wmu,
// except the channels and atomics.
type stage struct {
	rows       int                                        // rows in staged
	bucketRows [stageBuckets]int                          // … per bucket
	devs       [stageBuckets]map[kettle.DeviceID]struct{} // devices with rows in staged, per bucket
	mergeRows  int
	mergeEvery time.Duration
	log        *slog.Logger

	wake, stop, done chan struct{}
	// For MergeStats, readable without wmu.
	stagedRows  atomic.Int64
	merges      atomic.Uint64
	mergeErrors atomic.Uint64
	mergeNanos  atomic.Int64
	mergeErr    atomic.Pointer[error]
}

// DefaultMergeRows is how many staged rows start a merge. A larger value
// gives each kettle more rows per merge (fewer pages per row) but longer
// merges and more staged rows for a reader to fold.
const DefaultMergeRows = 65536

// DefaultMergeEvery bounds how long rows stay staged on a quiet fleet.
const DefaultMergeEvery = 5 * time.Minute

// reset empties the bookkeeping (the cache reload refills it).
func (st *stage) reset() {
	st.rows = 0
	st.bucketRows = [stageBuckets]int{}
	for b := range st.devs {
		st.devs[b] = make(map[kettle.DeviceID]struct{})
	}
	st.stagedRows.Store(0)
}

// add counts n new staged rows of device id.
func (st *stage) add(id kettle.DeviceID, n int) {
	b := bucketOf(id)
	st.devs[b][id] = struct{}{}
	st.bucketRows[b] += n
	st.rows += n
	st.stagedRows.Store(int64(st.rows))
}

// poke wakes the merger when staged is over its threshold. Under wmu.
func (st *stage) poke() {
	if st.rows < st.mergeRows || st.wake == nil {
		return
	}
	select {
	case st.wake <- struct{}{}:
	default:
	}
}

// startMerger starts the goroutine that merges staged rows; Close stops it.
func (s *Store) startMerger() {
	st := &s.stage
	st.wake, st.stop, st.done = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(st.done)
		tick := time.NewTicker(st.mergeEvery)
		defer tick.Stop()
		for {
			select {
			case <-st.stop:
				return
			case <-st.wake:
			case <-tick.C:
			}
			// One bucket per lock, then a pause as long: batches run
			// between them.
			for b := 0; b < stageBuckets; b++ {
				select {
				case <-st.stop: // Close: the rest stays staged
					return
				default:
				}
				s.wmu.Lock()
				t0 := time.Now()
				err := s.mergeBucket(context.Background(), b)
				held := time.Since(t0)
				s.wmu.Unlock()
				if err == nil {
					// Leave the writer to the batches for as long as this
					// bucket held it, so that what queued up meanwhile
					// commits before the next bucket. sync.Mutex is not
					// fair: without the pause the merger can take the lock
					// straight back, and the batches' commits wait behind
					// bucket after bucket (docs/performance.md, "The
					// embedded store").
					select {
					case <-st.stop: // Close: the rest stays staged
						return
					case <-time.After(min(held, time.Second)):
					}
					continue
				}
				st.mergeErr.Store(&err)
				st.mergeErrors.Add(1)
				st.log.Warn("sqlite merge of the staging table failed; its rows stay staged and readable, retrying in 1s", "err", err)
				select {
				case <-st.stop:
					return
				case <-time.After(time.Second):
				}
				s.wmu.Lock()
				st.poke()
				s.wmu.Unlock()
				break
			}
		}
	}()
}

func (s *Store) stopMerger() {
	if s.stage.stop != nil {
		close(s.stage.stop)
		<-s.stage.done
	}
}

// Merges is how many bucket merges have committed.
func (s *Store) Merges() uint64 { return s.stage.merges.Load() }

// MergeStats returns the staging table's state for /metrics: rows staged
// now, bucket merges committed and failed, and the seconds spent merging.
func (s *Store) MergeStats() (staged int64, merges, errors uint64, seconds float64) {
	return s.stage.stagedRows.Load(), s.stage.merges.Load(), s.stage.mergeErrors.Load(),
		float64(s.stage.mergeNanos.Load()) / 1e9
}

// MergeErr returns the error of the last failed merge (nil if none failed).
func (s *Store) MergeErr() error {
	if p := s.stage.mergeErr.Load(); p != nil {
		return *p
	}
	return nil
}

// Merge moves every staged row to measurements now (see the comment at the
// top of stage.go), holding the writer lock throughout. The merger merges
// one bucket at a time instead; tests and tools may call this.
func (s *Store) Merge(ctx context.Context) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.mergeLocked(ctx)
}

// mergeLocked is Merge under wmu.
func (s *Store) mergeLocked(ctx context.Context) error {
	for b := 0; b < stageBuckets; b++ {
		if err := s.mergeBucket(ctx, b); err != nil {
			return err
		}
	}
	return nil
}

// mergeBucket moves bucket b's staged rows in one transaction. Under wmu.
func (s *Store) mergeBucket(ctx context.Context, b int) error {
	start := time.Now()
	sc := &s.wsc
	var rows int64
	err := s.tx(ctx, "merge staged rows", func(tx *sql.Tx) error {
		rows = 0
		if err := s.syncCache(ctx, tx); err != nil {
			return err
		}
		if s.stage.bucketRows[b] == 0 {
			return nil
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO measurements(device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml)
			SELECT device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml FROM staged WHERE b = ? ORDER BY device, t`, b)
		if err != nil {
			return fmt.Errorf("move staged rows: %w", err)
		}
		if rows, err = res.RowsAffected(); err != nil {
			return err
		}
		if rows != int64(s.stage.bucketRows[b]) {
			return fmt.Errorf("moved %d staged rows of bucket %d, the writer counted %d", rows, b, s.stage.bucketRows[b])
		}
		sc.reset()
		for id := range s.stage.devs[b] {
			st, ok := s.cache.devs[id]
			if !ok {
				return fmt.Errorf("staged rows of device %s, which is not in the cache", id)
			}
			sc.devs = append(sc.devs, devAgg{id: id, st: st})
		}
		slices.SortFunc(sc.devs, func(a, b devAgg) int { return bytes.Compare(a.id[:], b.id[:]) })
		if err := s.upsertDevices(ctx, tx); err != nil {
			return fmt.Errorf("update devices: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM staged WHERE b = ?`, b); err != nil {
			return fmt.Errorf("empty staged bucket %d: %w", b, err)
		}
		return nil
	})
	sc.reset()
	if err != nil {
		s.cache.valid = false
		return fmt.Errorf("sqlite merge: %w", err)
	}
	if rows == 0 {
		return nil
	}
	s.stage.rows -= int(rows)
	s.stage.bucketRows[b] = 0
	s.stage.stagedRows.Store(int64(s.stage.rows))
	clear(s.stage.devs[b])
	s.stage.merges.Add(1)
	s.stage.mergeNanos.Add(int64(time.Since(start)))
	return nil
}

// foldStaged folds one staged row into d, as Write folded it into the
// writer's cache: one more measurement, capacity and last seen never go
// down, latest only if newer.
func foldStaged(d *kettle.DeviceState, m *kettle.Measurement, recv time.Time) {
	d.Measurements++
	d.CapacityML = max(d.CapacityML, m.LevelML)
	if recv.After(d.LastSeen) {
		d.LastSeen = recv
	}
	if d.Latest == nil || m.Time.After(d.Latest.Time) {
		l := *m
		d.Latest = &l
	}
}

// foldStagedState is foldStaged for the writer's cache entry.
func foldStagedState(d *devState, r reading, recv int64) {
	d.n++
	d.capML = max(d.capML, r.level)
	if !d.hasSeen || recv > d.seen {
		d.seen, d.hasSeen = recv, true
	}
	if !d.hasLatest || r.t > d.latest.t {
		d.latest, d.hasLatest = r, true
	}
}

// stagedColumns are read by scanStaged, in this order.
const stagedColumns = `device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml, recv`

// scanStaged reads the staged rows q selects (stagedColumns) and calls fn
// for each.
func scanStaged(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, query string, args []any, fn func(id kettle.DeviceID, r reading, recv int64)) error {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return fmt.Errorf("read staged rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			raw  sql.RawBytes
			id   kettle.DeviceID
			r    reading
			recv int64
		)
		if err := rows.Scan(&raw, &r.t, &r.charge, &r.full, &r.rate, &r.amb, &r.water, &r.level, &recv); err != nil {
			return fmt.Errorf("read staged rows: %w", err)
		}
		if len(raw) != len(id) {
			return fmt.Errorf("read staged rows: device id of %d bytes, want %d", len(raw), len(id))
		}
		copy(id[:], raw)
		fn(id, r, recv)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read staged rows: %w", err)
	}
	return nil
}

// measurementOf is r as a measurement of device id.
func measurementOf(id kettle.DeviceID, r reading) kettle.Measurement {
	return kettle.Measurement{Device: id, Time: fromMicro(r.t), ChargeMWh: r.charge, FullMWh: r.full,
		RateMW: r.rate, AmbientC: r.amb, WaterC: r.water, LevelML: r.level}
}
