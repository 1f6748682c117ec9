package mqttapi

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
	"github.com/kettlefleet/kettlefleet/wire"
)

// Config configures the embedded listener.
type Config struct {
	// Addr is the listen address, e.g. 127.0.0.1:1883 (":0" for any port).
	Addr string
	// MaxConns caps open MQTT connections; a CONNECT past it is answered
	// with a refusal that says why (Broker.shed).
	// 0: 100,000. Each connection costs one file descriptor: keep it under
	// the process's open-file limit minus what HTTP and the store need.
	MaxConns int
	// MaxPacketBytes is the largest packet accepted (0: kettle.MaxBody plus
	// 4 KiB of MQTT header). A connection waiting for its commit holds one.
	MaxPacketBytes int
	// ConnectTimeout bounds the time from accept to CONNECT (0: 10 s).
	ConnectTimeout time.Duration
	// SessionExpiry caps how long a disconnected session (clean session 0,
	// or an MQTT 5 session expiry) is kept (0: 1 h). Sessions are keyed by
	// device id, so at most one per device.
	SessionExpiry time.Duration
	// ShutdownTimeout bounds Close's wait for in-flight messages (0: 10 s).
	ShutdownTimeout time.Duration
	// WriteTimeout bounds each write to a kettle (0: 10 s); a kettle that
	// has not taken a packet off its socket for that long is disconnected
	// (it reconnects and gets its current command on subscribe).
	WriteTimeout time.Duration
	// CommandTick is how often due time-driven command changes are checked
	// (0: 1 s).
	CommandTick time.Duration
	// ConnWindow is how many QoS 1 messages of one connection may wait for
	// their commit at once (0: 16); past it the connection is not read.
	// At most the Receive Maximum we announce (32).
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
	// StackTrim is how often a garbage collection runs while kettles are
	// connected (0: never forced), to give back the stack each connection
	// grew to handle its last packet (stacktrim.go).
	StackTrim time.Duration
	// Shedding, when set, reports whether the node is shedding load; new
	// connections are refused meanwhile (connected kettles stay).
	Shedding func() bool
	// Engine is the listener's implementation: EngineDevice ("" too) or
	// EngineMochi (doc.go, Library choice).
	Engine string
}

// The embedded listener's engines (Config.Engine, kettle serve --mqtt-engine).
const (
	// EngineDevice is the device-only listener (device.go): one goroutine
	// and a few hundred bytes per connected kettle.
	EngineDevice = "device"
	// EngineMochi is mochi-mqtt's general broker with kettlefleet's hooks.
	EngineMochi = "mochi"
)

func (c *Config) defaults() {
	if c.MaxConns <= 0 {
		c.MaxConns = 100_000
	}
	if c.MaxPacketBytes <= 0 {
		c.MaxPacketBytes = kettle.MaxBody + 4<<10
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = 10 * time.Second
	}
	if c.SessionExpiry <= 0 {
		c.SessionExpiry = time.Hour
	}
	if c.ShutdownTimeout <= 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.CommandTick <= 0 {
		c.CommandTick = time.Second
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = 10 * time.Second
	}
	if c.ConnWindow <= 0 || c.ConnWindow > receiveMaximum {
		c.ConnWindow = min(16, receiveMaximum)
	}

}

// receiveMaximum is the Receive Maximum announced to MQTT 5 kettles.
const receiveMaximum = 32

// Broker is the running embedded MQTT listener.
type Broker struct {
	cfg      Config
	srv      *mqtt.Server
	ln       *listener
	push     *pusher
	counters *Counters
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	// rows is the budget of readings waiting for their commit
	// (Config.MaxPendingRows); inflight counts their goroutines.
	rows     *rowBudget
	inflight sync.WaitGroup
	bg       sync.WaitGroup // background loops other than the pusher (trimStacks)
	// Lines kettles can cause at any rate, thinned (logthin): invalid
	// payloads, refused connections.
	badLog, refusedLog logthin.Limiter
	// shedLog: at most one line a second about capacity refusals, with
	// their count since the last one.
	shedLog logthin.Limiter
	// dev is the device-only engine's state (nil: mochi's, srv).
	dev *devServer
}

// Start listens on cfg.Addr and serves kettles until Close. It returns once
// the listener is bound.
func Start(ctx context.Context, cfg Config, svc Fleet, secret []byte, log *slog.Logger) (*Broker, error) {
	cfg.defaults()
	switch cfg.Engine {
	case "", EngineDevice:
		return startDevice(ctx, cfg, svc, secret, log)
	case EngineMochi:
	default:
		return nil, fmt.Errorf("mqtt engine %q: want %q or %q (--mqtt-engine)", cfg.Engine, EngineDevice, EngineMochi)
	}
	caps := mqtt.NewDefaultServerCapabilities()
	caps.MaximumClients = int64(cfg.MaxConns)
	caps.MaximumPacketSize = uint32(cfg.MaxPacketBytes)
	caps.MaximumSessionExpiryInterval = uint32(cfg.SessionExpiry / time.Second)
	caps.MaximumMessageExpiryInterval = int64(cfg.SessionExpiry / time.Second)
	// Per-connection queues sized for a kettle, not a general broker: a
	// kettle receives only its own commands.
	caps.MaximumClientWritesPending = 8
	caps.MaximumInflight = 16
	// QoS ≤ 1 in, QoS 0 out (commands): no message ever stays in a
	// client's inflight map, which mochi v2.7.9 can deadlock (doc.go).
	caps.MaximumQos = 1
	caps.ReceiveMaximum = receiveMaximum
	caps.TopicAliasMaximum = 4
	caps.WildcardSubAvailable = 0
	caps.SharedSubAvailable = 0
	caps.SubIDAvailable = 0

	b := newBroker(ctx, cfg, svc, log)
	b.srv = mqtt.New(&mqtt.Options{
		Capabilities: caps,
		// Kept per connection for its life: a kettle's PUBLISH of one
		// reading (~300 bytes) fits in one read; bigger packets are read
		// straight into their own buffer past it.
		ClientNetReadBufferSize:  512,
		ClientNetWriteBufferSize: 1024,
		SysTopicResendInterval:   3600,
		InlineClient:             true,
		Logger:                   slog.New(minLevel{log.Handler(), slog.LevelError}),
	})
	if err := slowHousekeeping(b.srv); err != nil {
		log.Warn("mqtt: could not slow mochi's once-a-second scans of every client; they cost CPU per connection", "err", err)
	}
	b.push = newPusher(svc, log, b.counters, cfg.CommandTick, false, func(id kettle.DeviceID, body []byte) error {
		// QoS 0: queued on the kettle's connection without blocking and
		// without touching its inflight map or its lock; a full queue
		// calls OnPublishDropped, which schedules a retry.
		return b.srv.Publish(CommandTopic(id), body, false, 0)
	})
	h := &hook{b: b, svc: svc, secret: secret, live: make(map[string]*mqtt.Client)}
	if err := b.srv.AddHook(h, nil); err != nil {
		return nil, err
	}
	b.ln = &listener{id: "kettles", addr: cfg.Addr, log: log, connectTimeout: cfg.ConnectTimeout, writeTimeout: cfg.WriteTimeout, maxConns: int64(cfg.MaxConns), tls: cfg.TLS, tlsFailed: cfg.TLSHandshakeFailed, panics: &b.counters.Malformed}
	b.ln.closeAll = func() {
		for _, cl := range b.srv.Clients.GetAll() { // one read lock (see listener.closeAll)
			if cl.Net.Listener == b.ln.id && !cl.Closed() {
				_ = b.srv.DisconnectClient(cl, packets.ErrServerShuttingDown)
			}
		}
	}
	b.ln.ended = h.repairTakeover
	b.ln.overCap = func(version byte) packets.Packet { return b.shed(ShedQuota, version) }
	b.ln.refusing = make(chan struct{}, maxRefusing)
	if err := b.srv.AddListener(b.ln); err != nil {
		return nil, fmt.Errorf("mqtt: listen on %s: %w (is another kettle serve running? choose --mqtt-addr)", cfg.Addr, err)
	}
	if err := b.srv.Serve(); err != nil {
		b.srv.Close()
		return nil, fmt.Errorf("mqtt: serve: %w", err)
	}
	go b.push.run(b.ctx)
	if cfg.StackTrim > 0 {
		b.bg.Add(1)
		go func() { defer b.bg.Done(); b.trimStacks(b.ctx, cfg.StackTrim) }()
	}
	log.Info("mqtt listener started", "addr", b.Addr(), "max_conns", cfg.MaxConns, "max_packet_bytes", cfg.MaxPacketBytes)
	return b, nil
}

// newBroker is the state both engines share.
func newBroker(ctx context.Context, cfg Config, svc Fleet, log *slog.Logger) *Broker {
	if cfg.MaxPendingRows <= 0 {
		cfg.MaxPendingRows = max(svc.Config().QueueRows/2, 1)
	}
	b := &Broker{cfg: cfg, counters: new(Counters), log: log, rows: newRowBudget(cfg.MaxPendingRows),
		badLog: logthin.Limiter{Burst: 10}, refusedLog: logthin.Limiter{Burst: 10}, shedLog: logthin.Limiter{Burst: 1}}
	b.counters.MaxConns.Store(int64(cfg.MaxConns))
	b.ctx, b.cancel = context.WithCancel(context.WithoutCancel(ctx))
	return b
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
func (b *Broker) Addr() string { return b.ln.Address() }

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
	var err error
	if b.dev != nil {
		b.dev.close()
	} else {
		err = b.srv.Close()
	}
	if !b.ln.wait(b.cfg.ShutdownTimeout) {
		b.log.Warn("mqtt: connections still open after shutdown timeout", "timeout", b.cfg.ShutdownTimeout)
	}
	if b.dev != nil {
		b.dev.stopPoll()
	}
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
	if b.dev != nil {
		b.dev.wg.Wait() // command pushes and takeover DISCONNECTs: each bounded by a write deadline
	}
	b.log.Info("mqtt listener stopped", "counters", b.counters.Snapshot())
	return err
}

// hook is the kettle's view of the broker: authentication, ACL, ingest and
// command delivery.
type hook struct {
	mqtt.HookBase
	b      *Broker
	svc    Fleet
	secret []byte

	// live is each device's latest established session (repairTakeover).
	liveMu sync.Mutex
	live   map[string]*mqtt.Client
}

func (h *hook) ID() string { return "kettlefleet" }

func (h *hook) Provides(b byte) bool {
	return bytes.Contains([]byte{
		mqtt.OnConnect, mqtt.OnConnectAuthenticate, mqtt.OnACLCheck,
		mqtt.OnSessionEstablished, mqtt.OnDisconnect,
		mqtt.OnPublish, mqtt.OnSubscribe, mqtt.OnSubscribed, mqtt.OnUnsubscribed,
		mqtt.OnRetainPublished, mqtt.OnPublishDropped,
	}, []byte{b})
}

// OnConnect authenticates: username = device id (canonical UUID text),
// password = that device's token. Refusals get their own CONNACK code here
// (mochi's authenticate hook can only say 0x86): 0x86/0x04 for a bad
// username or password, 0x87/0x05 for another device's valid token, 0x85/0x02
// for a client id that is neither empty nor the device id, 0x83/0x05 for a
// Will message.
func (h *hook) OnConnect(cl *mqtt.Client, pk packets.Packet) error {
	uid, which, code := h.authenticate(pk, cl.Net.Remote)
	if code != packets.CodeSuccess {
		_ = h.b.srv.SendConnack(cl, refusal(code, cl.Properties.ProtocolVersion), false, nil)
		return code
	}
	user := uid.String()
	if h.b.cfg.Shedding != nil && h.b.cfg.Shedding() {
		ack := h.b.shed(ShedBusy, cl.Properties.ProtocolVersion)
		_ = h.b.srv.SendConnack(cl, packets.Code{Code: ack.ReasonCode, Reason: ack.Properties.ReasonString}, false, &ack.Properties)
		return packets.ErrServerBusy
	}
	if which == 1 && h.b.cfg.OnPreviousCredential != nil {
		h.b.cfg.OnPreviousCredential("device", uid)
	}
	// One session per device, keyed by its id.
	if cl.ID != user {
		cl.ID = user
		if cl.Properties.ProtocolVersion == 5 {
			cl.Properties.Props.AssignedClientID = user
		}
	}
	// A reconnect takes over the device's session, and mochi first writes
	// the old connection a DISCONNECT under that connection's lock. If the
	// old connection is stuck (its kettle stopped reading; typically why
	// it reconnects), a write holds that lock: give it takeoverGrace, not
	// WriteTimeout, so that CONNACK comes promptly.
	if old, ok := h.b.srv.Clients.Get(user); ok && old != cl {
		if c, ok := old.Net.Conn.(*conn); ok {
			c.cutWrites()
		}
	}
	return nil
}

// authenticate checks a CONNECT (both engines): it returns the device and
// which secret signed its token (0 current, 1 previous), or the refusal,
// counted and logged (thinned).
func (h *hook) authenticate(pk packets.Packet, remote string) (uid uuid.UUID, which int, code packets.Code) {
	code = packets.CodeSuccess
	user := string(pk.Connect.Username)
	uid, uerr := uuid.Parse(user)
	tokID, which := kettle.VerifyDeviceTokens(string(pk.Connect.Password), h.secret, h.b.cfg.PreviousSecret)
	ok := which >= 0
	switch {
	case !pk.Connect.UsernameFlag || !pk.Connect.PasswordFlag || uerr != nil || uid.String() != user || !ok:
		code = packets.ErrBadUsernameOrPassword
	case tokID != uid || h.svc.Revoked(uid):
		code = packets.ErrNotAuthorized
	case pk.Connect.ClientIdentifier != "" && pk.Connect.ClientIdentifier != user:
		code = packets.ErrClientIdentifierNotValid
	case pk.Connect.WillFlag:
		// mochi publishes a Will (and retains it, if asked) without the
		// ACL check: a kettle could send any kettle's command topic a
		// forged command, or leave retained messages on topics of its
		// choosing, one per connection, never freed for an hour.
		code = errWillRefused
	}
	if code != packets.CodeSuccess {
		h.b.counters.ConnectsRefused.Add(1)
		if ok, skipped := h.b.refusedLog.Allow(time.Now()); ok {
			h.b.log.Info("mqtt: connection refused", "remote", remote, "username", truncate(user, 64), "reason", code.Reason, "refusals_not_logged_since_last_line", skipped)
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

// OnConnectAuthenticate: OnConnect already refused anything else.
func (h *hook) OnConnectAuthenticate(cl *mqtt.Client, pk packets.Packet) bool { return true }

// OnACLCheck lets a kettle write only its measurements topic and read only
// its command topic (exact names: no wildcards).
func (h *hook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
	if cl.Net.Inline {
		return true
	}
	suffix := "/command"
	if write {
		suffix = "/measurements"
	}
	user := cl.Properties.Username
	if id, err := uuid.ParseBytes(user); err != nil || h.svc.Revoked(id) {
		h.b.counters.ACLDenied.Add(1) // revoked while connected: nothing more in or out
		return false
	}
	ok := len(topic) == len("kettles/")+len(user)+len(suffix) &&
		topic[:8] == "kettles/" && topic[8:8+len(user)] == string(user) && topic[8+len(user):] == suffix
	if !ok {
		h.b.counters.ACLDenied.Add(1)
	}
	return ok
}

func (h *hook) OnSessionEstablished(cl *mqtt.Client, pk packets.Packet) {
	h.b.counters.Connections.Add(1)
	if c, ok := cl.Net.Conn.(*conn); ok {
		c.clientID = cl.ID
	}
	h.liveMu.Lock()
	h.live[cl.ID] = cl
	h.restore(cl) // a predecessor that ended just now may have removed it
	h.liveMu.Unlock()
	// A resumed session keeps its subscription without a new SUBSCRIBE:
	// push the current command to it.
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil {
		return
	}
	if _, ok := cl.State.Subscriptions.Get(CommandTopic(id)); ok {
		h.b.push.track(id, cl, 0, 0)
	}
}

func (h *hook) OnDisconnect(cl *mqtt.Client, err error, expire bool) {
	h.b.counters.Connections.Add(-1)
	h.liveMu.Lock()
	if h.live[cl.ID] == cl {
		delete(h.live, cl.ID)
	}
	h.liveMu.Unlock()
	if id, perr := uuid.ParseBytes(cl.Properties.Username); perr == nil {
		// A session taken over ends after its successor began (e.g. once
		// its pending ingest returned): the successor's subscription and
		// retained command are not this connection's to remove.
		if h.b.push.untrack(id, cl) {
			h.b.srv.Topics.RetainMessage(packets.Packet{TopicName: CommandTopic(id)}) // a retained command not yet delivered
		}
	}
}

// repairTakeover runs once the broker library is done with a connection's
// session. mochi v2.7.9 decides whether an ending session was taken over
// (cl.IsTakenOver) and only afterwards removes it from its client map and
// topic index, both keyed by the client id it shares with its successor: a
// kettle that reconnects while its old session ends (its connection died
// just as it reconnected) can have its new session deleted from the map
// (nothing is delivered to it any more) or its fresh subscription removed,
// and never learns. The damage is done before the old session's end
// (repairTakeover) or the new one's start (OnSessionEstablished), whichever
// comes last: both put the device's latest session back.
func (h *hook) repairTakeover(c *conn) {
	if c.clientID == "" {
		return // refused, or never established
	}
	h.liveMu.Lock()
	if succ := h.live[c.clientID]; succ != nil && succ.Net.Conn != net.Conn(c) {
		h.restore(succ)
	}
	h.liveMu.Unlock()
}

// restore puts cl, a device's latest session, back into mochi's client map
// and topic index if an earlier session's end removed it. h.liveMu held: the
// session's own end (OnDisconnect) waits, so it cannot be put back after.
func (h *hook) restore(cl *mqtt.Client) {
	if cl.Closed() {
		return
	}
	restored := false
	if _, ok := h.b.srv.Clients.Get(cl.ID); !ok {
		h.b.srv.Clients.Add(cl)
		restored = true
	}
	for _, sub := range cl.State.Subscriptions.GetAll() {
		if h.b.srv.Topics.Subscribe(cl.ID, sub) {
			atomic.AddInt64(&h.b.srv.Info.Subscriptions, 1)
			restored = true
		}
	}
	if restored {
		h.b.counters.TakeoverRepairs.Add(1)
		h.b.log.Debug("mqtt: put a device's new session back after its old one ended", "client", cl.ID)
	}
}

// OnSubscribe puts the device's current command in place as a retained
// message just before mochi checks the ACL and answers SUBACK; mochi then
// delivers it after the SUBACK and OnRetainPublished removes it again, so no
// retained copy is kept per device (changes are pushed live).
func (h *hook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if cl.Net.Inline {
		return pk
	}
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil {
		return pk
	}
	topic := CommandTopic(id)
	for _, f := range pk.Filters {
		if f.Filter != topic {
			continue
		}
		body, hash, next := commandJSON(h.svc, id)
		h.b.srv.Topics.RetainMessage(packets.Packet{
			FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 0, Retain: true}, // QoS 0: see Start
			TopicName:   topic,
			Payload:     body,
			Origin:      mqtt.InlineClientId,
			Created:     time.Now().Unix(),
		})
		h.b.push.track(id, cl, hash, next)
		h.b.counters.CommandsPushed.Add(1)
		break
	}
	return pk
}

func (h *hook) OnSubscribed(cl *mqtt.Client, pk packets.Packet, codes []byte) {
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil {
		return
	}
	topic := CommandTopic(id)
	for i, f := range pk.Filters {
		if f.Filter == topic && i < len(codes) && codes[i] >= 0x80 {
			h.b.push.untrack(id, cl) // tracked in OnSubscribe, but refused after all
			h.b.srv.Topics.RetainMessage(packets.Packet{TopicName: topic})
		}
	}
}

func (h *hook) OnUnsubscribed(cl *mqtt.Client, pk packets.Packet) {
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil {
		return
	}
	topic := CommandTopic(id)
	for _, f := range pk.Filters {
		if f.Filter == topic {
			h.b.push.untrack(id, cl)
		}
	}
}

func (h *hook) OnRetainPublished(cl *mqtt.Client, pk packets.Packet) {
	h.b.srv.Topics.RetainMessage(packets.Packet{TopicName: pk.TopicName})
}

// OnPublishDropped: a command did not fit the kettle's write queue
// (MaximumClientWritesPending; the kettle is not reading). Nothing waits for
// it: the pusher publishes the then-current command again when due, and a
// kettle that stays stuck is disconnected by the write timeout.
func (h *hook) OnPublishDropped(cl *mqtt.Client, pk packets.Packet) {
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil || pk.TopicName != CommandTopic(id) {
		return
	}
	h.b.counters.CommandsDropped.Add(1)
	h.b.push.dropped(id, cl)
}

// OnPublish runs on the connection's read goroutine after the ACL check:
// decode, validate, ingest, and only then let mochi write the PUBACK.
// Blocking here is the backpressure: the connection is not read meanwhile.
func (h *hook) OnPublish(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	if cl.Net.Inline {
		return pk, nil // our own command publishes
	}
	qos := pk.FixedHeader.Qos
	h.b.counters.Publishes[min(int(qos), 2)].Add(1)
	id, err := uuid.ParseBytes(cl.Properties.Username)
	if err != nil { // cannot happen after OnConnect
		return pk, packets.ErrRejectPacket
	}
	// Over --device-rate the connection is not read until the kettle is
	// within it again: TCP slows the kettle down, nothing is refused or lost.
	if wait := h.svc.Pace(id); wait > 0 && !h.b.sleep(wait) {
		return pk, packets.ErrRejectPacket // shutting down: no PUBACK, the client redelivers
	}
	c, _ := cl.Net.Conn.(*conn)
	pipelined := qos > 0 && c != nil
	ms, err := wire.DecodeV1(pk.Payload, id, h.svc.Window())
	if err != nil {
		h.b.counters.Invalid.Add(1)
		if ok, skipped := h.b.badLog.Allow(time.Now()); ok {
			h.b.log.Warn("mqtt: invalid measurement payload", "device", id, "qos", qos, "protocol", cl.Properties.ProtocolVersion, "err", truncate(err.Error(), maxLoggedError), "invalid_not_logged_since_last_line", skipped)
		}
		code := packets.CodeSuccessIgnore // 3.1.1: acknowledged (QoS ≥ 1) and dropped
		if cl.Properties.ProtocolVersion == 5 && qos > 0 {
			code = packets.Code{Code: packets.ErrPayloadFormatInvalid.Code, Reason: truncate(err.Error(), 256)}
		}
		if !pipelined {
			return pk, code
		}
		// Its PUBACK still waits for those of earlier messages.
		a := c.acker(h.b.cfg.ConnWindow)
		if !h.b.acquire(cl, a, 1) {
			return pk, packets.ErrRejectPacket
		}
		h.b.complete(mochiConn{cl}, a, a.enqueue(pk.PacketID, 1, pk.Properties.User), packets.Code{Code: code.Code, Reason: code.Reason}, false)
		return pk, packets.ErrRejectPacket
	}
	if !pipelined {
		if !h.ingest(cl, ms, qos) {
			return pk, packets.ErrRejectPacket
		}
		return pk, packets.CodeSuccessIgnore // committed; mochi writes the PUBACK (QoS ≥ 1)
	}
	// QoS 1, pipelined (ack.go): ingest on its own goroutine, PUBACK in
	// arrival order after the commit; this connection is read on meanwhile,
	// within its window.
	a := c.acker(h.b.cfg.ConnWindow)
	if !h.b.acquire(cl, a, len(ms)) {
		h.b.counters.Unacked.Add(1)
		return pk, packets.ErrRejectPacket // shutting down or gone: no PUBACK, the client redelivers
	}
	p := a.enqueue(pk.PacketID, len(ms), pk.Properties.User)
	h.b.inflight.Add(1)
	go func() {
		defer h.b.inflight.Done()
		ok := h.ingest(cl, ms, qos)
		h.b.complete(mochiConn{cl}, a, p, packets.CodeSuccess, !ok)
	}()
	return pk, packets.ErrRejectPacket // mochi writes nothing; complete does
}

// ingest hands readings to the fleet service and returns once they are
// committed (true), retrying with jittered backoff while ingest is
// unavailable (queue full, store down) for QoS ≥ 1; false: not committed
// (QoS 0 dropped, or given up at shutdown or when the client left).
func (h *hook) ingest(cl closer, ms []kettle.Measurement, qos byte) bool {
	withheld := false
	backoff := 20 * time.Millisecond
	for {
		_, _, err := h.svc.Ingest(h.b.ctx, ms)
		if err == nil {
			break
		}
		if qos == 0 {
			h.b.counters.Dropped.Add(1)
			return false
		}
		if !withheld {
			withheld = true
			h.b.counters.Withheld.Add(1)
		}
		maxWait := time.Second
		var ke *kettle.Error
		if errors.As(err, &ke) && ke.RetryAfter > 0 {
			maxWait = ke.RetryAfter
		}
		backoff = min(backoff*2, maxWait)
		wait := backoff/2 + rand.N(backoff/2+1) // jitter: blocked kettles do not retry in step
		if !h.b.sleep(wait) {
			return false // shutting down: no PUBACK, the client redelivers elsewhere
		}
		if cl.Closed() {
			h.b.counters.Unacked.Add(1)
			return false // client gone: it redelivers on reconnect
		}
	}
	h.b.counters.Readings.Add(int64(len(ms)))
	return true
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

// minLevel drops mochi's records below a level (it logs every refused
// connection at Warn; we count and log those ourselves).
type minLevel struct {
	slog.Handler
	min slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.Handler.Enabled(ctx, l)
}
func (m minLevel) WithAttrs(a []slog.Attr) slog.Handler {
	return minLevel{m.Handler.WithAttrs(a), m.min}
}
func (m minLevel) WithGroup(n string) slog.Handler { return minLevel{m.Handler.WithGroup(n), m.min} }
