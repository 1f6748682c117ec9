package mqttapi_test

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestSessionResumed: a kettle with a persistent session (clean session 0)
// that reconnects — after its connection ended, or taking over one still
// open — is told its session is present and gets its current command
// without subscribing again; a clean one is told no session is present.
func TestSessionResumed(t *testing.T) {
	e := start(t, fleet.Config{})
	id := uuid.New()
	if err := e.svc.RegisterIDs(context.Background(), []kettle.DeviceID{id}); err != nil {
		t.Fatal(err)
	}
	persistent := func(version byte, clean bool) (*raw, packets.Packet) {
		t.Helper()
		r := dial(t, e.broker.Addr(), version)
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}}
		pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: clean, Keepalive: 30, ClientIdentifier: id.String(),
			UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))}
		if version == 5 && !clean {
			pk.Properties.SessionExpiryInterval, pk.Properties.SessionExpiryIntervalFlag = 600, true
		}
		r.send(pk)
		ack := r.must(packets.Connack)
		if ack.ReasonCode != 0 {
			t.Fatalf("v%d connect: 0x%02x", version, ack.ReasonCode)
		}
		return r, ack
	}
	// ended waits until the broker has ended every connection (the
	// session's end is handled before the count drops).
	ended := func(version byte, after string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); e.broker.Counters().Connections.Load() != 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("v%d: %d connections still open 10 s after %s", version, e.broker.Counters().Connections.Load(), after)
			}
		}
	}
	for _, version := range []byte{4, 5} {
		r, ack := persistent(version, false)
		r.subscribe(1, mqttapi.CommandTopic(id))
		if _, _, err := r.command(5 * time.Second); err != nil {
			t.Fatalf("v%d: no command on subscribe: %v", version, err)
		}
		// Taken over while open: present, the command comes again.
		r2, ack := persistent(version, false)
		if !ack.SessionPresent {
			t.Errorf("v%d takeover: session present = false, want true", version)
		}
		if _, _, err := r2.command(5 * time.Second); err != nil {
			t.Errorf("v%d takeover: no command on the resumed session: %v", version, err)
		}
		// The old connection is ended: at most a DISCONNECT (v5's session
		// taken over), then the end of the stream.
		for {
			pk, err := r.read(10 * time.Second)
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatalf("v%d: the connection taken over is still open after 10 s", version)
			}
			if err != nil {
				break
			}
			if pk.FixedHeader.Type != packets.Disconnect {
				t.Errorf("v%d: the old connection is still served: %+v", version, pk)
			}
		}
		// Ended, then resumed.
		r2.send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
		r2.conn.Close()
		r.conn.Close()
		ended(version, "disconnect")
		r3, ack := persistent(version, false)
		if !ack.SessionPresent {
			t.Errorf("v%d after disconnect: session present = false, want true", version)
		}
		if _, _, err := r3.command(5 * time.Second); err != nil {
			t.Errorf("v%d after disconnect: no command on the resumed session: %v", version, err)
		}
		r3.conn.Close()
		ended(version, "the resumed session's close")
		// Clean: no session.
		r4, ack := persistent(version, true)
		if ack.SessionPresent {
			t.Errorf("v%d clean: session present = true, want false", version)
		}
		if pk, err := r4.read(500 * time.Millisecond); err == nil {
			t.Errorf("v%d clean: got %+v without subscribing", version, pk)
		}
		r4.conn.Close()
	}
}

// TestConnectCutShort: a connection that ends inside its CONNECT gets no
// CONNACK (nobody is left to read it), and the node says so in its log
// (the storm's "closed without CONNACK" must have a reason on record).
func TestConnectCutShort(t *testing.T) {
	var buf syncbuf.Buffer
	e := startLog(t, fleet.Config{}, slog.New(slog.NewTextHandler(&buf, nil)))
	c := dial(t, e.broker.Addr(), 5)
	c.conn.Write([]byte{packets.Connect << 4, 100, 0, 4, 'M', 'Q'}) // 100 bytes announced, 4 sent
	c.conn.Close()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if strings.Contains(buf.String(), "connection closed without a CONNACK") {
			return
		}
	}
	t.Errorf("no log line for a CONNECT cut short:\n%s", buf.String())
}

// TestKeepalive: a kettle that goes quiet for more than one and a half
// keepalives is disconnected and its session ends; one that pings is kept.
func TestKeepalive(t *testing.T) {
	e := start(t, fleet.Config{})
	conn := func() *raw {
		t.Helper()
		id := uuid.New()
		r := dial(t, e.broker.Addr(), 5)
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}}
		pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 1, ClientIdentifier: id.String(),
			UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))}
		r.send(pk)
		if ack := r.must(packets.Connack); ack.ReasonCode != 0 {
			t.Fatalf("connect: 0x%02x", ack.ReasonCode)
		}
		return r
	}
	quiet, pinging := conn(), conn()
	began := time.Now()
	for time.Since(began) < 3*time.Second {
		pinging.send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
		pinging.must(packets.Pingresp)
		time.Sleep(500 * time.Millisecond)
	}
	if _, err := quiet.read(time.Second); err == nil || isTimeout(err) {
		t.Errorf("a kettle quiet for 3 s at keepalive 1 s: read %v, want the connection closed", err)
	}
	if got := e.broker.Counters().Connections.Load(); got != 1 {
		t.Errorf("Connections = %d, want 1 (the pinging kettle)", got)
	}
}
