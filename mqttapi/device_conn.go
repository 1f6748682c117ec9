package mqttapi

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// devConn is one kettle's connection and session.
type devConn struct {
	c *conn // per-write deadlines, the takeover cut, the acker (listener.go)
	d *devServer

	id        kettle.DeviceID
	version   byte
	keepalive uint16
	// expiry is how long the session outlives the connection (seconds;
	// 0: it ends with it): clean session 0 on 3.1.1, the session expiry
	// interval on MQTT 5, capped by Config.SessionExpiry.
	expiry uint32
	// maxOut is the kettle's Maximum Packet Size (MQTT 5; 0: none); a
	// packet larger is not sent (as mochi).
	maxOut uint32
	// noProblemInfo: the kettle asked for no reason strings or user
	// properties (MQTT 5 Request Problem Information 0).
	noProblemInfo bool
	// aliases holds the inbound topic aliases 1..topicAliasMaximum, two
	// bits each: 0 unset, 1 this kettle's measurements topic, 2 any other.
	aliases uint8

	closed     atomic.Bool
	subscribed atomic.Bool // to its command topic

	// wmu orders a command push after the SUBACK and command a
	// subscription sends (which holds it from computing the command to
	// writing it), so a kettle never ends on the older of two.
	wmu     sync.Mutex
	pend    atomic.Pointer[[]byte] // the newest command not yet written
	pushing atomic.Bool            // a flushPushes goroutine runs

	// due is when the kettle's next packet is overdue (unix ns; 0: never):
	// a connection held by the poller has no read waiting for it whose
	// deadline would end it (devServer.expire).
	due atomic.Int64
	// pollFD and pollGen: its registration with the poller; pollState:
	// who reads it (poll_linux.go).
	pollFD    int32
	pollGen   uint32
	pollState atomic.Uint32
}

// Closed reports whether the connection ended (or is being taken over).
func (dc *devConn) Closed() bool { return dc.closed.Load() }

// pingresp is the whole PINGRESP packet.
var pingresp = [2]byte{packets.Pingresp << 4, 0}

// serve is the connection's goroutine: its CONNECT, then, on Linux over
// plain TCP, it hands the connection to the poller and ends (poll_linux.go:
// no goroutine waits for an idle kettle). Otherwise it reads the
// connection's packets until it ends (readLoop).
func (dc *devConn) serve(tc *tls.Conn) {
	l := dc.d.b.ln
	if !dc.establish(tc) {
		_ = dc.c.Conn.Close()
		l.open.Add(-1)
		l.wg.Done()
		return
	}
	if p := dc.d.poll; p != nil && p.add(dc) {
		return // dc is the poller's now
	}
	dc.readLoop()
}

// readLoop reads the connection's packets until it ends: between packets
// it waits in readHdr, and nothing else runs on it: decoding, handling and
// writing happen in off, on a goroutine that ends with the packet. Every
// frame under that wait is small, so the stack stays at Go's 2 KiB: a
// goroutine that once grew to 4 KiB keeps it while blocked in a read (a
// stack shrinks only when three quarters of it are free, counting the
// runtime's 800-byte guard).
func (dc *devConn) readLoop() {
	hdr := new([2]byte)
	for dc.readHdr(hdr) == nil && dc.off(func() error {
		if err := dc.packet(*hdr, dc.c); err != nil {
			return err
		}
		return dc.refreshDeadline()
	}) == nil {
	}
	dc.finish()
}

// readOwn is the reading goroutine of a connection the failed poller
// handed back, under the keepalive deadline its last packet gave it.
func (dc *devConn) readOwn() {
	if due := dc.due.Load(); due != 0 {
		_ = dc.c.SetDeadline(time.Unix(0, due))
	}
	dc.readLoop()
}

// establish reads a trusted proxy's PROXY header, does the TLS handshake
// and the CONNECT, and reports whether a session was established.
func (dc *devConn) establish(tc *tls.Conn) bool {
	l := dc.d.b.ln
	if len(l.proxies) > 0 {
		nc := dc.c.Conn
		if tc != nil {
			nc = tc.NetConn()
		}
		if dc.off(func() (err error) { dc.c.remote, err = l.client(nc); return err }) != nil {
			return false
		}
	}
	if tc != nil && dc.off(func() error { return l.handshake(tc, dc.c.RemoteAddr()) }) != nil {
		return false
	}
	hdr := new([2]byte)
	if err := dc.readHdr(hdr); err != nil {
		// No CONNECT: nothing is owed (port scans, health checks), but a
		// kettle whose CONNECT never came in time is worth a line.
		if isTimeout(err) {
			dc.d.dropped(dc, "no CONNECT within the connect timeout", err)
		}
		return false
	}
	established := false
	if dc.off(func() error { established = dc.connect(*hdr); return nil }) != nil {
		return false
	}
	return established
}

// finish ends an established connection: its session, its socket and its
// count in the listener.
func (dc *devConn) finish() {
	l := dc.d.b.ln
	dc.end()
	l.open.Add(-1)
	l.wg.Done()
}

// readHdr reads a packet's first two bytes, its type and the first byte
// of its remaining length (every packet has both).
func (dc *devConn) readHdr(hdr *[2]byte) error {
	for n := 0; n < len(hdr); {
		k, err := dc.c.Conn.Read(hdr[n:])
		if err != nil {
			return err
		}
		n += k
	}
	return nil
}

// fixedHeader decodes the fixed header whose first two bytes are hdr,
// reading any further length bytes from r.
func fixedHeader(hdr [2]byte, r io.Reader) (packets.FixedHeader, error) {
	var fh packets.FixedHeader
	if err := fh.Decode(hdr[0]); err != nil {
		return fh, err
	}
	n, _, err := packets.DecodeLength(&lenReader{first: hdr[1], r: r})
	fh.Remaining = n
	return fh, err
}

// packet reads the rest of one packet from r (the connection, or a poller
// turn's buffer) into a pooled buffer and handles it.
func (dc *devConn) packet(hdr [2]byte, r io.Reader) error {
	fh, err := fixedHeader(hdr, r)
	if err != nil {
		return err
	}
	if fh.Remaining+1 > dc.d.b.cfg.MaxPacketBytes {
		return dc.violation(packets.ErrPacketTooLarge)
	}
	buf := getBuf(fh.Remaining)
	defer putBuf(buf)
	if _, err := io.ReadFull(r, *buf); err != nil {
		return err
	}
	switch fh.Type {
	case packets.Pingreq:
		_, err = dc.c.Write(pingresp[:])
	case packets.Puback, packets.Pubcomp:
		// Commands go out at QoS 0: no message of ours awaits these.
	default:
		err = dc.handle(fh, *buf)
	}
	return err
}

// refreshDeadline gives the kettle one and a half keepalives to send its
// next packet [MQTT-3.1.2-22] (keepalive 0: no deadline).
func (dc *devConn) refreshDeadline() error {
	var t time.Time
	if due := dc.nextDue(); due != 0 {
		t = time.Unix(0, due)
		dc.due.Store(due)
	}
	return dc.c.SetDeadline(t) // reads only (conn)
}

// nextDue is when the kettle's next packet is overdue if it sent one now
// (unix ns; 0: keepalive 0, never).
func (dc *devConn) nextDue() int64 {
	if dc.keepalive == 0 {
		return 0
	}
	return time.Now().Add(time.Duration(dc.keepalive) * 1500 * time.Millisecond).UnixNano()
}

// off runs f on a goroutine of its own and waits for it, so that the stack
// f grows leaves with that goroutine (device.go).
func (dc *devConn) off(f func() error) (err error) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		err = dc.guard(f)
	}()
	<-done
	return err
}

// guard runs f; a panic in f (mochi's decoder does not survive some
// malformed packets) ends only this connection.
func (dc *devConn) guard(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			dc.d.b.counters.Malformed.Add(1)
			dc.d.b.log.Error("mqtt: malformed packet crashed this connection's decoder; connection closed", "remote", dc.c.RemoteAddr().String(), "panic", fmt.Sprint(r))
			err = packets.ErrMalformedPacket
		}
	}()
	return f()
}

// write encodes pk for this kettle (its protocol version, packet size and
// problem-information wishes) and writes it in one Write.
func (dc *devConn) write(pk packets.Packet) error {
	var buf bytes.Buffer
	if err := dc.encode(&buf, pk); err != nil {
		return err
	}
	_, err := dc.c.Write(buf.Bytes())
	return err
}

// encode appends pk, as this kettle's connection sends it, to buf; a packet
// over the kettle's Maximum Packet Size is left out (ErrPacketTooLarge).
func (dc *devConn) encode(buf *bytes.Buffer, pk packets.Packet) error {
	pk.ProtocolVersion = dc.version
	pk.Mods.MaxSize = dc.maxOut
	pk.Mods.DisallowProblemInfo = dc.noProblemInfo
	pk.Mods.AllowResponseInfo = pk.FixedHeader.Type != packets.Connack
	n := buf.Len()
	if err := encodePacket(buf, &pk); err != nil {
		return err
	}
	if dc.maxOut > 0 && uint32(buf.Len()-n) > dc.maxOut {
		buf.Truncate(n)
		return packets.ErrPacketTooLarge // [MQTT-3.1.2-24]
	}
	return nil
}

// connect reads and handles the CONNECT (on off's goroutine): it answers
// every one with a CONNACK, or logs why it could not, and reports whether a
// session was established.
func (dc *devConn) connect(hdr [2]byte) bool {
	d, b := dc.d, dc.d.b
	if isProxyHeader(hdr) {
		// Only a trusted proxy's header is read (establish); anyone else's
		// claim to speak for a client is refused, and said so.
		d.b.ln.refuseProxy(dc.c.RemoteAddr(), "from a peer not in --trusted-proxies")
		return false
	}
	fh, err := fixedHeader(hdr, dc.c)
	if err != nil || fh.Type != packets.Connect {
		return false // not MQTT, or not a CONNECT first [MQTT-3.1.0-1]: nothing is owed
	}
	if fh.Remaining+1 > b.cfg.MaxPacketBytes {
		d.dropped(dc, "CONNECT larger than the largest packet accepted", packets.ErrPacketTooLarge)
		return false
	}
	buf := getBuf(fh.Remaining)
	defer putBuf(buf)
	if _, err := io.ReadFull(dc.c, *buf); err != nil {
		d.dropped(dc, "the CONNECT did not arrive whole within the connect timeout", err)
		return false
	}
	pk := packets.Packet{FixedHeader: fh}
	if err := pk.ConnectDecode(*buf); err != nil {
		dc.version = pk.ProtocolVersion
		if dc.version == 5 {
			_ = dc.write(connack(packets.ErrMalformedPacket, 5))
		}
		d.dropped(dc, "malformed CONNECT", err)
		return false
	}
	dc.version = pk.ProtocolVersion
	code := pk.ConnectValidate() // [MQTT-3.1.4-1]
	switch {
	case code != packets.CodeSuccess:
	case dc.version < 5 && !pk.Connect.Clean && pk.Connect.ClientIdentifier == "":
		code = packets.ErrUnspecifiedError // [MQTT-3.1.3-8]
	case pk.Connect.WillFlag && pk.Connect.WillQos > 1:
		code = packets.ErrQosNotSupported // [MQTT-3.2.2-12]
	}
	if code != packets.CodeSuccess {
		if v3, ok := packets.V5CodesToV3[code]; ok && dc.version < 5 {
			code = v3
		}
		if err := dc.write(connack(code, dc.version)); err != nil {
			d.dropped(dc, "its refusal ("+code.Reason+") could not be written", err)
		}
		return false
	}
	dc.maxOut = pk.Properties.MaximumPacketSize
	dc.noProblemInfo = pk.Properties.RequestProblemInfoFlag && pk.Properties.RequestProblemInfo == 0
	uid, which, code := b.authenticate(pk, dc.c.RemoteAddr().String())
	if code != packets.CodeSuccess {
		if err := dc.write(connack(refusal(code, dc.version), dc.version)); err != nil {
			d.dropped(dc, "its refusal ("+code.Reason+") could not be written", err)
		}
		return false
	}
	if b.cfg.Shedding != nil && b.cfg.Shedding() {
		if err := dc.write(b.shed(ShedBusy, dc.version)); err != nil {
			d.dropped(dc, "its refusal (server busy) could not be written", err)
		}
		return false
	}
	if which == 1 && b.cfg.OnPreviousCredential != nil {
		b.cfg.OnPreviousCredential("device", uid)
	}
	dc.id, dc.keepalive = uid, pk.Connect.Keepalive
	maxExpiry := uint32(b.cfg.SessionExpiry / time.Second)
	ack := connack(packets.CodeSuccess, dc.version)
	switch {
	case dc.version < 5 && !pk.Connect.Clean:
		dc.expiry = maxExpiry
	case dc.version == 5:
		dc.expiry = min(pk.Properties.SessionExpiryInterval, maxExpiry)
		if pk.Properties.SessionExpiryInterval > maxExpiry {
			ack.Properties.SessionExpiryInterval, ack.Properties.SessionExpiryIntervalFlag = maxExpiry, true
		}
		ack.Properties.MaximumQos, ack.Properties.MaximumQosFlag = 1, true // [MQTT-3.2.2-9]: QoS ≤ 1 (doc.go)
		if pk.Connect.ClientIdentifier == "" {
			ack.Properties.AssignedClientID = uid.String() // one session per device, keyed by its id
		}
	}
	present, ok := d.register(dc, pk.Connect.Clean)
	if !ok {
		_ = dc.write(connack(packets.ErrServerShuttingDown, dc.version))
		d.dropped(dc, "the listener is shutting down", nil)
		return false
	}
	b.counters.Connections.Add(1)
	ack.SessionPresent = present
	if err := dc.write(ack); err != nil {
		d.dropped(dc, "its CONNACK could not be written", err)
		return true // established: end() undoes it
	}
	if err := dc.refreshDeadline(); err != nil {
		return true
	}
	if present && dc.subscribed.Load() {
		// A resumed session keeps its subscription without a new
		// SUBSCRIBE: push the current command to it.
		b.push.track(dc.id, dc, 0, 0)
	}
	return true
}

// connack is a CONNACK with code; a refusal carries its reason (MQTT 5).
func connack(code packets.Code, version byte) packets.Packet {
	ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}, ProtocolVersion: version, ReasonCode: code.Code}
	ack.Properties.ReceiveMaximum = receiveMaximum
	if code.Code >= packets.ErrUnspecifiedError.Code {
		ack.Properties.ReasonString = code.Reason
	}
	return ack
}

// end undoes the session when the connection ends.
func (dc *devConn) end() {
	dc.closed.Store(true)
	_ = dc.c.Conn.Close()
	dc.d.unregister(dc)
	dc.d.b.push.untrack(dc.id, dc)
	dc.d.b.counters.Connections.Add(-1)
}

// kick ends the connection from elsewhere (takeover, shutdown): an MQTT 5
// kettle is told why (within takeoverGrace, on a goroutine of its own so
// that a kettle that stopped reading holds up nobody), then the socket is
// closed, which ends the reading goroutine.
func (dc *devConn) kick(code packets.Code) {
	if dc.closed.Swap(true) {
		return
	}
	dc.c.cutWrites()
	dc.d.wg.Add(1)
	go func() {
		defer dc.d.wg.Done()
		if dc.version == 5 {
			_ = dc.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: code.Code,
				Properties: packets.Properties{ReasonString: code.Reason}})
		}
		dc.c.abort()
	}()
}

// violation ends the connection for a protocol error: MQTT 5 gets a
// DISCONNECT with the reason (as mochi does), 3.1.1 a closed connection.
func (dc *devConn) violation(code packets.Code) error {
	if dc.version == 5 && !dc.closed.Load() {
		_ = dc.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: code.Code,
			Properties: packets.Properties{ReasonString: code.Reason}})
	}
	return code
}

// handle decodes and handles one packet (on off's goroutine).
func (dc *devConn) handle(fh packets.FixedHeader, body []byte) error {
	pk := packets.Packet{FixedHeader: fh, ProtocolVersion: dc.version}
	if err := decodePacket(&pk, body); err != nil {
		return err
	}
	switch fh.Type {
	case packets.Publish:
		if code := pk.PublishValidate(topicAliasMaximum); code != packets.CodeSuccess {
			return dc.violation(code)
		}
		return dc.publish(&pk)
	case packets.Subscribe:
		if code := pk.SubscribeValidate(); code != packets.CodeSuccess {
			return dc.violation(code)
		}
		return dc.subscribe(&pk)
	case packets.Unsubscribe:
		if code := pk.UnsubscribeValidate(); code != packets.CodeSuccess {
			return dc.violation(code)
		}
		return dc.unsubscribe(&pk)
	case packets.Disconnect:
		if pk.Properties.SessionExpiryIntervalFlag {
			if pk.Properties.SessionExpiryInterval > 0 && dc.expiry == 0 {
				return dc.violation(packets.ErrProtocolViolationZeroNonZeroExpiry)
			}
			dc.expiry = min(pk.Properties.SessionExpiryInterval, uint32(dc.d.b.cfg.SessionExpiry/time.Second))
		}
		return errDisconnected
	case packets.Pubrec: // nothing of ours is in flight at QoS 2
		return dc.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: pk.PacketID,
			ReasonCode: packets.ErrPacketIdentifierNotFound.Code})
	case packets.Pubrel: // QoS 2 comes in as QoS 1 (Maximum QoS 1): nothing to release
		return dc.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID,
			ReasonCode: packets.ErrPacketIdentifierNotFound.Code})
	case packets.Auth:
		if code := pk.AuthValidate(); code != packets.CodeSuccess {
			return dc.violation(code)
		}
		return nil // no enhanced authentication: ignored (as a broker without an auth hook does)
	case packets.Connect:
		return dc.violation(packets.ErrProtocolViolationSecondConnect) // [MQTT-3.1.0-2]
	}
	return nil
}

// topic resolves an inbound topic alias (MQTT 5): a kettle publishes to one
// topic only, so an alias records whether it names that one.
func (dc *devConn) topic(pk *packets.Packet, own string) string {
	a := pk.Properties.TopicAlias
	if !pk.Properties.TopicAliasFlag || a == 0 || a > topicAliasMaximum {
		return pk.TopicName
	}
	shift := 2 * (a - 1)
	if pk.TopicName != "" { // [MQTT-3.3.2-12]
		state := uint8(2)
		if pk.TopicName == own {
			state = 1
		}
		dc.aliases = dc.aliases&^(3<<shift) | state<<shift
		return pk.TopicName
	}
	switch dc.aliases >> shift & 3 {
	case 1:
		return own
	case 2:
		return "kettles/another/topic" // denied by the ACL below
	}
	return "" // an alias never set: dropped, as mochi does
}

// publish handles a kettle's PUBLISH: ACL, decode, validate,
// ingest, and the PUBACK after the commit, in arrival order (ack.go).
func (dc *devConn) publish(pk *packets.Packet) error {
	b := dc.d.b
	own := MeasurementTopic(dc.id)
	topic := dc.topic(pk, own)
	if !mqtt.IsValidFilter(topic, true) {
		return nil // mochi drops these silently ($SYS, wildcards, no topic)
	}
	qos := min(pk.FixedHeader.Qos, 1) // [MQTT-3.2.2-9] Maximum QoS 1
	if topic != own || b.svc.Revoked(dc.id) {
		b.counters.ACLDenied.Add(1) // revoked while connected: nothing more in or out
		switch {
		case qos == 0:
			return nil
		case dc.version < 5:
			return dc.violation(packets.ErrNotAuthorized) // 3.1.1 has no refusing PUBACK: the connection closes
		}
		return dc.ackInOrder(pk, packets.ErrNotAuthorized)
	}
	b.counters.Publishes[qos].Add(1)
	// Over --device-rate the connection is not read until the kettle is
	// within it again: TCP slows the kettle down, nothing is refused or lost.
	if wait := b.svc.Pace(dc.id); wait > 0 && !b.sleep(wait) {
		return nil // shutting down: no PUBACK, the client redelivers
	}
	ms, err := wire.DecodeV1(pk.Payload, dc.id, b.svc.Window())
	if err != nil {
		b.counters.Invalid.Add(1)
		if ok, skipped := b.badLog.Allow(time.Now()); ok {
			b.log.Warn("mqtt: invalid measurement payload", "device", dc.id, "qos", qos, "protocol", dc.version, "err", truncate(err.Error(), maxLoggedError), "invalid_not_logged_since_last_line", skipped)
		}
		if qos == 0 {
			return nil
		}
		code := packets.CodeSuccess // 3.1.1: acknowledged and dropped: a redelivery could never be stored
		if dc.version == 5 {
			code = packets.Code{Code: packets.ErrPayloadFormatInvalid.Code, Reason: truncate(err.Error(), 256)}
		}
		return dc.ackInOrder(pk, code)
	}
	if qos == 0 {
		b.ingest(dc, ms, 0) // on this connection's handling: the kettle's next packet waits for it
		return nil
	}
	// QoS 1, pipelined (ack.go): ingest on its own goroutine, PUBACK in
	// arrival order after the commit; this connection is read on meanwhile,
	// within its window.
	a := dc.c.acker(b.cfg.ConnWindow)
	if !b.acquire(dc, a, len(ms)) {
		b.counters.Unacked.Add(1)
		return nil // shutting down or gone: no PUBACK, the client redelivers
	}
	p := a.enqueue(pk.PacketID, len(ms), pk.Properties.User)
	b.inflight.Add(1)
	go func() {
		defer b.inflight.Done()
		ok := b.ingest(dc, ms, qos)
		b.complete(dc, a, p, packets.CodeSuccess, !ok)
	}()
	return nil
}

// ackInOrder answers a QoS 1 message at once with code, behind the PUBACKs
// of earlier messages still waiting for their commit.
func (dc *devConn) ackInOrder(pk *packets.Packet, code packets.Code) error {
	b := dc.d.b
	a := dc.c.acker(b.cfg.ConnWindow)
	if !b.acquire(dc, a, 1) {
		return nil
	}
	b.complete(dc, a, a.enqueue(pk.PacketID, 1, pk.Properties.User), code, false)
	return nil
}

// writeAcks writes due PUBACKs in order, in one Write (ackConn).
func (dc *devConn) writeAcks(due []*pendingAck) {
	var buf bytes.Buffer
	for _, h := range due {
		switch {
		case h.skip:
		case h.code.Code < packets.ErrUnspecifiedError.Code && len(h.user) == 0:
			// A plain success PUBACK is the same 4 bytes in 3.1.1 and 5.
			buf.Write([]byte{packets.Puback << 4, 2, byte(h.pid >> 8), byte(h.pid)})
		default:
			ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: h.pid, ReasonCode: h.code.Code}
			ack.Properties.User = h.user
			if h.code.Code >= packets.ErrUnspecifiedError.Code {
				ack.Properties.ReasonString = h.code.Reason // MQTT 5 only; dropped if the client asked for no problem info
			}
			_ = dc.encode(&buf, ack)
		}
	}
	if buf.Len() > 0 && !dc.Closed() {
		_, _ = dc.c.Write(buf.Bytes()) // a failed write closes the connection; the client redelivers
	}
}

// subscribe grants the kettle its own command topic only and sends the
// current command after the SUBACK, retained (the subscription's answer),
// in the same write.
func (dc *devConn) subscribe(pk *packets.Packet) error {
	b := dc.d.b
	own := CommandTopic(dc.id)
	codes := make([]byte, len(pk.Filters))
	deliver, granted := false, false
	for i, f := range pk.Filters {
		switch {
		case !mqtt.IsValidFilter(f.Filter, false):
			codes[i] = packets.ErrTopicFilterInvalid.Code
		case f.NoLocal && mqtt.IsSharedFilter(f.Filter):
			codes[i] = packets.ErrProtocolViolationInvalidSharedNoLocal.Code // [MQTT-3.8.3-4]
		case f.Filter != own || b.svc.Revoked(dc.id):
			b.counters.ACLDenied.Add(1)
			codes[i] = packets.ErrNotAuthorized.Code
		default:
			codes[i] = min(f.Qos, 1) // [MQTT-3.2.2-9]
			existed := dc.subscribed.Swap(true)
			granted = true
			deliver = deliver || !(f.RetainHandling == 2 || f.RetainHandling == 1 && existed) // [MQTT-3.3.1-10] [MQTT-3.3.1-11]
		}
		if codes[i] > packets.CodeGrantedQos2.Code && dc.version < 5 {
			codes[i] = packets.ErrUnspecifiedError.Code // 3.1.1: 0x80 failure
		}
	}
	var buf bytes.Buffer
	ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Suback}, PacketID: pk.PacketID, ReasonCodes: codes}
	ack.Properties.User = pk.Properties.User
	if err := dc.encode(&buf, ack); err != nil {
		return err
	}
	dc.wmu.Lock()
	defer dc.wmu.Unlock()
	if granted {
		body, hash, next := commandJSON(b.svc, dc.id)
		b.push.track(dc.id, dc, hash, next)
		if deliver {
			cmd := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Retain: true}, TopicName: own, Payload: body}
			if dc.encode(&buf, cmd) == nil {
				b.counters.CommandsPushed.Add(1)
			}
		}
	}
	_, err := dc.c.Write(buf.Bytes())
	return err
}

// unsubscribe ends the command subscription (UNSUBACK 0x11 for anything
// else: no such subscription).
func (dc *devConn) unsubscribe(pk *packets.Packet) error {
	own := CommandTopic(dc.id)
	codes := make([]byte, len(pk.Filters))
	for i, f := range pk.Filters {
		codes[i] = packets.CodeNoSubscriptionExisted.Code
		if f.Filter == own && dc.subscribed.Swap(false) {
			dc.d.b.push.untrack(dc.id, dc)
			codes[i] = packets.CodeSuccess.Code
		}
	}
	ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsuback}, PacketID: pk.PacketID, ReasonCodes: codes}
	ack.Properties.User = pk.Properties.User
	return dc.write(ack)
}

// flushPushes writes the newest pending command until none is left. It runs
// on a goroutine of its own (devServer.publish), one per connection at
// most, for as long as a write takes (at most the write timeout).
func (dc *devConn) flushPushes() {
	defer dc.d.wg.Done()
	for {
		if body := dc.pend.Swap(nil); body != nil && !dc.Closed() {
			dc.wmu.Lock()
			err := dc.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: CommandTopic(dc.id), Payload: *body})
			dc.wmu.Unlock()
			if err != nil && !errors.Is(err, packets.ErrPacketTooLarge) {
				// The connection is closed (conn.Write); its kettle gets
				// the current command when it subscribes again.
				dc.d.b.counters.CommandsDropped.Add(1)
			}
		}
		dc.pushing.Store(false)
		if dc.pend.Load() == nil || !dc.pushing.CompareAndSwap(false, true) {
			return
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
