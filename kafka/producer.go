package kafka

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
)

// ProducerConfig configures a front node's producer.
type ProducerConfig struct {
	Target
	// Topic is how the topic is created if it does not exist.
	Topic TopicConfig
	// Group is the writers' consumer group, whose lag the producer watches
	// (empty: DefaultGroup).
	Group string
	// MaxInflight bounds the readings handed to the log and not yet
	// acknowledged; past it Append refuses with 503 + Retry-After at once
	// (0: DefaultMaxInflight).
	MaxInflight int
	// Timeout bounds how long an upload waits for the log's
	// acknowledgement before it is refused (503) (0: DefaultTimeout).
	Timeout time.Duration
	// MaxUnwrittenAge: while some reading in the log has waited longer than
	// this for a writer, uploads are refused (503), so nothing reaches the
	// topic's retention unwritten. Default half the topic's retention.
	MaxUnwrittenAge time.Duration
	// MonitorEvery is how often the writers' lag is measured (0:
	// DefaultMonitorEvery).
	MonitorEvery time.Duration
	RetryAfter   time.Duration // told to refused clients (default 1 s)
	Now          func() time.Time
	Log          *slog.Logger
	Metrics      prometheus.Registerer
}

// The producer's defaults: a zero ProducerConfig field takes its value.
const (
	DefaultGroup        = "kettle-writers" // the writers' consumer group
	DefaultMaxInflight  = 20000            // readings awaiting the log's acknowledgement
	DefaultTimeout      = 10 * time.Second // an upload's wait for the acknowledgement
	DefaultMonitorEvery = 5 * time.Second  // between measurements of the writers' lag
)

// Producer hands validated readings to the log (fleet.Log): one record per
// device run of an upload, keyed by device id, idempotent, acks=all.
type Producer struct {
	cfg      ProducerConfig
	cl       *kgo.Client
	adm      *kadm.Client
	mon      *Monitor
	inflight atomic.Int64
	m        *producerMetrics
}

// NewProducer connects, creates the topic if it does not exist, and starts
// watching the writers' lag.
func NewProducer(ctx context.Context, cfg ProducerConfig) (*Producer, error) {
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = DefaultMaxInflight
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = prometheus.NewRegistry()
	}
	cl, err := cfg.Target.NewClient(
		kgo.DefaultProduceTopic(cfg.Target.Topic),
		kgo.RequiredAcks(kgo.AllISRAcks()), // idempotent by default with acks=all
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
		// Batches form while the previous request waits for the ISR; a
		// linger would only add to every upload's latency.
		kgo.ProducerLinger(0),
		kgo.ProducerBatchCompression(kgo.NoCompression()), // CPU is the scarce part here, not disk
		kgo.MaxBufferedRecords(cfg.MaxInflight+1),         // records ≤ readings: Produce never blocks
		kgo.RecordDeliveryTimeout(cfg.Timeout),
		// A lost broker's partitions get new leaders within about a second
		// (deploy/kafka/broker.properties: broker.session.timeout.ms); the
		// producer asks for them again at most every 100 ms instead of the
		// default 5 s, which alone made uploads wait up to 5 s longer than
		// the election.
		kgo.MetadataMinAge(100*time.Millisecond),
		// Retrying a partition whose leader is gone: 100 ms, then 200 ms,
		// at most 250 ms between tries (default: 250 ms growing to 5 s),
		// so the first try after the new leader is known is not seconds
		// away.
		kgo.RetryBackoffFn(func(tries int) time.Duration {
			return min(time.Duration(tries)*100*time.Millisecond, 250*time.Millisecond)
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("--log %s: %w", cfg.Target, err)
	}
	adm := kadm.NewClient(cl)
	tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	retention, err := EnsureTopic(tctx, adm, cfg.Target.Topic, cfg.Topic)
	cancel()
	if err != nil {
		cl.Close()
		return nil, fmt.Errorf("--log %s: %w", cfg.Target, err)
	}
	if cfg.MaxUnwrittenAge <= 0 {
		cfg.MaxUnwrittenAge = retention / 2
	}
	if retention > 0 && cfg.MaxUnwrittenAge >= retention {
		cl.Close()
		return nil, fmt.Errorf("--log-max-unwritten-age %s: must be below the topic's retention (%s), or readings could age out of the log before a writer stored them", cfg.MaxUnwrittenAge, retention)
	}
	p := &Producer{cfg: cfg, cl: cl, adm: adm}
	p.m = newProducerMetrics(cfg.Metrics, func() float64 { return float64(p.inflight.Load()) })
	p.m.capacity.Set(float64(cfg.MaxInflight))
	p.mon = NewMonitor(adm, MonitorConfig{Target: cfg.Target, Group: cfg.Group, MaxAge: cfg.MaxUnwrittenAge,
		Every: cfg.MonitorEvery, Now: cfg.Now, Log: cfg.Log, Metrics: cfg.Metrics})
	cfg.Log.Info("readings log: uploads are acknowledged once the log holds them (acks=all)", "log", cfg.Target.String(),
		"retention", retention.String(), "max_unwritten_age", cfg.MaxUnwrittenAge.String(), "max_inflight", cfg.MaxInflight)
	return p, nil
}

// Monitor is the producer's view of the writers' lag.
func (p *Producer) Monitor() *Monitor { return p.mon }

// Append produces rows (validated; runs of one device become one record)
// and returns once the log acknowledged every record (acks=all), or an
// EUnavailable error with a Retry-After: the in-flight bound is reached,
// the writers are too far behind, or the log did not acknowledge in time.
func (p *Producer) Append(ctx context.Context, rows []kettle.Measurement, received time.Time) error {
	if len(rows) == 0 {
		return nil
	}
	n := int64(len(rows))
	if p.mon.TooOld() {
		p.m.refused.WithLabelValues("unwritten_too_old").Add(float64(n))
		return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: 10 * p.cfg.RetryAfter,
			Message: fmt.Sprintf("the readings log holds readings no writer has stored for over %s; uploads are refused until the writers catch up: retry later", p.cfg.MaxUnwrittenAge)}
	}
	if p.inflight.Add(n) > int64(p.cfg.MaxInflight) {
		p.inflight.Add(-n)
		p.m.refused.WithLabelValues("buffer_full").Add(float64(n))
		return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: p.cfg.RetryAfter,
			Message: fmt.Sprintf("readings log producer full (%d readings waiting for the log's acknowledgement); retry after %s or raise --log-max-inflight", p.cfg.MaxInflight, p.cfg.RetryAfter)}
	}
	defer p.inflight.Add(-n)
	recs := make([]*kgo.Record, 0, 1)
	for i := 0; i < len(rows); {
		j := i + 1
		for j < len(rows) && rows[j].Device == rows[i].Device {
			j++
		}
		recs = append(recs, NewRecord(rows[i:j], received))
		i = j
	}
	start := time.Now()
	// Not the client's context: once produced, the record is in the log
	// whether or not the kettle waits; RecordDeliveryTimeout bounds this.
	res := p.cl.ProduceSync(context.WithoutCancel(ctx), recs...)
	if err := res.FirstErr(); err != nil {
		p.m.refused.WithLabelValues("produce_failed").Add(float64(n))
		return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: p.cfg.RetryAfter,
			Message: fmt.Sprintf("readings log did not acknowledge (%v); retry after %s", err, p.cfg.RetryAfter)}
	}
	p.m.latency.Observe(time.Since(start).Seconds())
	p.m.readings.Add(float64(n))
	return nil
}

// Ping reports whether a broker of the log answers (a front's readiness
// with --log: see fleet.Service.Ping).
func (p *Producer) Ping(ctx context.Context) error {
	if err := p.cl.Ping(ctx); err != nil {
		return fmt.Errorf("readings log %s: %w", p.cfg.Target, err)
	}
	return nil
}

// Close flushes what is buffered (bounded by the delivery timeout) and
// disconnects. Call it after the fleet service closed.
func (p *Producer) Close() {
	p.mon.Close()
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
	defer cancel()
	_ = p.cl.Flush(ctx)
	p.cl.Close()
}
