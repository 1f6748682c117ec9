package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/backoff"
)

// WriterConfig configures a writer (kettle serve --role writer).
type WriterConfig struct {
	Target
	Topic TopicConfig
	Group string // consumer group (default "kettle-writers")
	// BatchRows is the most readings in one store transaction (default
	// 16000). A poll takes up to BatchRows records; their readings are
	// written in transactions of up to BatchRows, and the offsets committed
	// after the last one.
	BatchRows int
	// SessionTimeout: a writer killed without leaving is replaced after
	// this (default 10 s).
	SessionTimeout time.Duration
	// MonitorEvery is how often the lag is measured (default 5 s).
	MonitorEvery time.Duration
	Log          *slog.Logger
	Metrics      prometheus.Registerer
	// Written, if set, is told of every batch the store committed (the
	// readings and their duplicate flags), after the offsets commit.
	Written func(rows []kettle.Measurement, dup []bool)
}

// Writer consumes the readings topic in a consumer group and writes the
// store: the readings of a poll in large transactions (each with its
// derived state: latest state, statistics, all in the store's Write),
// then the offsets, only after the store committed. A writer that dies
// between the two leaves the offsets behind: its successor writes the
// same readings again and the store, idempotent on (device, time), stores
// and counts them once.
type Writer struct {
	cfg   WriterConfig
	store kettle.Store
	cl    *kgo.Client
	mon   *Monitor
	m     *writerMetrics

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu       sync.Mutex
	batches  int64
	lastErr  error
	assigned int
}

// NewWriter joins the group and starts writing; Close stops it.
func NewWriter(ctx context.Context, store kettle.Store, cfg WriterConfig) (*Writer, error) {
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.BatchRows <= 0 {
		cfg.BatchRows = 16000
	}
	if cfg.SessionTimeout <= 0 {
		cfg.SessionTimeout = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = prometheus.NewRegistry()
	}
	w := &Writer{cfg: cfg, store: store, m: newWriterMetrics(cfg.Metrics), done: make(chan struct{})}
	cl, err := cfg.Target.NewClient(
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Target.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		// Between a poll and its offset commit no rebalance takes the
		// partitions away: a commit always covers readings this writer
		// stored, and a successor starts after them (or replays them, if
		// this writer died before the commit).
		kgo.BlockRebalanceOnPoll(),
		kgo.SessionTimeout(cfg.SessionTimeout),
		// A store outage holds a batch (and the rebalance) while the
		// writer retries; the group waits this long before evicting it.
		kgo.RebalanceTimeout(5*time.Minute),
		kgo.FetchMaxWait(200*time.Millisecond),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { w.countAssigned(m, 1) }),
		kgo.OnPartitionsRevoked(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { w.countAssigned(m, -1) }),
		kgo.OnPartitionsLost(func(_ context.Context, _ *kgo.Client, m map[string][]int32) { w.countAssigned(m, -1) }),
	)
	if err != nil {
		return nil, fmt.Errorf("--log %s: %w", cfg.Target, err)
	}
	adm := kadm.NewClient(cl)
	tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	_, err = EnsureTopic(tctx, adm, cfg.Target.Topic, cfg.Topic)
	cancel()
	if err != nil {
		cl.Close()
		return nil, fmt.Errorf("--log %s: %w", cfg.Target, err)
	}
	w.cl = cl
	w.mon = NewMonitor(adm, MonitorConfig{Target: cfg.Target, Group: cfg.Group, Oldest: true, Every: cfg.MonitorEvery, Log: cfg.Log, Metrics: cfg.Metrics})
	w.ctx, w.cancel = context.WithCancel(context.Background())
	go w.run()
	cfg.Log.Info("log writer started: consuming the readings log into the store", "log", cfg.Target.String(), "group", cfg.Group, "batch_rows", cfg.BatchRows)
	return w, nil
}

func (w *Writer) countAssigned(m map[string][]int32, sign int) {
	w.mu.Lock()
	for _, ps := range m {
		w.assigned += sign * len(ps)
	}
	w.mu.Unlock()
}

// Monitor is the writer's view of the group's lag.
func (w *Writer) Monitor() *Monitor { return w.mon }

// Stats reports the batches committed, the partitions assigned now, and
// the last store error (nil after a success).
func (w *Writer) Stats() (batches int64, assigned int, lastErr error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.batches, w.assigned, w.lastErr
}

func (w *Writer) run() {
	defer close(w.done)
	var rows []kettle.Measurement
	for {
		fs := w.cl.PollRecords(w.ctx, w.cfg.BatchRows)
		if w.ctx.Err() != nil || fs.IsClientClosed() {
			w.cl.AllowRebalance()
			return
		}
		fs.EachError(func(t string, p int32, err error) {
			if !errors.Is(err, context.Canceled) {
				w.cfg.Log.Warn("fetch from the readings log failed; retrying", "topic", t, "partition", p, "err", err)
			}
		})
		recs := fs.Records()
		if len(recs) == 0 {
			w.cl.AllowRebalance()
			continue
		}
		if !w.writeAll(recs, rows[:0]) {
			w.cl.AllowRebalance()
			return // closing: offsets stay uncommitted, the next owner replays
		}
		// Offsets after the store commit. If this fails (the group moved
		// on), the next owner replays what was stored: counted once.
		// Its own context: a Close while the store committed still
		// commits the offsets of what was stored.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := w.cl.CommitRecords(ctx, recs...)
		cancel()
		if err != nil {
			w.cfg.Log.Warn("committing offsets after the store commit failed; the partitions' next owner writes these readings again (stored once)", "err", err)
		}
		w.cl.AllowRebalance()
	}
}

// writeAll writes the readings of recs in transactions of up to BatchRows,
// retrying each until the store commits it; false: closing meanwhile.
func (w *Writer) writeAll(recs []*kgo.Record, rows []kettle.Measurement) bool {
	var received time.Time
	flush := func() bool {
		if len(rows) == 0 {
			return true
		}
		if received.IsZero() {
			received = time.Now() // a value without received_at
		}
		ok := w.write(rows, received)
		rows, received = rows[:0], time.Time{}
		return ok
	}
	for _, r := range recs {
		before := len(rows)
		var at time.Time
		var err error
		rows, at, err = Decode(r, rows)
		if err != nil {
			w.m.skipped.Inc()
			w.cfg.Log.Error("skipping a record of the readings log that this version cannot read", "err", err)
			rows = rows[:before]
			continue
		}
		if at.After(received) {
			received = at
		}
		if len(rows) >= w.cfg.BatchRows && !flush() {
			return false
		}
	}
	return flush()
}

// write commits one batch, retrying with backoff while the store fails.
func (w *Writer) write(rows []kettle.Measurement, received time.Time) bool {
	retry := backoff.Backoff{Initial: 100 * time.Millisecond, Max: 2 * time.Second}
	for {
		start := time.Now()
		// A transaction under way finishes even if Close is called.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		dup, err := w.store.Write(ctx, rows, received)
		cancel()
		w.m.commit.Observe(time.Since(start).Seconds())
		if err == nil {
			ndup := 0
			for _, d := range dup {
				if d {
					ndup++
				}
			}
			w.m.batch.Observe(float64(len(rows)))
			w.m.written.Add(float64(len(rows) - ndup))
			w.m.duplicates.Add(float64(ndup))
			w.mu.Lock()
			w.batches++
			w.lastErr = nil
			w.mu.Unlock()
			if w.cfg.Written != nil {
				w.cfg.Written(rows, dup)
			}
			return true
		}
		w.m.storeErrors.Inc()
		w.mu.Lock()
		first := w.lastErr == nil
		w.lastErr = err
		w.mu.Unlock()
		if first {
			w.cfg.Log.Error("store write from the log failed; retrying the same batch (offsets stay uncommitted, the log keeps the readings)", "rows", len(rows), "err", err)
		}
		if !retry.Wait(w.ctx, 0) {
			return false
		}
	}
}

// Close stops consuming: a transaction under way finishes and its offsets
// are committed; a batch still waiting for the store is abandoned
// uncommitted (the partition's next owner writes it). Then it leaves the
// group and disconnects.
func (w *Writer) Close() {
	w.cancel()
	<-w.done
	w.mon.Close()
	w.cl.Close() // leaves the group: the others take the partitions at once
}
