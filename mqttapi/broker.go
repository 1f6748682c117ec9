package mqttapi

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/backoff"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// Config configures the embedded listener. DefaultConfig holds every
// default; a zero field takes its DefaultConfig value.
type Config struct {
	// Addr is the listen address, e.g. 127.0.0.1:1883 (":0" for any port).
	Addr string
	// MaxConns caps open MQTT connections; a CONNECT past it is answered
	// with a refusal that says why (Broker.shed). Each connection costs
	// one file descriptor: keep it under the process's open-file limit
	// minus what HTTP and the store need.
	MaxConns int
	// MaxPacketBytes is the largest packet accepted. A connection waiting
	// for its commit holds one.
	MaxPacketBytes int
	// ConnectTimeout bounds the time from accept to CONNECT.
	ConnectTimeout time.Duration
	// SessionExpiry caps how long a disconnected session (clean session 0,
	// or an MQTT 5 session expiry) is kept. Sessions are keyed by device
	// id, so at most one per device.
	SessionExpiry time.Duration
	// ShutdownTimeout bounds Close's wait for in-flight messages.
	ShutdownTimeout time.Duration
	// WriteTimeout bounds each write to a kettle; a kettle that has not
	// taken a packet off its socket for that long is disconnected (it
	// reconnects and gets its current command on subscribe).
	WriteTimeout time.Duration
	// CommandTick is how often due time-driven command changes are checked.
	CommandTick time.Duration
	// ConnWindow is how many QoS 1 messages of one connection may wait for
	// their commit at once; past it the connection is not read. At most
	// the Receive Maximum we announce (32).
	ConnWindow int
	// TLS, when set, makes the listener TLS only (kettle serve --tls-cert).
	TLS *tls.Config
	// TLSHandshakeFailed, when set, is called for each failed handshake.
	TLSHandshakeFailed func()
	// MaxPendingRows caps the readings of QoS 1 messages waiting for their
	// commit over all connections (0: half the ingest queue); past it no
	// connection that needs more is read until a commit frees some. Each
	// message holds a goroutine and its decoded readings.
	MaxPendingRows int
	// PreviousSecret, when set, is the device secret being retired (kettle
	// serve --secret-previous): a password made with it is accepted too,
	// and each such connection is reported to OnPreviousCredential.
	PreviousSecret       []byte
	OnPreviousCredential func(kind string, device kettle.DeviceID)
	// ServerReference, when set, is where a kettle refused for capacity is
	// sent (MQTT 5: 0x9C use another server, with this Server Reference,
	// e.g. "mqtt2.example.net:8883"); empty: 0x97 quota exceeded over the
	// cap, 0x89 server busy while shedding. MQTT 3.1.1 gets 0x03 either way.
	ServerReference string
	// Shedding, when set, reports whether the node is shedding load; new
	// connections are refused meanwhile (connected kettles stay).
	Shedding func() bool
	// TrustedProxies are the balancers in front of the listener (kettle
	// serve --trusted-proxies): a connection from one begins with a PROXY
	// protocol v2 header (HAProxy's send-proxy-v2) naming the kettle's
	// address, which the listener's logs then show; a PROXY header from
	// any other peer is refused.
	TrustedProxies []netip.Prefix
}

// DefaultConfig is the listener's configuration when nothing is set
// (kettle serve's flags take their defaults from it).
func DefaultConfig() Config {
	return Config{
		MaxConns:        100_000,
		MaxPacketBytes:  kettle.MaxBody + 4<<10, // a batch upload plus MQTT's header
		ConnectTimeout:  10 * time.Second,
		SessionExpiry:   time.Hour,
		ShutdownTimeout: 10 * time.Second,
		WriteTimeout:    10 * time.Second,
		CommandTick:     time.Second,
		ConnWindow:      16,
	}
}

func (c *Config) defaults() {
	d := DefaultConfig()
	set := func(v *int, def int) {
		if *v <= 0 {
			*v = def
		}
	}
	setD := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	set(&c.MaxConns, d.MaxConns)
	set(&c.MaxPacketBytes, d.MaxPacketBytes)
	setD(&c.ConnectTimeout, d.ConnectTimeout)
	setD(&c.SessionExpiry, d.SessionExpiry)
	setD(&c.ShutdownTimeout, d.ShutdownTimeout)
	setD(&c.WriteTimeout, d.WriteTimeout)
	setD(&c.CommandTick, d.CommandTick)
	if c.ConnWindow <= 0 || c.ConnWindow > receiveMaximum {
		c.ConnWindow = min(d.ConnWindow, receiveMaximum)
	}
}

// receiveMaximum is the Receive Maximum announced to MQTT 5 kettles.
const receiveMaximum = 32

// Broker is the running embedded MQTT listener.
type Broker struct {
	cfg      Config
	svc      Fleet
	secret   []byte
	ln       *listener
	dev      *devServer // the sessions (device.go)
	push     *pusher
	counters *Counters
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	// rows is the budget of readings waiting for their commit
	// (Config.MaxPendingRows); inflight counts their goroutines.
	rows     *rowBudget
	inflight sync.WaitGroup
	bg       sync.WaitGroup // background loops other than the pusher (expire)
	// Lines kettles can cause at any rate, thinned (logthin): invalid
	// payloads, refused connections.
	badLog, refusedLog logthin.Limiter
	// shedLog: at most one line a second about capacity refusals, with
	// their count since the last one.
	shedLog logthin.Limiter
}

// Start listens on cfg.Addr and serves kettles until Close. It returns once
// the listener is bound.
func Start(ctx context.Context, cfg Config, svc Fleet, secret []byte, log *slog.Logger) (*Broker, error) {
	cfg.defaults()
	if cfg.MaxPendingRows <= 0 {
		cfg.MaxPendingRows = max(svc.Config().QueueRows/2, 1)
	}
	b := &Broker{cfg: cfg, svc: svc, secret: secret, counters: new(Counters), log: log, rows: newRowBudget(cfg.MaxPendingRows),
		badLog: logthin.Limiter{Burst: 10}, refusedLog: logthin.Limiter{Burst: 10}, shedLog: logthin.Limiter{Burst: 1}}
	b.counters.MaxConns.Store(int64(cfg.MaxConns))
	b.ctx, b.cancel = context.WithCancel(context.WithoutCancel(ctx))
	d := newDevServer(b)
	b.push = newPusher(svc, log, b.counters, cfg.CommandTick, false, d.publish)
	b.ln = &listener{addr: cfg.Addr, log: log, connectTimeout: cfg.ConnectTimeout, writeTimeout: cfg.WriteTimeout,
		maxConns: int64(cfg.MaxConns), tls: cfg.TLS, tlsFailed: cfg.TLSHandshakeFailed,
		proxies: cfg.TrustedProxies, proxyLog: logthin.Limiter{Burst: 10},
		closeAll: d.closeAll, refusing: make(chan struct{}, maxRefusing), start: d.start, dropped: d.droppedFrom}
	b.ln.overCap = func(version byte) packets.Packet { return b.shed(ShedQuota, version) }
	if err := b.ln.listen(); err != nil {
		b.cancel()
		return nil, fmt.Errorf("mqtt: listen on %s: %w (is another kettle serve running? choose --mqtt-addr)", cfg.Addr, err)
	}
	d.startPoller()
	go func() {
		defer close(d.served)
		b.ln.serve()
	}()
	go b.push.run(b.ctx)
	log.Info("mqtt listener started", "addr", b.Addr(), "max_conns", cfg.MaxConns, "max_packet_bytes", cfg.MaxPacketBytes)
	return b, nil
}

// shed counts and logs a capacity refusal and returns the CONNACK that says
// why (see Config.ServerReference).
func (b *Broker) shed(why ShedReason, version byte) packets.Packet {
	code := packets.ErrQuotaExceeded
	if why == ShedBusy {
		code = packets.ErrServerBusy
	}
	var props packets.Properties
	if b.cfg.ServerReference != "" {
		why, code = ShedRedirect, packets.ErrUseAnotherServer
		props.ServerReference = b.cfg.ServerReference
	}
	b.counters.Shed[why].Add(1)
	if ok, skipped := b.shedLog.Allow(time.Now()); ok {
		b.log.Warn("mqtt: connections refused for capacity", "reason", ShedReasonNames[why], "open", b.ln.open.Load(), "max_conns", b.cfg.MaxConns,
			"server_reference", b.cfg.ServerReference, "refused_since_last_line", skipped+1)
	}
	ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}, ProtocolVersion: version, ReasonCode: code.Code}
	if version < 5 {
		ack.ReasonCode = v3ServerUnavailable
	} else {
		props.ReasonString = code.Reason
		ack.Properties = props
	}
	return ack
}

// v3ServerUnavailable is MQTT 3.1.1's CONNACK return code 0x03: the
// connection was refused because the server is unavailable.
const v3ServerUnavailable = 0x03

// Addr is the bound listen address.
func (b *Broker) Addr() string { return b.ln.address() }

// Counters are the adapter's counts, for metrics.
func (b *Broker) Counters() *Counters { return b.counters }

// Close stops accepting, disconnects every kettle and waits (at most
// ShutdownTimeout) for messages already handed to ingest to commit and be
// acknowledged; messages still waiting for room in the queue are given up
// unacknowledged, so their clients redeliver. Call it before
// fleet.Service.Close.
func (b *Broker) Close() error {
	b.cancel()
	b.bg.Wait()
	b.dev.close()
	if !b.ln.wait(b.cfg.ShutdownTimeout) {
		b.log.Warn("mqtt: connections still open after shutdown timeout", "timeout", b.cfg.ShutdownTimeout)
	}
	b.dev.stopPoll()
	// Messages handed to ingest: their commits finish (b.ctx only stops
	// the retries of messages still waiting for room).
	done := make(chan struct{})
	go func() { b.inflight.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(b.cfg.ShutdownTimeout):
		b.log.Warn("mqtt: messages still waiting for their commit after shutdown timeout", "timeout", b.cfg.ShutdownTimeout)
	}
	<-b.push.done
	b.dev.wg.Wait() // command pushes and takeover DISCONNECTs: each bounded by a write deadline
	b.log.Info("mqtt listener stopped", "counters", b.counters.Snapshot())
	return nil
}

// authenticate checks a CONNECT: username = device id (canonical UUID
// text), password = that device's token. It returns the device and which
// secret signed its token (0 current, 1 previous), or the refusal, counted
// and logged (thinned): 0x86 for a bad username or password, 0x87 for
// another device's valid token or a revoked device, 0x85 for a client id
// that is neither empty nor the device id, 0x83 for a Will message.
func (b *Broker) authenticate(pk packets.Packet, remote string) (uid uuid.UUID, which int, code packets.Code) {
	code = packets.CodeSuccess
	user := string(pk.Connect.Username)
	uid, uerr := uuid.Parse(user)
	tokID, which := kettle.VerifyDeviceTokens(string(pk.Connect.Password), b.secret, b.cfg.PreviousSecret)
	ok := which >= 0
	switch {
	case !pk.Connect.UsernameFlag || !pk.Connect.PasswordFlag || uerr != nil || uid.String() != user || !ok:
		code = packets.ErrBadUsernameOrPassword
	case tokID != uid || b.svc.Revoked(uid):
		code = packets.ErrNotAuthorized
	case pk.Connect.ClientIdentifier != "" && pk.Connect.ClientIdentifier != user:
		code = packets.ErrClientIdentifierNotValid
	case pk.Connect.WillFlag:
		// A Will would be published on the kettle's behalf after it is
		// gone, outside the ACL that checks what it publishes itself.
		code = errWillRefused
	}
	if code != packets.CodeSuccess {
		b.counters.ConnectsRefused.Add(1)
		if ok, skipped := b.refusedLog.Allow(time.Now()); ok {
			b.log.Info("mqtt: connection refused", "remote", remote, "username", truncate(user, 64), "reason", code.Reason, "refusals_not_logged_since_last_line", skipped)
		}
	}
	return uid, which, code
}

// refusal is the CONNACK code refusing a CONNECT of the given protocol
// version: 3.1.1 return codes below 5 (mochi's own v5→v3 map sends 0x05 for
// a bad password and nothing sensible for 0x87).
func refusal(code packets.Code, version byte) packets.Code {
	if version < 5 {
		return packets.Code{Code: v3Refusal[code.Code], Reason: code.Reason}
	}
	return code
}

// errWillRefused refuses a CONNECT with a Will message: 0x83 (the CONNECT
// is valid but not accepted) with the reason said.
var errWillRefused = packets.Code{Code: packets.ErrImplementationSpecificError.Code, Reason: "will messages are not accepted: connect without one"}

// v3Refusal maps our refusals to MQTT 3.1.1 CONNACK return codes.
var v3Refusal = map[byte]byte{
	packets.ErrBadUsernameOrPassword.Code:    0x04,
	packets.ErrNotAuthorized.Code:            0x05,
	packets.ErrClientIdentifierNotValid.Code: 0x02,
	errWillRefused.Code:                      0x05, // 3.1.1 has no closer code
}

// ingest hands readings to the fleet service and returns once they are
// committed (true), retrying with jittered backoff while ingest is
// unavailable (queue full, store down) for QoS ≥ 1; false: not committed
// (QoS 0 dropped, or given up at shutdown or when the client left).
func (b *Broker) ingest(dc *devConn, ms []kettle.Measurement, qos byte) bool {
	withheld := false
	retry := ingestBackoff()
	for {
		_, _, err := b.svc.Ingest(b.ctx, ms)
		if err == nil {
			break
		}
		if qos == 0 {
			b.counters.Dropped.Add(1)
			return false
		}
		if !withheld {
			withheld = true
			b.counters.Withheld.Add(1)
		}
		if !retry.Wait(b.ctx, retryAfter(err)) {
			b.counters.Unacked.Add(1)
			return false // shutting down: no PUBACK, the client redelivers elsewhere
		}
		if dc.Closed() {
			b.counters.Unacked.Add(1)
			return false // client gone: it redelivers on reconnect
		}
	}
	b.counters.Readings.Add(int64(len(ms)))
	return true
}

// ingestBackoff paces a message's retries while ingest is unavailable
// (this listener's and the external-broker consumer's): jittered, so that
// kettles blocked together do not retry in step.
func ingestBackoff() backoff.Backoff {
	return backoff.Backoff{Initial: 40 * time.Millisecond, Max: time.Second}
}

// retryAfter is the wait an ingest error asks for (0: none said).
func retryAfter(err error) time.Duration {
	var ke *kettle.Error
	if errors.As(err, &ke) {
		return ke.RetryAfter
	}
	return 0
}

// sleep waits d, or until the broker shuts down: then it returns false and
// counts the message it held as left unacknowledged (the client redelivers).
func (b *Broker) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-b.ctx.Done():
		b.counters.Unacked.Add(1)
		return false
	}
}

// maxLoggedError is the most of an error message a log line carries: a
// 3 KB payload of 1,000 empty readings is 7,000 field errors, ~250 KB.
const maxLoggedError = 512

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
