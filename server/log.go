package server

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/redact"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/metrics"
)

// LogConfig puts a replicated log between the front and the store
// (kettle serve --log): fronts acknowledge once the log holds a reading,
// writers (Role "writer") store it. URL empty: the direct path. Defaults:
// DefaultConfig().Log (kafka's).
type LogConfig struct {
	URL             string        // kafka://h1:9092,h2:9092,h3:9092/topic
	Partitions      int           // when the topic is created
	Retention       time.Duration // when the topic is created
	MaxInflight     int           // readings awaiting the log's ack on a front
	Timeout         time.Duration // an upload waits this long for the ack
	MaxUnwrittenAge time.Duration // refuse uploads past it (0: half the retention)
	Group           string        // the writers' consumer group
	MonitorEvery    time.Duration // lag measurement interval
	// CA, User and Password: TLS to the brokers checked against CA, and
	// SASL/SCRAM-SHA-512 as User (kafka.Auth). Empty: plain TCP, no SASL.
	CA       string
	User     string
	Password string
}

// target is the log's --log URL with its Auth.
func (c LogConfig) target() (kafka.Target, error) {
	t, err := kafka.ParseURL(c.URL)
	if err != nil {
		return t, err
	}
	t.Auth = kafka.Auth{CA: c.CA, User: c.User, Password: c.Password}
	return t, nil
}

// Roles of kettle serve --role.
const (
	RoleFront  = "front"  // device API, commands, statistics (the default)
	RoleWriter = "writer" // consume --log into the store; /metrics, /healthz, /readyz only
)

// startLog connects a front node to the log (Config.Log.URL set): the
// fleet service appends to it instead of queueing for the store.
func (s *Server) startLog(ctx context.Context, cfg *Config, reg prometheus.Registerer) error {
	if cfg.Log.URL == "" {
		return nil
	}
	t, err := cfg.Log.target()
	if err != nil {
		return err
	}
	p, err := kafka.NewProducer(ctx, kafka.ProducerConfig{Target: t,
		Topic: kafka.TopicConfig{Partitions: cfg.Log.Partitions, Retention: cfg.Log.Retention},
		Group: cfg.Log.Group, MaxInflight: cfg.Log.MaxInflight, Timeout: cfg.Log.Timeout,
		MaxUnwrittenAge: cfg.Log.MaxUnwrittenAge, MonitorEvery: cfg.Log.MonitorEvery,
		RetryAfter: cfg.Ingest.RetryAfter, Now: cfg.Now, Log: s.log, Metrics: reg})
	if err != nil {
		return err
	}
	s.producer = p
	cfg.Ingest.Log = p
	return nil
}

// Producer is the log producer of a front node with --log (nil without).
func (s *Server) Producer() *kafka.Producer { return s.producer }

// Writer is a running kettle serve --role writer: the log's consumer into
// the store, with /metrics, /healthz and /readyz on Config.Addr.
type Writer struct {
	cfg   Config
	log   *slog.Logger
	store kettle.Store
	w     *kafka.Writer
	http  *http.Server
	ln    net.Listener
	stop  chan struct{}
	beat  chan struct{}
	done  chan error
	once  sync.Once
	err   error
}

// StartWriter opens the store, joins the writers' group on cfg.Log.URL and
// serves its metrics on cfg.Addr. On a store several processes share
// (kettle.Nodes) it says every 5 s that it writes, so front nodes refresh
// their command caches with what it stored.
func StartWriter(ctx context.Context, cfg Config) (*Writer, error) {
	cfg.defaults()
	if cfg.Log.URL == "" {
		return nil, fmt.Errorf("--role writer needs --log kafka://h1:9092,h2:9092,h3:9092/topic: a writer consumes the readings log")
	}
	t, err := cfg.Log.target()
	if err != nil {
		return nil, err
	}
	reg := cfg.Metrics
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := metrics.New(reg)
	store, err := OpenStore(ctx, cfg.DB, cfg.Store, cfg.Logger)
	if err != nil {
		return nil, err
	}
	m.RegisterStore(store)
	registerPool(m, store)
	batch := cfg.Ingest.BatchRows
	if batch <= 0 {
		batch = PGBatchRows
	}
	w := &Writer{cfg: cfg, log: cfg.Logger, store: store, stop: make(chan struct{}), beat: make(chan struct{}), done: make(chan error, 1)}
	w.w, err = kafka.NewWriter(ctx, store, kafka.WriterConfig{Target: t,
		Topic: kafka.TopicConfig{Partitions: cfg.Log.Partitions, Retention: cfg.Log.Retention},
		Group: cfg.Log.Group, BatchRows: batch, MonitorEvery: cfg.Log.MonitorEvery, Log: cfg.Logger, Metrics: reg})
	if err != nil {
		store.Close()
		return nil, err
	}
	go w.beatLoop()
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", m.Handler())
	mux.HandleFunc("GET /healthz", func(rw http.ResponseWriter, _ *http.Request) { rw.Write([]byte(`{"status":"ok"}` + "\n")) })
	mux.HandleFunc("GET /readyz", w.readyz)
	mux.HandleFunc("GET /drained", w.drained)
	w.ln, err = net.Listen("tcp", cfg.Addr)
	if err != nil {
		w.closeWriter()
		return nil, fmt.Errorf("listen on %s: %w (choose --addr)", cfg.Addr, err)
	}
	w.http = &http.Server{Handler: mux, ReadHeaderTimeout: cfg.ReadHeaderTimeout}
	go func() { w.done <- w.http.Serve(w.ln) }()
	cfg.Logger.Info("kettle serve --role writer started", "addr", w.Addr(), "db", redact.DSN(cfg.DB), "log", t.String(), "batch_rows", batch)
	return w, nil
}

// readyz: 200 while the last store write succeeded (or none was needed),
// 503 with the store's error while the writer retries a batch.
func (w *Writer) readyz(rw http.ResponseWriter, _ *http.Request) {
	batches, assigned, err := w.w.Stats()
	body := map[string]any{"batches": batches, "partitions": assigned, "lag": w.w.Monitor().Lag()}
	status := 200
	if err != nil {
		status, body["error"] = 503, err.Error()
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(body)
}

// drained measures the group's lag now: 200 when every record of the
// topic is in the store (offsets committed), else 503 with the lag. A
// benchmark or an audit waits for it before reading the store.
func (w *Writer) drained(rw http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	mon := w.w.Monitor()
	status, body := 200, map[string]any{}
	if err := mon.Measure(ctx); err != nil {
		status, body["error"] = 503, err.Error()
	} else if lag := mon.Lag(); lag > 0 {
		status = 503
		body["lag"] = lag
	} else {
		body["lag"] = 0
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(body)
}

func (w *Writer) beatLoop() {
	defer close(w.beat)
	n, ok := w.store.(kettle.Nodes)
	if !ok {
		return
	}
	id, every := uuid.New(), 5*time.Second
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), every)
		if _, err := n.Beat(ctx, id, "writer", every); err != nil {
			w.log.Debug("could not tell the store this writer is alive", "err", err)
		}
		cancel()
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
	}
}

// Addr is the metrics listener's address.
func (w *Writer) Addr() string { return w.ln.Addr().String() }

// URL is the base URL of /metrics, /healthz, /readyz.
func (w *Writer) URL() string { return "http://" + w.Addr() }

// Log is the Kafka writer (for tests).
func (w *Writer) Log() *kafka.Writer { return w.w }

// Store is the store it writes.
func (w *Writer) Store() kettle.Store { return w.store }

// Done reports a serve error.
func (w *Writer) Done() <-chan error { return w.done }

func (w *Writer) closeWriter() {
	close(w.stop)
	<-w.beat
	w.w.Close()
	w.store.Close()
}

// Close stops consuming (the batch under way commits first), leaves the
// group, and closes the store.
func (w *Writer) Close() error {
	w.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		w.err = w.http.Shutdown(ctx)
		w.closeWriter()
		w.log.Info("kettle serve --role writer stopped")
	})
	return w.err
}

func (s *Server) closeLog() {
	if s.producer != nil {
		s.producer.Close()
	}
}

// DB is the store's DSN with any password hidden.
func (w *Writer) DB() string { return redact.DSN(w.cfg.DB) }
