package kafka

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Monitor measures, every few seconds, what the writers have not written
// yet: the lag of their consumer group per partition (records after its
// committed offset) and the age of the oldest unwritten record. With
// MaxAge set it also says when some unwritten record is older than that
// (TooOld): a front node then refuses uploads, so that the writers catch up
// before Kafka's retention could delete a record nobody wrote.
type Monitor struct {
	adm      *kadm.Client
	target   Target
	oldestOn bool
	topic    string
	group    string
	maxAge   time.Duration
	every    time.Duration
	now      func() time.Time
	log      *slog.Logger

	tooOld    atomic.Bool
	oldestAge atomic.Int64 // ns; 0: nothing unwritten
	ok        atomic.Bool  // the last round answered

	mu  sync.Mutex
	lag map[int32]int64

	lagVec  *prometheus.GaugeVec
	stop    chan struct{}
	stopped chan struct{}
}

// MonitorConfig configures a Monitor.
type MonitorConfig struct {
	Target
	Group string
	// MaxAge: unwritten records older than this make TooOld true (0: never).
	MaxAge time.Duration
	// Oldest: measure the age of the oldest unwritten reading by reading
	// the first unwritten record of each partition — the writers' monitor
	// only: a front's user may not read the topic (its ACLs let it
	// produce), and TooOld needs no record.
	Oldest bool
	// Every is the interval between measurements (default 5 s).
	Every   time.Duration
	Now     func() time.Time
	Log     *slog.Logger
	Metrics prometheus.Registerer
}

// NewMonitor starts measuring; Close stops it.
func NewMonitor(adm *kadm.Client, cfg MonitorConfig) *Monitor {
	if cfg.Every <= 0 {
		cfg.Every = DefaultMonitorEvery
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	m := &Monitor{adm: adm, target: cfg.Target, oldestOn: cfg.Oldest, topic: cfg.Topic, group: cfg.Group, maxAge: cfg.MaxAge, every: cfg.Every,
		now: cfg.Now, log: cfg.Log, lag: map[int32]int64{}, stop: make(chan struct{}), stopped: make(chan struct{})}
	m.lagVec = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kettle_log_lag_records",
		Help: "Records of the readings topic after the writers' committed offset, by partition (not yet in the store).",
	}, []string{"partition"})
	if cfg.Oldest {
		cfg.Metrics.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_log_oldest_unwritten_age_seconds",
			Help: "Age (by the time a front node received it) of the oldest reading in the log not yet written to the store; 0 when every record is written. Measured by the writers, who may read the topic.",
		}, func() float64 { return time.Duration(m.oldestAge.Load()).Seconds() }))
	}
	cfg.Metrics.MustRegister(m.lagVec,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_log_unwritten_too_old",
			Help: "1 while some unwritten reading is older than --log-max-unwritten-age: front nodes refuse uploads (503) until the writers catch up, so that nothing ages out of the topic's retention unwritten.",
		}, func() float64 {
			if m.tooOld.Load() {
				return 1
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_log_monitor_up",
			Help: "1 if the last measurement of the log's lag answered.",
		}, func() float64 {
			if m.ok.Load() {
				return 1
			}
			return 0
		}),
	)
	go m.run()
	return m
}

// TooOld reports whether an unwritten record is older than MaxAge.
func (m *Monitor) TooOld() bool { return m.tooOld.Load() }

// OldestUnwritten is the age of the oldest unwritten record (0: none).
func (m *Monitor) OldestUnwritten() time.Duration { return time.Duration(m.oldestAge.Load()) }

// Lag is the records not yet written, summed over partitions.
func (m *Monitor) Lag() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var n int64
	for _, l := range m.lag {
		n += l
	}
	return n
}

// Close stops the measurements.
func (m *Monitor) Close() {
	close(m.stop)
	<-m.stopped
}

func (m *Monitor) run() {
	defer close(m.stopped)
	t := time.NewTicker(m.every)
	defer t.Stop()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), m.every)
		err := m.Measure(ctx)
		cancel()
		m.ok.Store(err == nil)
		if err != nil && m.log != nil {
			m.log.Warn("could not measure the readings log's lag; kettle_log_* gauges keep their last values", "err", err)
		}
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
	}
}

// Measure takes one measurement now.
func (m *Monitor) Measure(ctx context.Context) error {
	ends, err := m.adm.ListEndOffsets(ctx, m.topic)
	if err != nil {
		return err
	}
	starts, err := m.adm.ListStartOffsets(ctx, m.topic)
	if err != nil {
		return err
	}
	committed, err := m.adm.FetchOffsetsForTopics(ctx, m.group, m.topic)
	if err != nil {
		return err
	}
	now := m.now()
	behind := map[int32]int64{} // partition → first unwritten offset
	lag := map[int32]int64{}
	ends.Each(func(e kadm.ListedOffset) {
		if e.Err != nil || e.Topic != m.topic {
			return
		}
		from := int64(0)
		if s, ok := starts.Lookup(m.topic, e.Partition); ok && s.Err == nil {
			from = s.Offset
		}
		if c, ok := committed.Lookup(m.topic, e.Partition); ok && c.Err == nil && c.At >= 0 {
			from = max(from, c.At)
		}
		l := max(e.Offset-from, 0)
		lag[e.Partition] = l
		if l > 0 {
			behind[e.Partition] = from
		}
	})
	m.mu.Lock()
	m.lag = lag
	m.mu.Unlock()
	for p, l := range lag {
		m.lagVec.WithLabelValues(strconv.Itoa(int(p))).Set(float64(l))
	}
	if len(behind) == 0 {
		m.oldestAge.Store(0)
		m.tooOld.Store(false)
		return nil
	}
	if m.maxAge > 0 {
		// The first record at or after now − maxAge, per partition: an
		// unwritten offset before it is an unwritten record older.
		after, err := m.adm.ListOffsetsAfterMilli(ctx, now.Add(-m.maxAge).UnixMilli(), m.topic)
		if err != nil {
			return err
		}
		old := false
		for p, from := range behind {
			if a, ok := after.Lookup(m.topic, p); ok && a.Err == nil && from < a.Offset {
				old = true
			}
		}
		if old != m.tooOld.Load() && m.log != nil {
			if old {
				m.log.Error("readings in the log have waited longer than --log-max-unwritten-age for a writer: uploads are refused (503) until the writers catch up; start or fix kettle serve --role writer", "max_unwritten_age", m.maxAge.String())
			} else {
				m.log.Info("the writers caught up: uploads are accepted again")
			}
		}
		m.tooOld.Store(old)
	}
	if !m.oldestOn {
		return nil
	}
	oldest, err := m.oldest(ctx, behind)
	if err != nil {
		return err
	}
	if !oldest.IsZero() {
		m.oldestAge.Store(int64(max(now.Sub(oldest), 0)))
	}
	return nil
}

// oldest reads the first unwritten record of each partition behind and
// returns the earliest timestamp (zero if none was read in time).
func (m *Monitor) oldest(ctx context.Context, behind map[int32]int64) (time.Time, error) {
	parts := map[int32]kgo.Offset{}
	for p, off := range behind {
		parts[p] = kgo.NewOffset().At(off)
	}
	cl, err := m.target.NewClient(
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{m.topic: parts}),
		kgo.FetchMaxWait(100*time.Millisecond), kgo.FetchMaxPartitionBytes(64<<10), kgo.FetchMaxBytes(1<<20))
	if err != nil {
		return time.Time{}, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var oldest time.Time
	seen := map[int32]bool{}
	for len(seen) < len(parts) && ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		fs.EachRecord(func(r *kgo.Record) {
			if seen[r.Partition] || r.Offset < behind[r.Partition] {
				return
			}
			seen[r.Partition] = true
			if oldest.IsZero() || r.Timestamp.Before(oldest) {
				oldest = r.Timestamp
			}
		})
	}
	return oldest, nil
}
