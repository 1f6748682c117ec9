package mqttapi_test

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// The 18k-kettle run: one connection dropped, its reconnects never got a
// CONNACK, and command pushes stopped for every kettle. These tests hold the
// server to the opposite: one kettle, however it misbehaves, costs only its
// own connection.

// pahoKettle connects device id as the swarm does (paho.golang, MQTT 5,
// clean start, Receive Maximum 4), subscribes to its command topic and
// returns the command payloads it receives.
func pahoKettle(t testing.TB, addr string, id kettle.DeviceID) (*paho.Client, <-chan []byte) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	cmds := make(chan []byte, 1000)
	cl := paho.NewClient(paho.ClientConfig{
		Conn: conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			select {
			case cmds <- pr.Packet.Payload:
			default:
			}
			return true, nil
		}},
		OnClientError: func(error) {},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	recvMax := uint16(4)
	if _, err := cl.Connect(ctx, &paho.Connect{
		ClientID: id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id)),
		Properties: &paho.ConnectProperties{ReceiveMaximum: &recvMax},
	}); err != nil {
		t.Fatalf("paho connect %s: %v", id, err)
	}
	t.Cleanup(func() { _ = cl.Disconnect(&paho.Disconnect{}) })
	if _, err := cl.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: mqttapi.CommandTopic(id), QoS: 1}}}); err != nil {
		t.Fatalf("paho subscribe %s: %v", id, err)
	}
	select {
	case <-cmds: // the command on subscribe
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no command on subscribe", id)
	}
	return cl, cmds
}

// setCharge overrides id's charge decision (a command change, hence a push).
func setCharge(t testing.TB, svc *fleet.Service, id kettle.DeviceID, charge bool) {
	t.Helper()
	now := time.Now()
	if err := svc.SetOverride(context.Background(), id, kettle.Override{Charge: &charge, ExpiresAt: now.Add(time.Hour), SetAt: now}); err != nil {
		t.Fatal(err)
	}
}

// pushArrives fails unless a command with charge=want reaches cmds within d.
func pushArrives(t testing.TB, what string, cmds <-chan []byte, want bool, d time.Duration) {
	t.Helper()
	needle := `"charge":false`
	if want {
		needle = `"charge":true`
	}
	deadline := time.After(d)
	for {
		select {
		case b := <-cmds:
			if strings.Contains(string(b), needle) {
				return
			}
		case <-deadline:
			t.Errorf("%s: no command push with %s within %s (pushes stalled?)", what, needle, d)
			return
		}
	}
}

// reconnectsPromptly dials a new connection as id (a takeover of its
// session, as after a dropped connection) and fails unless CONNACK 0 comes
// within d.
func reconnectsPromptly(t testing.TB, addr string, id kettle.DeviceID, d time.Duration) *raw {
	t.Helper()
	r := dial(t, addr, 5)
	start := time.Now()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}}
	pk.Connect = packets.ConnectParams{
		ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: id.String(),
		UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id)),
	}
	r.send(pk)
	ack, err := r.read(d)
	switch {
	case err != nil:
		t.Errorf("reconnect as %s: no CONNACK within %s: %v", id, d, err)
		return nil
	case ack.FixedHeader.Type != packets.Connack || ack.ReasonCode != 0:
		t.Errorf("reconnect as %s: got %+v, want CONNACK 0", id, ack)
		return nil
	}
	t.Logf("reconnect: CONNACK after %s", time.Since(start).Round(time.Millisecond))
	return r
}

// TestPushWhileKettleAcksSlowly is the 18k-kettle incident's pattern: a
// kettle (Receive Maximum 8, as paho sends) keeps one command
// unacknowledged and talks constantly while its command changes as fast as
// the store allows. In a general broker's outbound QoS 1 bookkeeping that
// interleaving of reads and pushes deadlocked the kettle's inflight map,
// and with it the push worker (no pushes for anyone) and the takeover of
// that session (no CONNACK). Other kettles must keep their pushes and the
// kettle must be able to reconnect.
func TestPushWhileKettleAcksSlowly(t *testing.T) {
	e := start(t, fleet.Config{})
	a, b := uuid.New(), uuid.New()
	if err := e.svc.RegisterIDs(context.Background(), []kettle.DeviceID{a, b}); err != nil {
		t.Fatal(err)
	}
	_, bCmds := pahoKettle(t, e.broker.Addr(), b)

	r := dial(t, e.broker.Addr(), 5)
	r.recvMax = 8
	if code := r.connect(a.String(), kettle.DeviceToken(secret, a), a.String()); code != 0 {
		t.Fatalf("connect: 0x%02x", code)
	}
	r.subscribe(1, mqttapi.CommandTopic(a))
	if pk := r.must(packets.Publish); pk.FixedHeader.Qos > 0 {
		t.Logf("command on subscribe at QoS %d, left unacknowledged", pk.FixedHeader.Qos)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // acknowledge every later push
		defer wg.Done()
		for {
			pk, err := r.read(100 * time.Millisecond)
			select {
			case <-stop:
				return
			default:
			}
			if err == nil && pk.FixedHeader.Type == packets.Publish && pk.FixedHeader.Qos > 0 {
				ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID, ProtocolVersion: 5}
				var buf bytes.Buffer
				_ = ack.PubackEncode(&buf)
				r.mu.Lock()
				r.conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
				_, err = r.conn.Write(buf.Bytes())
				r.mu.Unlock()
				if err != nil {
					t.Errorf("PUBACK: %v", err)
					return
				}
			}
		}
	}()
	go func() { // talk constantly: every packet read interleaves with the pushes
		defer wg.Done()
		// PUBACKs for a packet id never used: answered by nothing, so
		// the server reads as fast as we write.
		ping := make([]byte, 0, 4*64)
		for range 64 {
			ping = append(ping, packets.Puback<<4, 2, 0xEA, 0x60)
		}
		for {
			select {
			case <-stop:
				return
			default:
			}
			r.mu.Lock()
			r.conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
			_, err := r.conn.Write(ping)
			r.mu.Unlock()
			if err != nil && !isTimeout(err) {
				return
			}
		}
	}()
	charge := false
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
		charge = !charge
		setCharge(t, e.svc, a, charge)
	}
	close(stop)
	wg.Wait()

	setCharge(t, e.svc, b, false)
	pushArrives(t, "other kettle after the race", bCmds, false, 5*time.Second)
	r.conn.(*net.TCPConn).SetLinger(0)
	r.conn.Close()
	reconnectsPromptly(t, e.broker.Addr(), a, 5*time.Second)
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// dialSmallWindow dials with a tiny receive buffer, so that a client that
// stops reading fills the server's send path quickly.
func dialSmallWindow(t testing.TB, addr string) *raw {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = setRcvBuf(fd, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &raw{t: t, conn: conn, br: bufio.NewReader(conn), version: 5}
}

// TestStuckKettle: a subscribed kettle stops reading its socket until the
// server's writes to it block (its PUBACKs echo a few KiB of user
// properties, so the send path fills fast), while its socket stays open (a
// hung device, or a half-open connection). Command pushes to other kettles
// must go on, pushes to it must not wedge the worker, and its reconnect must
// get CONNACK promptly.
func TestStuckKettle(t *testing.T) {
	e := start(t, fleet.Config{})
	a, b := uuid.New(), uuid.New()
	if err := e.svc.RegisterIDs(context.Background(), []kettle.DeviceID{a, b}); err != nil {
		t.Fatal(err)
	}
	_, bCmds := pahoKettle(t, e.broker.Addr(), b)

	r := dialSmallWindow(t, e.broker.Addr())
	r.recvMax = 4
	if code := r.connect(a.String(), kettle.DeviceToken(secret, a), a.String()); code != 0 {
		t.Fatalf("connect: 0x%02x", code)
	}
	r.subscribe(1, mqttapi.CommandTopic(a))
	r.must(packets.Publish)
	// From here on the kettle never reads. Invalid QoS 1 publishes: each is
	// answered at once (PUBACK 0x99, no store involved) with its user
	// properties echoed.
	props := packets.Properties{User: []packets.UserProperty{{Key: "pad", Val: strings.Repeat("x", 4000)}}}
	var chunk bytes.Buffer
	for i := range 16 {
		pk := packets.Packet{
			FixedHeader:     packets.FixedHeader{Type: packets.Publish, Qos: 1},
			TopicName:       mqttapi.MeasurementTopic(a),
			PacketID:        uint16(10 + i),
			Payload:         []byte("[]"),
			Properties:      props,
			ProtocolVersion: 5,
		}
		if err := pk.PublishEncode(&chunk); err != nil {
			t.Fatal(err)
		}
	}
	// Filled once two writes in a row make no progress for 500 ms each: the
	// server no longer reads, its write to us is blocked (a merely slow
	// server, e.g. under -race, still takes some bytes).
	filled, stalls, off := false, 0, 0
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end) && !filled; {
		r.conn.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
		n, err := r.conn.Write(chunk.Bytes()[off:]) // resume a partial write: whole packets only
		off = (off + n) % chunk.Len()
		switch {
		case err == nil || n > 0:
			stalls = 0
		case !isTimeout(err):
			t.Fatal(err)
		default:
			stalls++
			filled = stalls == 2
		}
	}
	if !filled {
		t.Fatal("could not fill the connection within 20 s")
	}
	// Commands for the stuck kettle: its pushes cannot be written.
	for i := range 20 {
		setCharge(t, e.svc, a, i%2 == 0)
	}
	// Everyone else keeps their pushes.
	setCharge(t, e.svc, b, false)
	pushArrives(t, "other kettle while one is stuck", bCmds, false, 3*time.Second)
	// The stuck kettle's device reconnects (its old socket still open and
	// full): the takeover must not wait for the blocked write.
	r2 := reconnectsPromptly(t, e.broker.Addr(), a, 3*time.Second)
	if r2 == nil {
		return
	}
	r2.version = 5
	r2.subscribe(1, mqttapi.CommandTopic(a))
	cmd, _, err := r2.command(5 * time.Second)
	if err != nil {
		t.Fatalf("after reconnect: no command on subscribe: %v", err)
	}
	want, _ := e.svc.Command(a)
	if cmd["charge"] != want.Charge {
		t.Errorf("after reconnect: command %v, want charge %v", cmd, want.Charge)
	}
	setCharge(t, e.svc, b, true)
	pushArrives(t, "other kettle after the takeover", bCmds, true, 3*time.Second)
}

// TestReconnectWhileIngestBlocked: a kettle's QoS 1 message waits for its
// commit (the store is locked), its connection dies abruptly (RST, no
// DISCONNECT) and it reconnects with the same client id: CONNACK comes
// promptly, the new session gets its command on subscribe, and once the
// store is back the redelivered message is acknowledged and stored once.
func TestReconnectWhileIngestBlocked(t *testing.T) {
	e := start(t, fleet.Config{QueueRows: 2, BatchRows: 1})
	id := uuid.New()
	if err := e.svc.RegisterIDs(context.Background(), []kettle.DeviceID{id}); err != nil {
		t.Fatal(err)
	}
	r, _ := kettleConn(t, e.broker.Addr(), 5, id)
	r.subscribe(1, mqttapi.CommandTopic(id))
	if _, _, err := r.command(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	unlock := lockStore(t, e)
	at := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, reading(at, 42))
	if pk, err := r.read(500 * time.Millisecond); err == nil {
		t.Fatalf("packet while the store is locked: %+v", pk)
	}
	r.conn.(*net.TCPConn).SetLinger(0)
	r.conn.Close()

	r2 := reconnectsPromptly(t, e.broker.Addr(), id, 3*time.Second)
	if r2 == nil {
		unlock()
		return
	}
	r2.subscribe(1, mqttapi.CommandTopic(id))
	if _, _, err := r2.command(3 * time.Second); err != nil {
		t.Errorf("new session: no command on subscribe: %v", err)
	}
	r2.publish(mqttapi.MeasurementTopic(id), 1, 1, true, reading(at, 42)) // redelivery
	unlock()
	for {
		pk, err := r2.read(10 * time.Second)
		if err != nil {
			t.Fatalf("redelivery: no PUBACK: %v", err)
		}
		if pk.FixedHeader.Type == packets.Puback {
			if pk.ReasonCode != 0 {
				t.Fatalf("redelivery: PUBACK 0x%02x", pk.ReasonCode)
			}
			break
		}
	}
	if h := e.history(t, id); len(h) != 1 {
		t.Errorf("%d rows stored, want 1", len(h))
	}
	// The old session's OnDisconnect (after its commit) must not take the
	// new session's command subscription away. The committed reading may
	// have changed the command already (its push can come before the
	// PUBACK, skipped above): flip what it is now, so a push must follow.
	cur, _ := e.svc.Command(id)
	want := !cur.Charge
	setCharge(t, e.svc, id, want)
	for deadline := time.Now().Add(3 * time.Second); ; {
		cmd, _, err := r2.command(time.Until(deadline))
		if err != nil {
			t.Fatalf("new session after the old one ended: no push with charge %t: %v", want, err)
		}
		if cmd["charge"] == want {
			break
		}
	}
}

// lockStore holds the SQLite file's write lock (as another writer would)
// until the returned func is called: commits wait, ingest backs up.
func lockStore(t testing.TB, e *env) (unlock func()) {
	t.Helper()
	db, err := sql.Open("sqlite3", e.path)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(context.Background(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unlock = func() {
		once.Do(func() {
			if _, err := conn.ExecContext(context.Background(), "ROLLBACK"); err != nil {
				t.Error(err)
			}
			conn.Close()
			db.Close()
		})
	}
	t.Cleanup(unlock)
	return unlock
}
