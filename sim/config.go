package sim

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Config is one swarm run, one part per concern. Each part is embedded, so
// cfg.Devices reads as before; Validate checks the whole.
type Config struct {
	TargetConfig
	FleetConfig
	ScheduleConfig
	TransportConfig
	AuditConfig
	OutputConfig
}

// TargetConfig is the server and the credentials to load it with.
type TargetConfig struct {
	Target string // base URL of the server; must be loopback
	// TLS is the client side of an https:// Target (RootCAs: the server's
	// CA; ClientSessionCache: kettles resume sessions); nil: the system's
	// roots, no resumption. With an https Target, MQTT kettles speak TLS
	// to MQTTTarget too.
	TLS *tls.Config
	// CAPEM is the PEM TLS's roots were read from (nil: the system's
	// roots): a lab's controller hands it to its workers in their plans.
	CAPEM []byte
	// AllowHosts names non-loopback hosts the operator allows as Target or
	// MQTTTarget (exact names or addresses; empty: loopback only).
	AllowHosts []string
	Secret     []byte // v1: derive device tokens offline
	Operator   string // operator token: v1 provisioning (without Secret) and the audit
}

// FleetConfig is the kettles: how many, their physics, their place in a
// fleet several processes share.
type FleetConfig struct {
	Devices int    // kettles
	Seed    uint64 // the kettles' physics and phases derive from it
	// The distributed lab (kettle swarm --workers): one shard of a fleet.
	//
	// First and Stride place this run in a fleet: kettle i of the shard
	// is kettle First+i×Stride of the fleet (Stride 0 counts as 1), with
	// that kettle's physics seed and hatch time, so shards of one fleet
	// never overlap, and strided shards hatch in step side by side.
	First, Stride int
}

// ScheduleConfig is when kettles send: the open model's parameters.
type ScheduleConfig struct {
	Interval  time.Duration // between a kettle's readings
	Jitter    time.Duration // each send is due at phase + k×Interval ± Jitter
	HatchRate float64       // kettles started per second; 0 starts all at once with random phases
	Duration  time.Duration // whole run, hatching included
	// Stages, if set, shape the fleet over time instead of HatchRate (see
	// Stage and shape.go): Devices defaults to their peak, Duration to
	// their sum. Their targets count the whole fleet, also in a lab's shard.
	Stages []Stage
	// Rollout, if set, switches a share of the fleet to another batch
	// size mid-run.
	Rollout *Rollout
	// Scenario names the scenario file the shape came from (recorded).
	Scenario string
	// Ready, if set, is called once the kettles are set up; it returns the
	// wall-clock time the run starts (the fleet's common start) and the
	// run waits until then.
	Ready func(ctx context.Context) (time.Time, error)
}

// TransportConfig is how kettles talk to the server.
type TransportConfig struct {
	API string // "v0" (case-study protocol) or "v1"
	// Protocol is how kettles talk: ProtocolHTTP (default: API decides v0
	// or v1) or ProtocolMQTT (v1 payloads over MQTT 5 to MQTTTarget; Target
	// stays the HTTP base URL for provisioning and the audit).
	Protocol     string
	MQTTTarget   string // host:port of the MQTT listener; must be loopback
	MQTTInflight int    // publishes a kettle may have awaiting PUBACK (0: 1)
	// MQTTKeepAlive is the MQTT keepalive (whole seconds); 0: twice the
	// interval, within 30 s..1 h.
	MQTTKeepAlive time.Duration
	Batch         int // v1: readings per upload (a kettle uploads when it has Batch buffered)
	// Conns is the number of shared connections; 0 means one keep-alive
	// connection per kettle. Both are capped by the fd budget (see FDBudget).
	Conns     int
	SourceIPs int // spread connections over 127.0.0.1..N (IPv4 loopback targets)
	// SourceAddrs, if set, are the source addresses to spread connections
	// over instead (e.g. one per swarm process when several share the
	// machine: each address has its own ephemeral ports).
	SourceAddrs []net.IP
	Timeout     time.Duration // per request, dial included
	ReserveFDs  int           // file descriptors to leave to others (an in-process server)
}

// AuditConfig is what is checked after the run.
type AuditConfig struct {
	NoAudit bool
	// AuditAfter, when set, is waited for before the audit: with a
	// readings log, the acknowledged readings are in the store only once
	// the writers drained it (kettle swarm --audit-after URL).
	AuditAfter func(ctx context.Context) error
	// ExportAcked fills Results.Acked with every acknowledged reading, for
	// an audit done elsewhere (the lab's controller audits all shards).
	ExportAcked bool
	// SLOP99 and MaxErrorRate are recorded in Params for the report (the
	// caller judges the run).
	SLOP99       time.Duration
	MaxErrorRate float64
}

// OutputConfig is what the run tells as it goes.
type OutputConfig struct {
	// Progress receives a live line every ProgressEvery (nil: none).
	Progress      io.Writer
	ProgressEvery time.Duration
	InProcessNote string // recorded in Params, e.g. when the server shares this process
	// Log receives notes about caps and setup (nil: discard).
	Log io.Writer
	// Observer, if set, sees every request as it happens (kettle swarm
	// --metrics-addr: *metrics.Swarm).
	Observer Observer
	// OnSecond, if set, is given each Second as it closes (from the
	// collector's goroutine; it must not block).
	OnSecond func(Second)
}

// Observer is told about requests as they happen; *metrics.Swarm is one.
// Calls come from many goroutines and must not block.
type Observer interface {
	// Offered: a request came due at its intended send time.
	Offered(endpoint string)
	// Completed: a response arrived, latency from the intended send time.
	Completed(endpoint string, status int, latency time.Duration)
	// Error: a request failed (kind as in results: timeout, conn, http_503 …).
	Error(endpoint, kind string)
	// SetActive and SetLag are called once a second.
	SetActive(n int)
	SetLag(d time.Duration)
}

// Protocols of Config.Protocol.
const (
	ProtocolHTTP = "http"
	ProtocolMQTT = "mqtt"
)

func (c *Config) defaults() {
	if c.Protocol == "" {
		c.Protocol = ProtocolHTTP
	}
	if c.Protocol == ProtocolMQTT {
		c.API = "v1"
		if c.MQTTInflight <= 0 {
			c.MQTTInflight = 1
		}
	}
	if c.Interval <= 0 {
		c.Interval = 30 * time.Second
	}
	if len(c.Stages) > 0 {
		if c.Devices <= 0 {
			c.Devices = StagesPeak(c.Stages)
		}
		c.Duration = max(c.Duration, StagesDuration(c.Stages))
	}
	if c.Jitter < 0 || c.Jitter > c.Interval/4 {
		c.Jitter = c.Interval / 4
	}
	if c.API == "" {
		c.API = "v1"
	}
	if c.Batch <= 0 || c.API == "v0" {
		c.Batch = 1
	}
	if c.Batch > kettle.MaxBatch {
		c.Batch = kettle.MaxBatch
	}
	if c.Timeout <= 0 {
		c.Timeout = 10 * time.Second
	}
	if c.SourceIPs <= 0 {
		c.SourceIPs = 1
	}
	if c.ProgressEvery <= 0 {
		c.ProgressEvery = 5 * time.Second
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
}

// Validate names every problem of the configuration, each by the kettle
// swarm flag that sets it, so that the CLI, the lab's workers, tests and
// benchmarks refuse the same configurations with the same words. A zero
// value is a default (see defaults), not a problem.
func (c *Config) Validate() []error {
	var errs []error
	add := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if _, err := CheckTarget(c.Target, c.AllowHosts); err != nil {
		errs = append(errs, err)
	}
	shaped := len(c.Stages) > 0 // then Devices and Duration default to the stages'
	if c.Devices < 0 || c.Devices == 0 && !shaped {
		add("--devices must be > 0, got %d", c.Devices)
	}
	if c.Duration < 0 || c.Duration == 0 && !shaped {
		add("--duration must be > 0")
	}
	errs = append(errs, c.validateShape()...)
	switch c.API {
	case "", "v0", "v1":
	default:
		add("--api %q: want v0 or v1", c.API)
	}
	switch c.Protocol {
	case "", ProtocolHTTP:
	case ProtocolMQTT:
		if c.API == "v0" {
			add("--protocol mqtt carries v1 payloads; drop --api %s", c.API)
		}
		if c.MQTTInflight < 0 || c.MQTTInflight > 1000 {
			add("--mqtt-inflight %d: want 1..1000", c.MQTTInflight)
		}
		if c.MQTTTarget != "" {
			if _, err := CheckTargetAddr(c.MQTTTarget, c.AllowHosts); err != nil {
				errs = append(errs, err)
			}
		}
	default:
		add("--protocol %q: want http or mqtt", c.Protocol)
	}
	if c.Batch < 0 || c.Batch > kettle.MaxBatch {
		add("--batch %d: want 1..%d", c.Batch, kettle.MaxBatch)
	}
	return errs
}

// ClientTLS is the client side of an https target: the server's
// certificate checked against the PEM certificates caPEM (nil: the system's
// roots), sessions resumed when resume is set.
func ClientTLS(caPEM []byte, resume bool) (*tls.Config, error) {
	// The key exchanges kettle firmware offers (mbedTLS, wolfSSL): X25519,
	// then P-256 — not Go's default hybrid X25519MLKEM768, which would cost
	// the simulator, co-located with the server, more than a kettle's own
	// chip pays.
	c := &tls.Config{CurvePreferences: []tls.CurveID{tls.X25519, tls.CurveP256}}
	if caPEM != nil {
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(caPEM) {
			return nil, errors.New("no PEM certificate in it")
		}
	}
	if resume {
		c.ClientSessionCache = tls.NewLRUClientSessionCache(64)
	}
	return c, nil
}

// PlannedParams is what Results.Params will say of the configuration
// before the run (what the live view shows while it goes).
func (c Config) PlannedParams() Params {
	c.defaults()
	return c.params()
}

// params is what Results.Params says of the configuration itself; the
// swarm and the lab add what their run chose (connections, TLS, protocol).
func (c *Config) params() Params {
	return Params{Target: c.Target, API: c.API, Devices: c.Devices, IntervalS: c.Interval.Seconds(),
		JitterS: c.Jitter.Seconds(), HatchRate: c.HatchRate, DurationS: c.Duration.Seconds(), Batch: c.Batch,
		TimeoutS: c.Timeout.Seconds(), Seed: c.Seed, GOMAXPROCS: runtime.GOMAXPROCS(0),
		SLOP99Ms: float64(c.SLOP99) / 1e6, MaxErrorRate: max(c.MaxErrorRate, 0),
		Scenario: c.Scenario, Stages: stageMarks(c.Stages), Rollout: rolloutMark(c.Rollout)}
}
