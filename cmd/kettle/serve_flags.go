package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/server"
)

// serveOptions is what kettle serve's flags set: the server's Config, whose
// defaults they take from server.DefaultConfig (TestServeFlagDefaults), and
// the process's own settings. kettle demo starts its server through the
// same flags (demoServer).
type serveOptions struct {
	cfg        server.Config
	sample     bool
	debugAddr  string
	gcPercent  int
	memLimitMB int
	role       string
	logFormat  string
	logLevel   string
}

// newServeOptions registers kettle serve's flags on fs.
func newServeOptions(fs *flag.FlagSet) *serveOptions {
	o := &serveOptions{cfg: server.DefaultConfig()}
	o.httpFlags(fs)
	o.ingestFlags(fs)
	o.shedAndMQTTFlags(fs)
	o.processFlags(fs)
	secretFileVars(fs, "operator-token", "secret", "operator-token-previous", "secret-previous", "mqtt-password")
	return o
}

// httpFlags: where the server listens and stores, its secrets and its HTTP
// limits.
func (o *serveOptions) httpFlags(fs *flag.FlagSet) {
	c := &o.cfg
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address")
	fs.StringVar(&c.DB, "db", c.DB, "store: sqlite:PATH (embedded) or postgres://user@host:port/db")
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "directory for generated secrets (operator-token, secret)")
	fs.StringVar(&c.OperatorToken, "operator-token", c.OperatorToken, "bearer token for operator endpoints (empty: generated and kept in --data-dir)")
	fs.StringVar(&c.Secret, "secret", c.Secret, "key device tokens are derived from (empty: generated and kept in --data-dir)")
	fs.StringVar(&c.PreviousOperatorToken, "operator-token-previous", c.PreviousOperatorToken, "rotation: the operator token being retired, accepted beside --operator-token until clients have moved (each use counted and logged); empty: none")
	fs.StringVar(&c.PreviousSecret, "secret-previous", c.PreviousSecret, "rotation: the device secret being retired; device tokens (HTTP, MQTT passwords) made with it are accepted beside --secret's until kettles are re-provisioned (each use counted, the device logged); empty: none")
	fs.StringVar(&c.TLSCert, "tls-cert", c.TLSCert, "PEM certificate (chain) file: with --tls-key, serve HTTP and MQTT over TLS only (empty: plain TCP)")
	fs.StringVar(&c.TLSKey, "tls-key", c.TLSKey, "PEM private key file of --tls-cert")
	fs.IntVar(&c.MaxConns, "max-conns", c.MaxConns, "open HTTP connections allowed; the excess is answered 503 and closed (0: open-file limit − 1024)")
	fs.DurationVar(&c.ReadHeaderTimeout, "read-header-timeout", c.ReadHeaderTimeout, "time allowed to send request headers (slowloris bound)")
	fs.DurationVar(&c.ReadTimeout, "read-timeout", c.ReadTimeout, "time allowed to send a whole request")
	fs.DurationVar(&c.WriteTimeout, "write-timeout", c.WriteTimeout, "time allowed to write a response")
	fs.DurationVar(&c.IdleTimeout, "idle-timeout", c.IdleTimeout, "keep-alive connections idle longer are closed (keep it above the kettles' interval)")
	fs.DurationVar(&c.DrainDelay, "drain-delay", c.DrainDelay, "behind a load balancer: on SIGTERM, answer /readyz 503 and keep serving this long before closing the listener, so the balancer's health check takes the node out first (above its check interval × fall, e.g. 2s for HAProxy's inter 500ms fall 2 with room); 0: close at once")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "on SIGTERM, how long to wait for in-flight requests and the queue")
	fs.Float64Var(&c.AccessLogSample, "access-log-sample", c.AccessLogSample, "fraction of successful requests written to the access log; every failed (status ≥ 400) or slow (≥ 1 s) request is written whatever it is (0 = no access log at all, 1 = every request; a line per request costs about a third of the acknowledged readings/s at 10,000+ req/s)")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "the operators' listener, e.g. 10.0.0.5:9180: /metrics is served there and no longer on --addr, which kettles — and through a balancer anyone — reach (empty: /metrics on --addr)")
	fs.StringVar(&c.PublicURL, "public-url", c.PublicURL, "the URL operators reach this node at through a balancer, e.g. https://kettle.example.net: with https the dashboard's session cookie is Secure even when the balancer terminates TLS and speaks HTTP to the node (empty: Secure only over --tls-cert)")
	fs.Func("trusted-proxies", "comma-separated CIDRs or addresses of balancers in front of this node (e.g. HAProxy with option forwardfor, and send-proxy-v2 on its MQTT server lines): from these peers only, X-Forwarded-For names the client for HTTP, for per-source limits and the access log, and MQTT connections must begin with a PROXY protocol v2 header, which names the kettle in the MQTT listener's logs; X-Forwarded-For from any other peer is ignored, a PROXY header refused (empty: the peer is the client)", func(v string) (err error) {
		c.TrustedProxies, err = server.ParseTrustedProxies(v)
		return err
	})
}

// ingestFlags: the ingest pipeline, registration limits and the store.
func (o *serveOptions) ingestFlags(fs *flag.FlagSet) {
	c := &o.cfg
	fs.IntVar(&c.Ingest.QueueRows, "ingest-queue", c.Ingest.QueueRows, "readings that may wait for a commit; beyond it ingest answers 503 + Retry-After")
	fs.IntVar(&c.Ingest.BatchRows, "batch-rows", c.Ingest.BatchRows, fmt.Sprintf("most readings committed in one transaction (0: %d for SQLite, %d for PostgreSQL)", fleet.DefaultConfig().BatchRows, server.PGBatchRows))
	fs.DurationVar(&c.Ingest.BatchWait, "batch-wait", c.Ingest.BatchWait, "wait this long for more readings before committing a partial batch (0: commit at once; batches still grow under load)")
	fs.IntVar(&c.Ingest.Writers, "writers", c.Ingest.Writers, fmt.Sprintf("concurrent batch transactions (0: %d for SQLite, which has one writer; %d for PostgreSQL)", fleet.DefaultConfig().Writers, server.PGWriters))
	fs.DurationVar(&c.Ingest.PollInterval, "poll-interval", c.Ingest.PollInterval, "poll_after_s told to kettles when nothing changes sooner")
	fs.DurationVar(&c.Ingest.Refresh, "cache-refresh", c.Ingest.Refresh, fmt.Sprintf("for several nodes on one PostgreSQL: say this often that this node is alive, and reload the device cache from the store while another process (a node, kettle seed) writes it (0: %s on PostgreSQL, never on SQLite)", server.PGRefresh))
	retentionVar(fs, &c.Ingest.Retention, "keep readings this long by device time, e.g. 90d or 2160h (0: keep everything, the default). Older uploads are refused (400 naming the time field), and every --expire-every the UTC days wholly older are removed from the store with their share of the statistics (a kettle's latest state stays); PostgreSQL drops their day partitions")
	fs.DurationVar(&c.Ingest.ExpireEvery, "expire-every", c.Ingest.ExpireEvery, "with --retention or --prune-unreported: how often to look for UTC days of readings to remove and devices to prune (the first look is at start)")
	pruneAgeVar(fs, &c.Ingest.PruneUnreported, "prune-unreported", fmt.Sprintf("at start and every --expire-every, remove the devices registered longer ago than this that never stored a reading (not revoked, no override), as POST /v1/devices/prune does, e.g. 7d (at least %s; a pruned case-study kettle must POST /login again: choose longer than any kettle takes from its login to its first reading). 0: only when asked (the default)", fleet.MinPruneAge), true)
	fs.Float64Var(&c.Ingest.DeviceRate, "device-rate", c.Ingest.DeviceRate, "requests a second one kettle may make (uploads and polls; a kettle sends 2 in 30 s), e.g. 1, or 0.2 for one every 5 s; HTTP over it is answered 429 + Retry-After, MQTT over it is read more slowly (nothing refused). 0: no limit (the default)")
	fs.IntVar(&c.Ingest.DeviceBurst, "device-burst", c.Ingest.DeviceBurst, "with --device-rate: requests a kettle may make at once before its rate applies (a reconnecting kettle's backlog, a poll right after an upload)")
	fs.Float64Var(&c.Ingest.LoginRate, "login-rate", c.Ingest.LoginRate, "case-study registrations (POST /login, which anyone may call) a second over all clients; over it the request is held up to 1 s, then answered 429 + Retry-After. 0: no limit")
	fs.IntVar(&c.Ingest.LoginBurst, "login-burst", c.Ingest.LoginBurst, "with --login-rate: registrations at once before the rate applies (a whole fleet logging in again after an outage)")
	fs.Float64Var(&c.Ingest.LoginSourceRate, "login-rate-per-source", c.Ingest.LoginSourceRate, "case-study registrations (POST /login) a second from one client address (an IPv4 address, an IPv6 /64), checked before --login-rate: one client looping on POST /login is refused on its own instead of using up the rate all clients share; held up to 1 s, then 429 + Retry-After. Kettles behind one NAT share an address: set --login-burst-per-source above the most that log in at once through one. 0: no limit (the default)")
	fs.IntVar(&c.Ingest.LoginSourceBurst, "login-burst-per-source", c.Ingest.LoginSourceBurst, "with --login-rate-per-source: registrations at once from one address before its rate applies")
	fs.IntVar(&c.Ingest.MaxDevices, "max-devices", c.Ingest.MaxDevices, "devices this server registers at most through POST /login and POST /v1/devices (each is a slot in memory and a row, freed only by pruning those that never report: POST /v1/devices/prune, kettle prune); past it they are refused 403. Kettles with v1 tokens register by uploading and are not refused. 0: no bound")
	fs.DurationVar(&c.Ingest.StoreTimeout, "store-timeout", c.Ingest.StoreTimeout, "deadline of every store call (a batch commit, a registration, an override, a read): an upload whose commit does not finish in time is answered 503 + Retry-After, within twice this even when the database is unreachable (packets dropped), while polls keep being answered from memory")
	fs.DurationVar(&c.Ingest.MaxClockSkew, "max-clock-skew", c.Ingest.MaxClockSkew, "PostgreSQL: the most this node's clock may be from the database's (compared at start, every --cache-refresh and before every expiry; kettle_clock_skew_seconds). Past it the node judges retention and the statistics' hours wrongly, so it stops: /readyz 503, readings 503 + Retry-After naming the skew, no expiry, until its clock is synchronised (NTP). 5s is far past any NTP-kept clock (milliseconds) and small against the windows the clock decides (5 min, days). Negative: not checked. SQLite has no second clock: not checked")
	fs.IntVar(&c.Store.PoolSize, "pg-pool", c.Store.PoolSize, "PostgreSQL: connections in the pool (the server opens one more, outside it, for the database server's statistics on /metrics)")
	fs.DurationVar(&c.Store.StatementTimeout, "pg-statement-timeout", c.Store.StatementTimeout, "PostgreSQL: statement_timeout of every connection")
	fs.StringVar(&c.Store.ReadDSN, "db-read", c.Store.ReadDSN, "PostgreSQL: a standby for reads that tolerate lag (device lists, a device's history, the dashboard's charts), e.g. postgres://kettle@h2,h3/kettle?target_session_attrs=prefer-standby; writes, statistics and the node's caches stay on --db. Empty: every read on --db")
	fs.DurationVar(&c.Store.MaxReadLag, "max-read-lag", c.Store.MaxReadLag, "with --db-read: while the replica's replay lag (kettle_pg_read_replica_lag_seconds, measured every second) is over this or unknown, its reads go to the primary")
}

// shedAndMQTTFlags: load shedding, the embedded MQTT listener and the
// external broker.
func (o *serveOptions) shedAndMQTTFlags(fs *flag.FlagSet) {
	c := &o.cfg
	fs.DurationVar(&c.Shed.Latency, "shed-latency", c.Shed.Latency, "0: off (the default). Else: while goroutines wait longer than this for a CPU (p99 over --shed-windows windows of --shed-window in a row, --shed-runnable or more waiting, uploads ≥ --shed-min-ingest-share of requests), ingest is answered 503 + Retry-After before its body is read and v1 command polls get Cache-Control max-age (about --shed-retry-after) instead of no-cache, so polls stay fast at the cost of acknowledged readings and of overrides reaching kettles later; e.g. 20ms")
	fs.DurationVar(&c.Shed.Window, "shed-window", c.Shed.Window, "with --shed-latency: how often the scheduling latency is evaluated")
	fs.IntVar(&c.Shed.Windows, "shed-windows", c.Shed.Windows, "with --shed-latency: saturated windows in a row before shedding starts (a moment's stall of the whole machine is not overload); it stops after --shed-hold without one")
	fs.DurationVar(&c.Shed.Hold, "shed-hold", c.Shed.Hold, "with --shed-latency: once shedding, keep shedding until no window has been saturated for this long (0: stop at the first window that is not saturated; then shedding flaps at 10× load)")
	fs.IntVar(&c.Shed.MinRunnable, "shed-runnable", c.Shed.MinRunnable, "with --shed-latency: a window is saturated only if at least this many goroutines wait for a CPU at its end (fewer: other processes take the CPU, shedding would not help)")
	fs.Float64Var(&c.Shed.MinIngestShare, "shed-min-ingest-share", c.Shed.MinIngestShare, "with --shed-latency: shed only while uploads are at least this share of the requests (else refusing them would not relieve the CPU)")
	fs.DurationVar(&c.ShedRetryAfter, "shed-retry-after", c.ShedRetryAfter, "Retry-After told to ingest shed for CPU, and max-age of v1 command polls meanwhile (jittered ±50%); long enough that kettles batch their readings instead of retrying each second")
	fs.StringVar(&c.MQTT.Addr, "mqtt-addr", c.MQTT.Addr, "embedded MQTT listener (3.1.1 and 5), e.g. 127.0.0.1:1883; empty: off")
	fs.IntVar(&c.MQTT.MaxConns, "mqtt-max-conns", c.MQTT.MaxConns, "MQTT connections allowed (0: half of the open-file budget, the other half stays with HTTP)")
	fs.StringVar(&c.MQTT.ServerReference, "mqtt-server-reference", c.MQTT.ServerReference, "where kettles refused for capacity (over --mqtt-max-conns, or while shedding) are sent: MQTT 5 gets CONNACK 0x9C use another server with this Server Reference, e.g. mqtt2.example.net:1883; empty: 0x97 quota exceeded over the cap, 0x89 server busy while shedding (MQTT 3.1.1: 0x03 either way)")
	fs.DurationVar(&c.MQTT.WriteTimeout, "mqtt-write-timeout", c.MQTT.WriteTimeout, "a write to a kettle that takes longer closes its connection (a kettle that stops reading cannot stall others)")
	fs.StringVar(&c.MQTTBroker.BrokerURL, "mqtt-broker", c.MQTTBroker.BrokerURL, "consume from an external MQTT 5 broker instead, e.g. tcp://127.0.0.1:1883 or tls://broker:8883 (shared subscription $share/<mqtt-share>/kettles/+/measurements)")
	fs.StringVar(&c.MQTTBroker.CAFile, "mqtt-broker-ca", c.MQTTBroker.CAFile, "PEM certificate(s) to trust for a TLS --mqtt-broker (tls://host:8883; empty: the system's roots)")
	fs.StringVar(&c.MQTTBroker.ClientID, "mqtt-client-id", c.MQTTBroker.ClientID, "this node's client id at the external broker (unique and stable per node; empty: kettle-<hostname>)")
	fs.StringVar(&c.MQTTBroker.Share, "mqtt-share", c.MQTTBroker.Share, "shared-subscription group name: nodes in one group split the stream")
	fs.StringVar(&c.MQTTBroker.Username, "mqtt-username", c.MQTTBroker.Username, "username at the external broker")
	fs.StringVar(&c.MQTTBroker.Password, "mqtt-password", c.MQTTBroker.Password, "password at the external broker")
}

// processFlags: the process's own settings (not the server's Config) and
// the readings log (serve_log.go).
func (o *serveOptions) processFlags(fs *flag.FlagSet) {
	c := &o.cfg
	fs.BoolVar(&o.sample, "sample", false, "sample this process's CPU, memory, fds, the machine and /metrics every second while serving, written to <data-dir>/system.json at exit (kettle report RESULTS --system FILE)")
	fs.StringVar(&o.debugAddr, "debug-addr", "", "serve Go's pprof profiles (/debug/pprof/) on this separate address, e.g. 127.0.0.1:6060; empty: off")
	fs.IntVar(&o.gcPercent, "gc-percent", 400, "Go garbage collector target (as GOGC): the heap may grow this many % over the live heap between collections; 400 trades memory for less CPU per request than Go's 100 (docs/performance.md); default 100 with --mqtt-addr, where the headroom would multiply every connected kettle's memory for little CPU saved; the GOGC environment variable, when set, wins")
	fs.IntVar(&o.memLimitMB, "memory-limit-mb", 2048, "soft limit of the Go heap in MiB (as GOMEMLIMIT): nearer it the collector runs more often whatever --gc-percent says (0: none); the GOMEMLIMIT environment variable, when set, wins")
	logFlags(fs, &c.Log, &o.role)
	fs.StringVar(&o.logFormat, "log-format", "json", "log format: json or text")
	fs.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn, error")
}

// finish checks the parsed flags, builds the logger (writing to w) and
// applies the process's settings (GC, memory limit).
func (o *serveOptions) finish(fs *flag.FlagSet, w io.Writer) (*slog.Logger, error) {
	if err := errors.Join(o.cfg.Validate()...); err != nil {
		return nil, err
	}
	if err := checkRole(o.role, o.cfg.Log); err != nil {
		return nil, err
	}
	log, err := logger(o.logFormat, o.logLevel, w)
	if err != nil {
		return nil, err
	}
	o.cfg.Logger = log
	if os.Getenv("GOGC") == "" {
		gc := o.gcPercent
		if o.cfg.MQTT.Addr != "" && !flagGiven(fs, "gc-percent") {
			gc = mqttGCPercent
		}
		debug.SetGCPercent(gc)
	}
	if os.Getenv("GOMEMLIMIT") == "" && o.memLimitMB > 0 {
		debug.SetMemoryLimit(int64(o.memLimitMB) << 20)
	}
	return log, nil
}

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

// logger builds the process logger from --log-format and --log-level.
func logger(format, level string, w io.Writer) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want json or text", format)
}

// serveConfig is kettle serve's path from arguments (and their environment
// twins) to a server configuration, for kettle demo: the server it starts
// is the one `kettle serve ARGS` starts, logging to w.
func serveConfig(args []string, w io.Writer) (server.Config, error) {
	fs := newFlagSet("serve", "[flags]", serveDoc)
	o := newServeOptions(fs)
	if err := fs.Parse(args); err != nil {
		return server.Config{}, err
	}
	if err := flagsFromEnv(fs); err != nil {
		return server.Config{}, err
	}
	if _, err := o.finish(fs, w); err != nil {
		return server.Config{}, err
	}
	return o.cfg, nil
}
