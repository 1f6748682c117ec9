package kafka

import (
	"github.com/prometheus/client_golang/prometheus"
)

// producerMetrics are a front node's (kettle serve --log).
type producerMetrics struct {
	latency  prometheus.Histogram
	readings prometheus.Counter
	refused  *prometheus.CounterVec
	inflight prometheus.GaugeFunc
	capacity prometheus.Gauge
}

func newProducerMetrics(reg prometheus.Registerer, inflight func() float64) *producerMetrics {
	m := &producerMetrics{
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kettle_log_produce_seconds",
			Help:    "Time from handing an upload's readings to the log until every broker in the ISR acknowledged them (acks=all).",
			Buckets: []float64{.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10},
		}),
		readings: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_log_produced_readings_total",
			Help: "Readings the log acknowledged (acks=all); the kettle got its 2xx or PUBACK after that.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kettle_log_refused_readings_total",
			Help: "Readings refused with 503 by reason: buffer_full (producer in-flight bound), unwritten_too_old (writers behind near the topic's retention), produce_failed (the log did not acknowledge in time).",
		}, []string{"reason"}),
		inflight: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kettle_log_producer_inflight_readings",
			Help: "Readings handed to the log and not yet acknowledged.",
		}, inflight),
		capacity: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kettle_log_producer_inflight_capacity_readings",
			Help: "Most readings in flight to the log; beyond it uploads are answered 503 + Retry-After (--log-max-inflight).",
		}),
	}
	for _, r := range []string{"buffer_full", "unwritten_too_old", "produce_failed"} {
		m.refused.WithLabelValues(r)
	}
	reg.MustRegister(m.latency, m.readings, m.refused, m.inflight, m.capacity)
	return m
}

// writerMetrics are a writer's (kettle serve --role writer).
type writerMetrics struct {
	batch       prometheus.Histogram
	commit      prometheus.Histogram
	written     prometheus.Counter
	duplicates  prometheus.Counter
	skipped     prometheus.Counter
	storeErrors prometheus.Counter
}

func newWriterMetrics(reg prometheus.Registerer) *writerMetrics {
	m := &writerMetrics{
		batch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kettle_log_writer_batch_readings",
			Help:    "Readings per store transaction written from the log.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 9),
		}),
		commit: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kettle_log_writer_commit_seconds",
			Help:    "Time of one store transaction of readings from the log (a failed attempt included).",
			Buckets: prometheus.ExponentialBuckets(.001, 2.5, 12),
		}),
		written: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_log_written_readings_total",
			Help: "Readings from the log stored for the first time (committed, offsets committed after).",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_log_writer_duplicates_total",
			Help: "Readings from the log the store already held (a replay after a writer crash or rebalance, or a kettle's retry): stored and counted once.",
		}),
		skipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_log_writer_skipped_records_total",
			Help: "Records of the topic the writer could not read (unknown schema, bad value) and skipped; each is logged.",
		}),
		storeErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kettle_log_writer_store_errors_total",
			Help: "Failed store transactions of the writer; it retries the same batch, offsets stay uncommitted.",
		}),
	}
	reg.MustRegister(m.batch, m.commit, m.written, m.duplicates, m.skipped, m.storeErrors)
	return m
}
