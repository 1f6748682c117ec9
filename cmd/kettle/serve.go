package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// mqttGCPercent is --gc-percent's default on a node with an MQTT listener:
// the collector's headroom is a multiple of everything live, connections'
// goroutine stacks included, and at a kettle's cadence such a node
// allocates slowly, so collecting at 100 costs little CPU and saves most
// of the memory per connection (docs/operations.md, MQTT at scale).
const mqttGCPercent = 100

// flagGiven reports whether name was set on the command line or from its
// environment twin.
func flagGiven(fs *flag.FlagSet, name string) bool {
	_, given := os.LookupEnv(envName(name))
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

func init() {
	register("serve", "run the backend: device API, commands, statistics", runServe)
}

const serveDoc = `
Runs the kettlefleet backend. Kettles post measurements and poll commands over
the case-study protocol (POST /login, POST /measurement, GET /command) or the
v1 API (/v1/…, bearer tokens); operators read statistics and set overrides.
The API is described at GET /openapi.json.

Every reading is validated, queued (bounded: a full queue answers 503 with
Retry-After), committed in a batch transaction together with the latest state
and statistics rollups, and only then acknowledged. Command polls are answered
from memory. Under overload uploads are refused before their body is read:
when the queue is full, or, if --shed-latency is set, when the CPU is saturated (then with a long Retry-After, so kettles
send their readings later in one request), and polls keep being answered
(while the CPU is saturated, with Cache-Control max-age: poll again later).
SIGTERM/SIGINT: stop accepting, drain the queue, commit, exit 0 (behind a
load balancer, --drain-delay first answers /readyz 503 while serving on).

High availability: --db may name several hosts
(postgres://h1,h2,h3/kettle?target_session_attrs=read-write): the node
connects to whichever is the writable primary and follows it through a
failover; while none is, uploads get 503 + Retry-After and polls answer
from memory. --db-read sends reads that tolerate lag to a standby. See
docs/operations.md, High availability.

Retention: by default every reading is kept. With --retention 90d, uploads
older than 90 days (device time) are refused, and at start and every
--expire-every the whole UTC days older than that are removed from the
store together with their share of the statistics; a kettle's latest state
stays.

Registrations that never report (a flood of POST /login): with
--prune-unreported 7d, at start and every --expire-every the devices
registered more than 7 days ago that never stored a reading are removed,
as POST /v1/devices/prune does; by default only when an operator asks.

Secrets: when --operator-token or --secret is empty, a random value is
generated at first start and kept in --data-dir (files operator-token and
secret, mode 0600); the log says where. To rotate one without cutting
clients off, restart every node with the new value and the old one as
--operator-token-previous or --secret-previous (both accepted, each use of
the old counted in kettle_previous_credentials_used_total and logged), move
clients and kettles over (kettle token --secret NEW), then restart without
the old once the counter stops rising.

TLS: with --tls-cert and --tls-key (PEM files) the HTTP API and the embedded
MQTT listener speak TLS 1.2+ only (HTTP/1.1; a plain request to the port is
answered 400). A renewed pair written over the files (certbot, cert-manager)
is picked up within a second by the next handshake, without a restart; a
pair that does not load leaves the old one in force and is logged.
kettle_tls_certificate_expiry_timestamp_seconds feeds the alert
KettleTLSCertificateExpiring.`

// logger builds the process logger from --log-format and --log-level.
func logger(format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(stderrSink(), opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(stderrSink(), opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want json or text", format)
}

func runServe(ctx context.Context, args []string) error {
	fs := newFlagSet("serve", "[flags]", serveDoc)
	var cfg server.Config
	fs.StringVar(&cfg.Addr, "addr", "127.0.0.1:8080", "HTTP listen address")
	fs.StringVar(&cfg.DB, "db", "sqlite:kettle-data/kettle.db", "store: sqlite:PATH (embedded) or postgres://user@host:port/db")
	fs.StringVar(&cfg.DataDir, "data-dir", "kettle-data", "directory for generated secrets (operator-token, secret)")
	fs.StringVar(&cfg.OperatorToken, "operator-token", "", "bearer token for operator endpoints (empty: generated and kept in --data-dir)")
	fs.StringVar(&cfg.Secret, "secret", "", "key device tokens are derived from (empty: generated and kept in --data-dir)")
	fs.StringVar(&cfg.PreviousOperatorToken, "operator-token-previous", "", "rotation: the operator token being retired, accepted beside --operator-token until clients have moved (each use counted and logged); empty: none")
	fs.StringVar(&cfg.PreviousSecret, "secret-previous", "", "rotation: the device secret being retired; device tokens (HTTP, MQTT passwords) made with it are accepted beside --secret's until kettles are re-provisioned (each use counted, the device logged); empty: none")
	fs.IntVar(&cfg.Ingest.QueueRows, "ingest-queue", 65536, "readings that may wait for a commit; beyond it ingest answers 503 + Retry-After")
	fs.IntVar(&cfg.Ingest.BatchRows, "batch-rows", 0, "most readings committed in one transaction (0: 2000 for SQLite, 16000 for PostgreSQL)")
	fs.DurationVar(&cfg.Ingest.BatchWait, "batch-wait", 0, "wait this long for more readings before committing a partial batch (0: commit at once; batches still grow under load)")
	fs.IntVar(&cfg.Ingest.Writers, "writers", 0, "concurrent batch transactions (0: 1 for SQLite, which has one writer; 2 for PostgreSQL)")
	fs.DurationVar(&cfg.Ingest.PollInterval, "poll-interval", 30*time.Second, "poll_after_s told to kettles when nothing changes sooner")
	fs.DurationVar(&cfg.Ingest.Refresh, "cache-refresh", 0, "for several nodes on one PostgreSQL: say this often that this node is alive, and reload the device cache from the store while another process (a node, kettle seed) writes it (0: 5s on PostgreSQL, never on SQLite)")
	retentionVar(fs, &cfg.Ingest.Retention, "keep readings this long by device time, e.g. 90d or 2160h (0: keep everything, the default). Older uploads are refused (400 naming the time field), and every --expire-every the UTC days wholly older are removed from the store with their share of the statistics (a kettle's latest state stays); PostgreSQL drops their day partitions")
	fs.DurationVar(&cfg.Ingest.ExpireEvery, "expire-every", time.Hour, "with --retention or --prune-unreported: how often to look for months to remove and devices to prune (the first look is at start)")
	pruneAgeVar(fs, &cfg.Ingest.PruneUnreported, "prune-unreported", fmt.Sprintf("at start and every --expire-every, remove the devices registered longer ago than this that never stored a reading (not revoked, no override), as POST /v1/devices/prune does, e.g. 7d (at least %s; a pruned case-study kettle must POST /login again: choose longer than any kettle takes from its login to its first reading). 0: only when asked (the default)", fleet.MinPruneAge), true)
	fs.Float64Var(&cfg.Ingest.DeviceRate, "device-rate", 0, "requests a second one kettle may make (uploads and polls; a kettle sends 2 in 30 s), e.g. 1, or 0.2 for one every 5 s; HTTP over it is answered 429 + Retry-After, MQTT over it is read more slowly (nothing refused). 0: no limit (the default)")
	fs.IntVar(&cfg.Ingest.DeviceBurst, "device-burst", 10, "with --device-rate: requests a kettle may make at once before its rate applies (a reconnecting kettle's backlog, a poll right after an upload)")
	fs.Float64Var(&cfg.Ingest.LoginRate, "login-rate", 100, "case-study registrations (POST /login, which anyone may call) a second over all clients; over it the request is held up to 1 s, then answered 429 + Retry-After. 0: no limit")
	fs.IntVar(&cfg.Ingest.LoginBurst, "login-burst", 20000, "with --login-rate: registrations at once before the rate applies (a whole fleet logging in again after an outage)")
	fs.Float64Var(&cfg.Ingest.LoginSourceRate, "login-rate-per-source", 0, "case-study registrations (POST /login) a second from one client address (an IPv4 address, an IPv6 /64), checked before --login-rate: one client looping on POST /login is refused on its own instead of using up the rate all clients share; held up to 1 s, then 429 + Retry-After. Kettles behind one NAT share an address: set --login-burst-per-source above the most that log in at once through one. 0: no limit (the default)")
	fs.IntVar(&cfg.Ingest.LoginSourceBurst, "login-burst-per-source", 100, "with --login-rate-per-source: registrations at once from one address before its rate applies")
	fs.IntVar(&cfg.Ingest.MaxDevices, "max-devices", 1_000_000, "devices this server registers at most through POST /login and POST /v1/devices (each is a slot in memory and a row, freed only by pruning those that never report: POST /v1/devices/prune, kettle prune); past it they are refused 403. Kettles with v1 tokens register by uploading and are not refused. 0: no bound")
	fs.StringVar(&cfg.TLSCert, "tls-cert", "", "PEM certificate (chain) file: with --tls-key, serve HTTP and MQTT over TLS only (empty: plain TCP)")
	fs.StringVar(&cfg.TLSKey, "tls-key", "", "PEM private key file of --tls-cert")
	fs.IntVar(&cfg.MaxConns, "max-conns", 0, "open HTTP connections allowed; the excess is answered 503 and closed (0: open-file limit − 1024)")
	fs.DurationVar(&cfg.Shed.Latency, "shed-latency", 0, "0: off (the default). Else: while goroutines wait longer than this for a CPU (p99 over --shed-windows windows of --shed-window in a row, --shed-runnable or more waiting, uploads ≥ --shed-min-ingest-share of requests), ingest is answered 503 + Retry-After before its body is read and v1 command polls get Cache-Control max-age (about --shed-retry-after) instead of no-cache, so polls stay fast at the cost of acknowledged readings and of overrides reaching kettles later; e.g. 20ms")
	fs.DurationVar(&cfg.Shed.Window, "shed-window", server.DefaultShedPolicy.Window, "with --shed-latency: how often the scheduling latency is evaluated")
	fs.IntVar(&cfg.Shed.Windows, "shed-windows", server.DefaultShedPolicy.Windows, "with --shed-latency: saturated windows in a row before shedding starts (a moment's stall of the whole machine is not overload); it stops after --shed-hold without one")
	fs.DurationVar(&cfg.Shed.Hold, "shed-hold", server.DefaultShedPolicy.Hold, "with --shed-latency: once shedding, keep shedding until no window has been saturated for this long (0: stop at the first window that is not saturated; then shedding flaps at 10× load)")
	fs.IntVar(&cfg.Shed.MinRunnable, "shed-runnable", server.DefaultShedPolicy.MinRunnable, "with --shed-latency: a window is saturated only if at least this many goroutines wait for a CPU at its end (fewer: other processes take the CPU, shedding would not help)")
	fs.Float64Var(&cfg.Shed.MinIngestShare, "shed-min-ingest-share", server.DefaultShedPolicy.MinIngestShare, "with --shed-latency: shed only while uploads are at least this share of the requests (else refusing them would not relieve the CPU)")
	fs.DurationVar(&cfg.ShedRetryAfter, "shed-retry-after", 10*time.Second, "Retry-After told to ingest shed for CPU, and max-age of v1 command polls meanwhile (jittered ±50%); long enough that kettles batch their readings instead of retrying each second")
	fs.DurationVar(&cfg.ReadHeaderTimeout, "read-header-timeout", 5*time.Second, "time allowed to send request headers (slowloris bound)")
	fs.DurationVar(&cfg.ReadTimeout, "read-timeout", 15*time.Second, "time allowed to send a whole request")
	fs.DurationVar(&cfg.WriteTimeout, "write-timeout", 30*time.Second, "time allowed to write a response")
	fs.DurationVar(&cfg.IdleTimeout, "idle-timeout", 120*time.Second, "keep-alive connections idle longer are closed (keep it above the kettles' interval)")
	fs.DurationVar(&cfg.DrainDelay, "drain-delay", 0, "behind a load balancer: on SIGTERM, answer /readyz 503 and keep serving this long before closing the listener, so the balancer's health check takes the node out first (above its check interval × fall, e.g. 2s for HAProxy's inter 500ms fall 2 with room); 0: close at once")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM, how long to wait for in-flight requests and the queue")
	fs.DurationVar(&cfg.Ingest.StoreTimeout, "store-timeout", fleet.DefaultStoreTimeout, "deadline of every store call (a batch commit, a registration, an override, a read): an upload whose commit does not finish in time is answered 503 + Retry-After, within twice this even when the database is unreachable (packets dropped), while polls keep being answered from memory")
	fs.IntVar(&cfg.Store.PoolSize, "pg-pool", 8, "PostgreSQL: connections in the pool (the server opens one more, outside it, for the database server's statistics on /metrics)")
	fs.DurationVar(&cfg.Store.StatementTimeout, "pg-statement-timeout", 10*time.Second, "PostgreSQL: statement_timeout of every connection")
	fs.StringVar(&cfg.Store.ReadDSN, "db-read", "", "PostgreSQL: a standby for reads that tolerate lag (device lists, a device's history, the dashboard's charts), e.g. postgres://kettle@h2,h3/kettle?target_session_attrs=prefer-standby; writes, statistics and the node's caches stay on --db. Empty: every read on --db")
	fs.DurationVar(&cfg.Store.MaxReadLag, "max-read-lag", 5*time.Second, "with --db-read: while the replica's replay lag (kettle_pg_read_replica_lag_seconds, measured every second) is over this or unknown, its reads go to the primary")
	fs.StringVar(&cfg.MQTT.Addr, "mqtt-addr", "", "embedded MQTT listener (3.1.1 and 5), e.g. 127.0.0.1:1883; empty: off")
	fs.StringVar(&cfg.MQTT.Engine, "mqtt-engine", mqttapi.EngineDevice, "embedded MQTT listener's engine: device (kettles only; a few KiB per connection, no goroutine while a kettle is quiet on Linux over plain TCP) or mochi (mochi-mqtt's general broker with kettlefleet's hooks; two goroutines and tens of KiB per connection); see docs/operations.md")
	fs.IntVar(&cfg.MQTT.MaxConns, "mqtt-max-conns", 0, "MQTT connections allowed (0: half of the open-file budget, the other half stays with HTTP)")
	fs.DurationVar(&cfg.MQTT.StackTrim, "mqtt-stack-trim", 0, "mochi engine: while kettles are connected, collect garbage this often so that each connection's stack shrinks back after its last packet (MQTT memory per connection against GC CPU; see docs/operations.md), e.g. 2s; 0: only when the heap grows")
	fs.StringVar(&cfg.MQTT.ServerReference, "mqtt-server-reference", "", "where kettles refused for capacity (over --mqtt-max-conns, or while shedding) are sent: MQTT 5 gets CONNACK 0x9C use another server with this Server Reference, e.g. mqtt2.example.net:1883; empty: 0x97 quota exceeded over the cap, 0x89 server busy while shedding (MQTT 3.1.1: 0x03 either way)")
	fs.DurationVar(&cfg.MQTT.WriteTimeout, "mqtt-write-timeout", 10*time.Second, "a write to a kettle that takes longer closes its connection (a kettle that stops reading cannot stall others)")
	fs.StringVar(&cfg.MQTTBroker.BrokerURL, "mqtt-broker", "", "consume from an external MQTT 5 broker instead, e.g. tcp://127.0.0.1:1883 or tls://broker:8883 (shared subscription $share/<mqtt-share>/kettles/+/measurements)")
	fs.StringVar(&cfg.MQTTBroker.CAFile, "mqtt-broker-ca", "", "PEM certificate(s) to trust for a TLS --mqtt-broker (tls://host:8883; empty: the system's roots)")
	fs.StringVar(&cfg.MQTTBroker.ClientID, "mqtt-client-id", "", "this node's client id at the external broker (unique and stable per node; empty: kettle-<hostname>)")
	fs.StringVar(&cfg.MQTTBroker.Share, "mqtt-share", "kettle", "shared-subscription group name: nodes in one group split the stream")
	fs.StringVar(&cfg.MQTTBroker.Username, "mqtt-username", "", "username at the external broker")
	fs.StringVar(&cfg.MQTTBroker.Password, "mqtt-password", "", "password at the external broker")
	fs.Float64Var(&cfg.AccessLogSample, "access-log-sample", 0.01, "fraction of successful requests written to the access log; every failed (status ≥ 400) or slow (≥ 1 s) request is written whatever it is (0 = no access log at all, 1 = every request; a line per request costs about a third of the acknowledged readings/s at 10,000+ req/s)")
	fs.StringVar(&cfg.PublicURL, "public-url", "", "the URL operators reach this node at through a balancer, e.g. https://kettle.example.net: with https the dashboard's session cookie is Secure even when the balancer terminates TLS and speaks HTTP to the node (empty: Secure only over --tls-cert)")
	fs.Func("trusted-proxies", "comma-separated CIDRs or addresses of balancers in front of this node (e.g. HAProxy with option forwardfor): from these peers only, X-Forwarded-For names the client, for per-source limits and the access log; a header from any other peer is ignored (empty: the peer is the client)", func(v string) (err error) {
		cfg.TrustedProxies, err = server.ParseTrustedProxies(v)
		return err
	})
	secretFileVars(fs, "operator-token", "secret", "operator-token-previous", "secret-previous", "mqtt-password")
	sample := fs.Bool("sample", false, "sample this process's CPU, memory, fds, the machine and /metrics every second while serving, written to <data-dir>/system.json at exit (kettle report RESULTS --system FILE)")
	debugAddr := fs.String("debug-addr", "", "serve Go's pprof profiles (/debug/pprof/) on this separate address, e.g. 127.0.0.1:6060; empty: off")
	gcPercent := fs.Int("gc-percent", 400, "Go garbage collector target (as GOGC): the heap may grow this many % over the live heap between collections; 400 trades memory for less CPU per request than Go's 100 (docs/performance.md); default 100 with --mqtt-addr, where the headroom would multiply every connected kettle's memory for little CPU saved; the GOGC environment variable, when set, wins")
	memLimitMB := fs.Int("memory-limit-mb", 2048, "soft limit of the Go heap in MiB (as GOMEMLIMIT): nearer it the collector runs more often whatever --gc-percent says (0: none); the GOMEMLIMIT environment variable, when set, wins")
	role := logFlags(fs, &cfg.Log)
	logFormat := fs.String("log-format", "json", "log format: json or text")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := errors.Join(cfg.Validate()...); err != nil {
		return err
	}
	if err := checkRole(*role, cfg.Log); err != nil {
		return err
	}
	log, err := logger(*logFormat, *logLevel)
	if err != nil {
		return err
	}
	cfg.Logger = log
	if os.Getenv("GOGC") == "" {
		gc := *gcPercent
		if cfg.MQTT.Addr != "" && !flagGiven(fs, "gc-percent") {
			gc = mqttGCPercent
		}
		debug.SetGCPercent(gc)
	}
	if os.Getenv("GOMEMLIMIT") == "" && *memLimitMB > 0 {
		debug.SetMemoryLimit(int64(*memLimitMB) << 20)
	}
	defer stderrSink().Flush() // last: after the deferred writers below logged
	if *debugAddr != "" {
		stop, err := serveDebug(*debugAddr, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if *role == server.RoleWriter {
		return runWriter(ctx, cfg, log)
	}
	srv, err := server.Start(ctx, cfg)
	if err != nil {
		return err
	}
	if *sample {
		smp, err := sysstat.Start(ctx, sysstat.Config{ServerPID: os.Getpid(), SimulatorPID: -1, MetricsURL: srv.URL() + "/metrics"})
		if err != nil {
			srv.Close()
			return fmt.Errorf("--sample: %w", err)
		}
		out := filepath.Join(cfg.DataDir, "system.json")
		defer func() {
			if err := smp.Close().WriteFile(out); err != nil {
				log.Error("write system samples", "file", out, "err", err)
			} else {
				log.Info("system samples written", "file", out)
			}
		}()
	}
	tok, sec := srv.TokenFiles()
	fmt.Fprintf(os.Stderr, "kettle serve listening on %s\n", srv.URL())
	if a := srv.MQTTAddr(); a != "" {
		over := ""
		if cfg.TLSCert != "" {
			over = " over TLS"
		}
		fmt.Fprintf(os.Stderr, "  MQTT%s on %s (username: device id, password: its token)\n", over, a)
	}
	if tok != "" {
		fmt.Fprintf(os.Stderr, "  operator token: %s (curl -H \"Authorization: Bearer $(cat %s)\" %s/v1/statistics)\n", tok, tok, srv.URL())
	}
	if sec != "" {
		fmt.Fprintf(os.Stderr, "  device-token secret: %s (kettle token --data-dir %s --device UUID)\n", sec, strings.TrimSuffix(cfg.DataDir, "/"))
	}
	stopping := notifyReady(ctx, "serving on "+srv.URL())
	select {
	case <-ctx.Done():
	case err := <-srv.Done():
		if err != nil {
			log.Error("serve failed", "err", err)
		}
	}
	stopping()
	return srv.Close()
}

// serveDebug serves pprof on its own listener, never on the API address.
func serveDebug(addr string, log *slog.Logger) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--debug-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	// The command line holds what was given as flags, secrets among them.
	mux.HandleFunc("/debug/pprof/cmdline", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not served: the command line may hold secrets", http.StatusNotFound)
	})
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(l)
	log.Info("pprof listening", "addr", l.Addr().String())
	return func() { srv.Close() }, nil
}
