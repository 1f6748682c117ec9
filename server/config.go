package server

import (
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// Config is kettle serve's configuration; cmd/kettle/serve.go maps flags
// and environment onto it. DefaultConfig holds every default, and serve's
// flags take theirs from it; a zero field takes its DefaultConfig value,
// except the ones whose zero is documented as meaning something else (off,
// none, derived from the open-file limit or from the store).
type Config struct {
	Addr          string // listen address, e.g. 127.0.0.1:8080 (":0" for any port)
	DB            string // sqlite:PATH or postgres://…
	DataDir       string // where generated secrets are kept
	OperatorToken string // empty: read or generate DataDir/operator-token
	Secret        string // empty: read or generate DataDir/secret
	// PreviousOperatorToken and PreviousSecret, when set, are the operator
	// token and the device secret being retired: accepted beside the ones
	// in force while clients and kettles move over, every use counted
	// (kettle_previous_credentials_used_total{kind}) and logged (thinned).
	PreviousOperatorToken string
	PreviousSecret        string

	Ingest fleet.Config

	// MaxConns caps open HTTP connections; the excess is answered 503 and
	// closed. 0: derived from the process's open-file limit.
	MaxConns int

	// TLSCert and TLSKey are PEM files (certificate chain, private key).
	// Both set: the HTTP API and the embedded MQTT listener speak TLS only,
	// and a renewed pair written over the files is picked up without a
	// restart (internal/tlscert). Both empty: plain TCP.
	TLSCert, TLSKey string

	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration
	ShutdownTimeout   time.Duration
	// DrainDelay is how long Close keeps serving with /readyz answering
	// 503 before it stops accepting, so a load balancer checking /readyz
	// takes the node out first and no request meets a closed port. 0: stop
	// accepting at once.
	DrainDelay time.Duration

	// Shed: while goroutines wait longer than Shed.Latency for a CPU (see
	// ShedPolicy), ingest is refused before its body is read, with a
	// Retry-After of about ShedRetryAfter. Shed.Latency 0: never shed on
	// CPU (the default: shedding trades acknowledged readings for poll
	// latency; bench/ingest.sh at 1,000 connections saw 384,282 of 458,001
	// uploads shed with it at 20 ms). Its other zero fields take
	// DefaultShedPolicy's values.
	Shed           ShedPolicy
	ShedRetryAfter time.Duration

	// MetricsAddr, when set, is the operators' listener: /metrics is served
	// there and not on Addr, which kettles (and, behind a balancer, anyone
	// reaching it) use (--metrics-addr). Empty: /metrics on Addr.
	MetricsAddr string
	// PublicURL is where operators reach this node through the balancer
	// (--public-url); https:// makes the dashboard's cookie Secure even
	// when the balancer speaks plain HTTP to the node.
	PublicURL string
	// TrustedProxies are the balancers whose X-Forwarded-For names the
	// client (--trusted-proxies); empty: the peer is the client.
	TrustedProxies TrustedProxies
	// AccessLogSample is the fraction of successful requests logged; failed
	// and slow ones are all logged (0 = no access log, 1 = all requests).
	AccessLogSample float64

	Store StoreOptions

	// MQTT is the embedded MQTT listener (MQTT.Addr empty: off).
	MQTT mqttapi.Config
	// MQTTBroker consumes from an external broker (BrokerURL empty: off).
	MQTTBroker mqttapi.ConsumerConfig

	// Log, with a URL, puts the readings log between this front and the
	// store (log.go); the writers run with StartWriter.
	Log LogConfig

	// Metrics is the registry /metrics serves; nil: a new one.
	Metrics *prometheus.Registry

	Logger *slog.Logger
	Now    func() time.Time // the clock; nil = time.Now
}

// DefaultConfig is kettle serve's configuration when no flag is given. Its
// Ingest is fleet.DefaultConfig but for BatchRows, Writers and Refresh,
// which depend on the store (0: storeDefaults); its MQTT listener is off
// (MQTT.Addr empty) and MQTT.MaxConns 0 takes half of the connection
// budget (Start).
func DefaultConfig() Config {
	ing := fleet.DefaultConfig()
	ing.BatchRows, ing.Writers, ing.Refresh = 0, 0, 0
	mq := mqttapi.DefaultConfig()
	mq.MaxConns = 0
	topic := kafka.DefaultTopicConfig()
	shed := DefaultShedPolicy
	shed.Latency = 0 // off: shedding trades acknowledged readings for poll latency
	return Config{
		Addr:              "127.0.0.1:8080",
		DB:                "sqlite:kettle-data/kettle.db",
		DataDir:           "kettle-data",
		Ingest:            ing,
		Shed:              shed,
		ShedRetryAfter:    10 * time.Second,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       15 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       120 * time.Second,
		ShutdownTimeout:   30 * time.Second,
		AccessLogSample:   0.01,
		Store:             StoreOptions{PoolSize: 8, StatementTimeout: 10 * time.Second, MaxReadLag: postgres.DefaultMaxReadLag},
		MQTT:              mq,
		MQTTBroker:        mqttapi.DefaultConsumerConfig(),
		Log: LogConfig{Partitions: topic.Partitions, Retention: topic.Retention, MaxInflight: kafka.DefaultMaxInflight,
			Timeout: kafka.DefaultTimeout, Group: kafka.DefaultGroup, MonitorEvery: kafka.DefaultMonitorEvery},
	}
}

// The ingest pipeline's defaults on PostgreSQL (storeDefaults). CPU, not
// commit latency (an fsync is ~65 µs here), bounds the ingest: a
// transaction has a fixed cost in PostgreSQL (statements, commit, and a
// COPY's set-up, ~1 µs a row at 2,000 rows), so fewer, larger transactions
// store more per CPU second. bench/pg-ab.sh, 2 writers of up to 8,000 rows
// against 4 of 2,000: batched uploads stored ×1.2–1.3 rows/s at −25–30%
// PostgreSQL CPU per row and lower latency, single readings ×1.1 req/s at
// −20% PostgreSQL CPU per request. bench/pg-ingest.sh with 64 uploading
// connections (32,000 readings in flight): PostgreSQL used 5.14 µs CPU a
// row with batches of up to 8,000, 4.40 with 16,000 (4.35 with 32,000), as
// little as the raw COPY ceiling. At idle nothing waits: a batch is
// whatever is queued when a writer is free; its memory is ~100 bytes a
// reading.
const (
	PGWriters   = 2
	PGBatchRows = 16000
	PGRefresh   = 5 * time.Second // other nodes may share the database
)

// storeDefaults fills the ingest fields that depend on the store: on
// PostgreSQL the PG* values above; on SQLite fleet.DefaultConfig's.
func storeDefaults(db string, c *fleet.Config) {
	if strings.HasPrefix(db, "sqlite:") {
		return
	}
	if c.Writers <= 0 {
		c.Writers = PGWriters
	}
	if c.BatchRows <= 0 {
		c.BatchRows = PGBatchRows
	}
	if c.Refresh == 0 {
		c.Refresh = PGRefresh
	}
}

// DefaultMaxConns is the connection cap derived from the open-file limit:
// the hard limit is raised to, minus a reserve for the store, logs and
// outgoing connections.
func DefaultMaxConns() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 1000
	}
	if rl.Cur < rl.Max {
		rl.Cur = rl.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
		_ = unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	}
	n := int(rl.Cur) - 1024
	if n < 64 {
		n = 64
	}
	return n
}

// defaults fills the zero fields that have no meaning of their own with
// DefaultConfig's values, and the process's: the logger, the clock, the
// connection cap from the open-file limit.
func (c *Config) defaults() {
	d := DefaultConfig()
	for _, f := range []struct{ v, def *string }{{&c.Addr, &d.Addr}, {&c.DB, &d.DB}, {&c.DataDir, &d.DataDir}} {
		if *f.v == "" {
			*f.v = *f.def
		}
	}
	for _, f := range []struct{ v, def *time.Duration }{
		{&c.ShedRetryAfter, &d.ShedRetryAfter}, {&c.ReadHeaderTimeout, &d.ReadHeaderTimeout}, {&c.ReadTimeout, &d.ReadTimeout},
		{&c.WriteTimeout, &d.WriteTimeout}, {&c.IdleTimeout, &d.IdleTimeout}, {&c.ShutdownTimeout, &d.ShutdownTimeout},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	if c.MaxConns <= 0 {
		c.MaxConns = DefaultMaxConns()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}
