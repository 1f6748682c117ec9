// Package server assembles kettle serve: the store, the fleet service, the
// HTTP API with its limits, and orderly shutdown. Tests and `kettle demo`
// start exactly what a user starts, on :0 with a temp data dir.
package server

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/durable"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
	"github.com/kettlefleet/kettlefleet/internal/redact"
	"github.com/kettlefleet/kettlefleet/internal/tlscert"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/web"
)

// The fleet service is every service the adapters use.
var (
	_ httpapi.Fleet    = (*fleet.Service)(nil)
	_ mqttapi.Fleet    = (*fleet.Service)(nil)
	_ mqttapi.Consumed = (*fleet.Service)(nil)
)

// Server is a running kettle serve.
type Server struct {
	cfg     Config
	log     *slog.Logger
	store   kettle.Store
	svc     *fleet.Service
	api     *httpapi.API
	web     *web.Web
	metrics *metrics.Server
	mqtt    *mqttapi.Broker
	mqttc   *mqttapi.Consumer
	// producer is the readings log's (Config.Log), nil without
	producer *kafka.Producer
	http     *http.Server
	ops      *http.Server // --metrics-addr: the operators' listener (nil: none)
	opsAddr  string
	ln       *limitListener
	tls      *tlscert.Reloader
	// handshakeErrors counts failed TLS handshakes (HTTP and MQTT): a
	// counter, not a log line each, since port scanners, health checks that
	// only open a TCP connection, and clients that distrust the certificate
	// all make them.
	handshakeErrors atomic.Int64
	admit           *admission
	opToken         string
	secret          []byte
	// uses of the previous operator token and device secret (rotation)
	previousOperator, previousDevice atomic.Int64
	previousLog                      logthin.Limiter
	// devices whose token of the previous secret was used, and when last
	// (unix ns); swept of those silent for retiredWindow on each count
	retiredMu      sync.Mutex
	retiredDevices map[kettle.DeviceID]int64
	tokFile        string
	secFile        string
	serveErr       chan error
	once           sync.Once
	draining       atomic.Bool // Close began: /readyz is 503
	closeErr       error
}

// Start opens the store, loads the caches, and starts serving. It returns
// once the listener is bound. On an error, what it started is stopped
// again, in the reverse order (undo), as Close stops it.
func Start(ctx context.Context, cfg Config) (_ *Server, err error) {
	cfg.defaults()
	s := &Server{cfg: cfg, log: cfg.Logger, serveErr: make(chan error, 1)}
	var undo undoStack
	defer func() {
		if err != nil {
			undo.run()
		}
	}()
	if err := s.loadSecrets(); err != nil {
		return nil, err
	}
	reg := cfg.Metrics
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	s.metrics = metrics.New(reg)
	if s.store, err = OpenStore(ctx, cfg.DB, cfg.Store, s.log); err != nil {
		return nil, err
	}
	undo.push(func() { s.store.Close() })
	s.metrics.RegisterStore(s.store)
	registerPool(s.metrics, s.store)
	storeDefaults(cfg.DB, &cfg.Ingest)
	if err := s.startLog(ctx, &cfg, reg); err != nil {
		return nil, err
	}
	undo.push(s.closeLog)
	if s.svc, err = fleet.New(ctx, s.store, cfg.Ingest, s.log, cfg.Now, s.metrics.FleetHooks()); err != nil {
		return nil, err
	}
	undo.push(func() { s.svc.Close() })
	s.web = web.New(web.Config{SecureCookie: strings.HasPrefix(cfg.PublicURL, "https://"), OperatorToken: s.opToken, PreviousOperatorToken: cfg.PreviousOperatorToken, OnPreviousToken: func() { s.previousUsed("operator", uuid.Nil) }, Now: cfg.Now}, s.log)
	if err := s.loadTLS(&cfg); err != nil {
		return nil, err
	}
	s.admit = newAdmission(reg, cfg.Shed, cfg.ShedRetryAfter, s.svc.Config().RetryAfter,
		func() (int, int) { return s.svc.QueueLen(), s.svc.Config().QueueRows })
	if err := s.startMQTT(ctx, &cfg); err != nil {
		return nil, err
	}
	undo.push(s.closeMQTT)
	s.admit.start()
	undo.push(s.admit.close)
	s.mountAPI(cfg)
	if err := s.serveMetrics(cfg); err != nil {
		return nil, err
	}
	undo.push(s.closeMetrics)
	if err := s.serveHTTP(cfg); err != nil {
		return nil, err
	}
	s.log.Info("kettle serve started", "addr", s.Addr(), "tls", s.tls != nil, "mqtt_addr", s.MQTTAddr(), "mqtt_broker", cfg.MQTTBroker.BrokerURL, "db", redact.DSN(cfg.DB), "devices", s.svc.DeviceCount(),
		"max_conns", cfg.MaxConns, "shed_latency", cfg.Shed.Latency.String(), "shed_policy", fmt.Sprintf("%+v", s.admit.policy), "ingest_queue", s.svc.Config().QueueRows, "batch_rows", s.svc.Config().BatchRows,
		"device_rate", s.svc.Config().DeviceRate, "login_rate", s.svc.Config().LoginRate, "login_rate_per_source", s.svc.Config().LoginSourceRate, "max_devices", s.svc.Config().MaxDevices, "prune_unreported", s.svc.Config().PruneUnreported.String(),
		"operator_token_file", s.tokFile, "secret_file", s.secFile, "log", cfg.Log.URL)
	return s, nil
}

// undoStack is Start's one cleanup path: what it started, stopped in the
// reverse order.
type undoStack []func()

func (u *undoStack) push(f func()) { *u = append(*u, f) }

func (u undoStack) run() {
	for i := len(u) - 1; i >= 0; i-- {
		u[i]()
	}
}

// loadSecrets reads or generates the operator token and the device secret,
// and checks the ones being retired against them.
func (s *Server) loadSecrets() error {
	cfg := s.cfg
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return fmt.Errorf("create data dir %s: %w", cfg.DataDir, err)
	}
	var err error
	s.opToken, s.tokFile, err = secretValue(cfg.OperatorToken, filepath.Join(cfg.DataDir, "operator-token"))
	if err != nil {
		return err
	}
	sec, secFile, err := secretValue(cfg.Secret, filepath.Join(cfg.DataDir, "secret"))
	if err != nil {
		return err
	}
	s.secret, s.secFile = []byte(sec), secFile
	if err := errors.Join(credentialErrs(s.opToken, cfg.PreviousOperatorToken, sec, cfg.PreviousSecret)...); err != nil {
		return err
	}
	s.previousLog.Every = time.Minute
	if cfg.PreviousOperatorToken != "" {
		s.log.Info("operator token rotation: the previous token (--operator-token-previous) is accepted beside the one in force; each use is counted in kettle_previous_credentials_used_total{kind=\"operator\"}")
	}
	if cfg.PreviousSecret != "" {
		s.log.Info("device secret rotation: device tokens of the previous secret (--secret-previous) are accepted beside the new secret's; each use is counted in kettle_previous_credentials_used_total{kind=\"device\"}")
	}
	return nil
}

// loadTLS loads --tls-cert and --tls-key, for HTTP and the MQTT listener.
func (s *Server) loadTLS(cfg *Config) error {
	if cfg.TLSCert == "" && cfg.TLSKey == "" {
		return nil
	}
	var err error
	if s.tls, err = tlscert.Load(cfg.TLSCert, cfg.TLSKey, s.log, cfg.Now); err != nil {
		return err
	}
	s.metrics.RegisterTLS(s.tls, s.handshakeErrors.Load)
	cfg.MQTT.TLS = s.tls.Config()
	cfg.MQTT.TLSHandshakeFailed = func() { s.handshakeErrors.Add(1) }
	return nil
}

// startMQTT starts the embedded MQTT listener and the external-broker
// consumer, each if configured; on an error neither runs.
func (s *Server) startMQTT(ctx context.Context, cfg *Config) (err error) {
	if cfg.MQTT.Addr != "" {
		cfg.MQTT.Shedding = s.admit.shedding.Load // new kettles are refused 0x89 while ingest is shed
		if cfg.MQTT.MaxConns <= 0 {
			// The open-file limit is one budget: MQTT and HTTP share it.
			cfg.MQTT.MaxConns = cfg.MaxConns / 2
			cfg.MaxConns -= cfg.MQTT.MaxConns
		}
		cfg.MQTT.PreviousSecret, cfg.MQTT.OnPreviousCredential = []byte(cfg.PreviousSecret), s.previousUsed
		cfg.MQTT.TrustedProxies = cfg.TrustedProxies
		if s.mqtt, err = mqttapi.Start(ctx, cfg.MQTT, s.svc, s.secret, s.log); err != nil {
			return fmt.Errorf("mqtt listener on %s: %w", cfg.MQTT.Addr, err)
		}
		c := s.mqtt.Counters()
		s.metrics.RegisterMQTT(func() metrics.MQTTStats { return metrics.MQTTStats(c.Snapshot()) })
	}
	if cfg.MQTTBroker.BrokerURL == "" {
		return nil
	}
	if s.mqttc, err = mqttapi.Consume(ctx, cfg.MQTTBroker, s.svc, s.secret, s.log); err != nil {
		s.closeMQTT()
		return fmt.Errorf("mqtt broker %s: %w", cfg.MQTTBroker.BrokerURL, err)
	}
	if s.mqtt == nil {
		c := s.mqttc.Counters()
		s.metrics.RegisterMQTT(func() metrics.MQTTStats { return metrics.MQTTStats(c.Snapshot()) })
	}
	return nil
}

// mountAPI builds the HTTP API, the dashboard and /metrics on it.
func (s *Server) mountAPI(cfg Config) {
	s.api = httpapi.New(s.svc, httpapi.Config{OperatorToken: s.opToken, Secret: s.secret,
		PreviousOperatorToken: cfg.PreviousOperatorToken, PreviousSecret: []byte(cfg.PreviousSecret), OnPreviousCredential: s.previousUsed,
		OperatorSession: s.web.IsOperator, AdmitIngest: s.admitIngest, PollMaxAge: s.admit.pollMaxAge}, s.log)
	s.web.Mount(s.api)
	s.metrics.RegisterFleet(s.svc)
	s.metrics.RegisterRotation(cfg.PreviousOperatorToken != "", cfg.PreviousSecret != "", s.previousOperator.Load, s.previousDevice.Load, s.devicesOnPreviousSecret)
	if cfg.MetricsAddr == "" {
		s.api.HandleRoute("GET /metrics", s.metrics.Handler())
	}
}

// serveMetrics serves /metrics on --metrics-addr, the operators' listener,
// when one is set.
func (s *Server) serveMetrics(cfg Config) error {
	if cfg.MetricsAddr == "" {
		return nil
	}
	l, err := net.Listen("tcp", cfg.MetricsAddr)
	if err != nil {
		return fmt.Errorf("--metrics-addr %s: %w", cfg.MetricsAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", s.metrics.Handler())
	s.ops = &http.Server{Handler: mux, ReadHeaderTimeout: cfg.ReadHeaderTimeout, ReadTimeout: cfg.ReadTimeout, WriteTimeout: cfg.WriteTimeout,
		ErrorLog: log.New(httpErrorLog{s.log, &s.handshakeErrors}, "", 0)}
	s.opsAddr = l.Addr().String()
	go s.ops.Serve(l)
	return nil
}

// MetricsURL is where /metrics is served: the operators' listener
// (--metrics-addr) if set, else the API's.
func (s *Server) MetricsURL() string {
	if s.ops != nil {
		return "http://" + s.opsAddr + "/metrics"
	}
	return s.URL() + "/metrics"
}

// serveHTTP binds cfg.Addr and serves the API on it.
func (s *Server) serveHTTP(cfg Config) error {
	l, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w (is another kettle serve running? choose --addr)", cfg.Addr, err)
	}
	s.ln = newLimitListener(l, cfg.MaxConns)
	s.metrics.RegisterConns(s.ln)
	var ln net.Listener = s.ln
	if s.tls != nil {
		s.ln.tls = s.tls.Config("http/1.1")
		ln = tls.NewListener(s.ln, s.ln.tls)
	}
	s.http = &http.Server{
		Handler:           cfg.TrustedProxies.forwarded(s.metrics.Middleware(accessLog(s.notReadyWhileDraining(s.admit.count(s.api)), s.log, cfg.AccessLogSample, time.Now))),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      cfg.WriteTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    16 << 10,
		ConnContext:       withConn,
		ErrorLog:          log.New(httpErrorLog{s.log, &s.handshakeErrors}, "", 0),
	}
	go func() { s.serveErr <- s.http.Serve(ln) }()
	return nil
}

// httpErrorLog is net/http's ErrorLog: its lines at warn, except failed TLS
// handshakes, which are counted (kettle_tls_handshake_errors_total) and
// logged at debug.
type httpErrorLog struct {
	log        *slog.Logger
	handshakes *atomic.Int64
}

func (e httpErrorLog) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if strings.HasPrefix(msg, "http: TLS handshake error") {
		e.handshakes.Add(1)
		e.log.Debug(msg)
	} else {
		e.log.Warn(msg)
	}
	return len(p), nil
}

// admitIngest is httpapi's AdmitIngest: the admission's verdict (shed or
// not) and, for an admitted upload, its connection's background read held
// until it is answered (trackedConn.Read).
func (s *Server) admitIngest(r *http.Request) (release func(), err error) {
	if err := s.admit.admit(r); err != nil {
		return nil, err
	}
	return holdReads(r), nil
}

// Addr is the bound listen address.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is the base URL of the HTTP API (https:// with TLS).
func (s *Server) URL() string {
	if s.tls != nil {
		return "https://" + s.Addr()
	}
	return "http://" + s.Addr()
}

// previousUsed counts a use of a credential being retired (kind
// "operator" or "device") and logs it, at most once a minute, naming the
// device: the operator removes --operator-token-previous or
// --secret-previous once these stop.
func (s *Server) previousUsed(kind string, device kettle.DeviceID) {
	now := time.Now()
	if kind == "operator" {
		s.previousOperator.Add(1)
	} else {
		s.previousDevice.Add(1)
		s.retiredMu.Lock()
		if s.retiredDevices == nil {
			s.retiredDevices = make(map[kettle.DeviceID]int64)
		}
		s.retiredDevices[device] = now.UnixNano()
		s.retiredMu.Unlock()
	}
	if ok, skipped := s.previousLog.Allow(now); ok {
		args := []any{"kind", kind, "uses_not_logged_since_last_line", skipped}
		if kind == "device" {
			args = append(args, "device", device, "devices_on_previous_secret", s.devicesOnPreviousSecret())
		}
		s.log.Warn("a credential being retired was used (--operator-token-previous, --secret-previous): move this client to the new one", args...)
	}
}

// retiredWindow is how recently a device must have used a token of the
// previous secret to count as still on it: a kettle polls every 30 s.
const retiredWindow = 10 * time.Minute

// devicesOnPreviousSecret counts the devices that used a token of
// --secret-previous in the last retiredWindow, and forgets the others.
// Bounded by the fleet: an entry needs a token the old secret made.
func (s *Server) devicesOnPreviousSecret() int {
	cut := time.Now().Add(-retiredWindow).UnixNano()
	s.retiredMu.Lock()
	defer s.retiredMu.Unlock()
	for id, at := range s.retiredDevices {
		if at < cut {
			delete(s.retiredDevices, id)
		}
	}
	return len(s.retiredDevices)
}

// OperatorToken is the operator bearer token in force.
func (s *Server) OperatorToken() string { return s.opToken }

// Secret is the key device tokens are derived from.
func (s *Server) Secret() []byte { return s.secret }

// TokenFiles says where generated secrets are kept ("" when given by flag).
func (s *Server) TokenFiles() (operatorToken, secret string) { return s.tokFile, s.secFile }

// Service is the fleet service (for tests and embedding).
func (s *Server) Service() *fleet.Service { return s.svc }

// Metrics is the server's metrics (for tests and embedding).
func (s *Server) Metrics() *metrics.Server { return s.metrics }

// Store is the store in use.
func (s *Server) Store() kettle.Store { return s.store }

// Routes lists the API's route patterns.
func (s *Server) Routes() []string { return s.api.Routes() }

// Handle mounts an extra handler on the API mux.
func (s *Server) Handle(pattern string, h http.Handler) { s.api.Handle(pattern, h) }

// closeMetrics stops the operators' listener, if there is one.
func (s *Server) closeMetrics() {
	if s.ops != nil {
		s.ops.Close()
	}
}

// Done reports a serve error (nil after Close).
func (s *Server) Done() <-chan error { return s.serveErr }

// Close stops accepting connections, waits for in-flight requests (their
// readings commit first), drains the ingest queue, and closes the store.
func (s *Server) Close() error {
	s.once.Do(func() {
		s.draining.Store(true)
		if d := s.cfg.DrainDelay; d > 0 {
			s.log.Info("draining: /readyz answers 503, serving on until the balancer has taken this node out", "drain_delay", d.String())
			time.Sleep(d)
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
		defer cancel()
		s.log.Info("shutting down: no new connections, draining in-flight requests and the ingest queue")
		err := s.http.Shutdown(ctx)
		s.closeMetrics()
		s.admit.close()
		s.closeMQTT() // before the queue drains: readings handed to ingest get their PUBACK
		s.svc.Close()
		s.closeLog()
		stored, dups := s.svc.Counters()
		if cerr := s.store.Close(); err == nil {
			err = cerr
		}
		s.closeErr = err
		s.log.Info("kettle serve stopped", "stored", stored, "duplicates", dups, "err", errString(err))
	})
	return s.closeErr
}

// notReadyWhileDraining answers GET /readyz 503 once Close has begun, so
// that a balancer stops sending requests here while in-flight ones finish.
func (s *Server) notReadyWhileDraining(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.draining.Load() && r.URL.Path == "/readyz" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"status":"draining"}`+"\n")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) closeMQTT() {
	if s.mqtt != nil {
		s.mqtt.Close()
	}
	if s.mqttc != nil {
		s.mqttc.Close()
	}
}

// MQTTAddr is the embedded MQTT listener's address ("" when off).
func (s *Server) MQTTAddr() string {
	if s.mqtt == nil {
		return ""
	}
	return s.mqtt.Addr()
}

// MQTTCounters are the embedded listener's counters (nil when off).
func (s *Server) MQTTCounters() *mqttapi.Counters {
	if s.mqtt == nil {
		return nil
	}
	return s.mqtt.Counters()
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// secretValue returns v if set, else the content of file, generating a
// random one there (0600, written whole or not at all) at first start. A
// file that exists but is empty or unreadable stops the start: replacing
// it would invalidate every token derived from the secret in the field.
func secretValue(v, file string) (string, string, error) {
	if v != "" {
		return v, "", nil
	}
	for {
		b, err := os.ReadFile(file)
		if err == nil {
			if t := strings.TrimSpace(string(b)); t != "" {
				return t, file, nil
			}
			return "", "", fmt.Errorf("%s is empty: restore it from a backup (every token made from it depends on it), or remove it to generate a new one", file)
		}
		if !errors.Is(err, os.ErrNotExist) {
			return "", "", fmt.Errorf("read %s: %w (fix its permissions; a new secret would invalidate every token made from the old one)", file, err)
		}
		buf := make([]byte, 32)
		if _, err := rand.Read(buf); err != nil {
			return "", "", err
		}
		t := hex.EncodeToString(buf)
		err = durable.CreateSecret(file, []byte(t+"\n"))
		if err == nil {
			return t, file, nil
		}
		if !errors.Is(err, fs.ErrExist) {
			return "", "", fmt.Errorf("write %s: %w", file, err)
		}
		// Another node sharing the data directory wrote it first: read theirs.
	}
}

// ReadSecret reads a generated secret file of a data dir (for kettle token).
func ReadSecret(dataDir, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, name))
	if err != nil {
		return "", fmt.Errorf("read %s (start kettle serve once with this --data-dir, or pass the value): %w", filepath.Join(dataDir, name), err)
	}
	return strings.TrimSpace(string(b)), nil
}
