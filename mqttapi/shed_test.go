package mqttapi_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	mqtt3 "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// connect5 connects device id with paho (MQTT 5) and returns the CONNACK's
// reason code and server reference.
func connect5(t *testing.T, addr string, id uuid.UUID) (reason byte, ref string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl := paho.NewClient(paho.ClientConfig{Conn: conn, ClientID: id.String()})
	ca, err := cl.Connect(ctx, &paho.Connect{ClientID: id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))})
	if ca == nil {
		t.Fatalf("MQTT 5 connect: no CONNACK: %v", err)
	}
	if ca.ReasonCode == 0 {
		_ = cl.Disconnect(&paho.Disconnect{})
	}
	if ca.Properties != nil {
		ref = ca.Properties.ServerReference
	}
	return ca.ReasonCode, ref
}

// connect3 connects device id with paho (MQTT 3.1.1) and returns the
// CONNACK's return code.
func connect3(t *testing.T, addr string, id uuid.UUID) byte {
	t.Helper()
	opts := mqtt3.NewClientOptions().AddBroker("tcp://" + addr).SetProtocolVersion(4).SetClientID(id.String()).
		SetUsername(id.String()).SetPassword(kettle.DeviceToken(secret, id)).SetCleanSession(true).
		SetAutoReconnect(false).SetConnectRetry(false).SetConnectTimeout(10 * time.Second)
	cl := mqtt3.NewClient(opts)
	tok := cl.Connect()
	if !tok.WaitTimeout(15 * time.Second) {
		t.Fatal("MQTT 3.1.1 connect: no CONNACK within 15 s")
	}
	ct := tok.(*mqtt3.ConnectToken)
	if ct.ReturnCode() == 0 {
		cl.Disconnect(0)
	} else if tok.Error() == nil {
		t.Fatalf("MQTT 3.1.1 connect: return code %d without an error", ct.ReturnCode())
	}
	return ct.ReturnCode()
}

// TestRefusedWithReason: over the connection cap, or while the node sheds
// load, a kettle gets a CONNACK that says why (MQTT 5: 0x97, 0x89, or 0x9C
// with the server reference; 3.1.1: 0x03), never a bare close; refusals are
// counted by reason and logged at most once a second.
func TestRefusedWithReason(t *testing.T) {
	f := func(name string, mc mqttapi.Config, hold int, want5 byte, wantRef string, why mqttapi.ShedReason) {
		t.Run(name, func(t *testing.T) {
			var logBuf syncbuf.Buffer
			log := slog.New(slog.NewTextHandler(&logBuf, nil))
			e := startWith(t, fleet.Config{}, mc, log)
			for range hold {
				c, err := connectAndSubscribe(e.broker.Addr())
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
			}
			t0 := time.Now()
			const n = 5
			for range n {
				if got, ref := connect5(t, e.broker.Addr(), uuid.New()); got != want5 || ref != wantRef {
					t.Errorf("MQTT 5 CONNACK = %#x, server reference %q; want %#x, %q", got, ref, want5, wantRef)
				}
				if got := connect3(t, e.broker.Addr(), uuid.New()); got != 0x03 {
					t.Errorf("MQTT 3.1.1 CONNACK = %#x, want 0x03 (server unavailable)", got)
				}
			}
			elapsed := time.Since(t0)
			s := e.broker.Counters().Snapshot()
			if s.Shed[why] != 2*n {
				t.Errorf("Shed[%s] = %d, want %d (all: %v)", mqttapi.ShedReasonNames[why], s.Shed[why], 2*n, s.Shed)
			}
			if s.MaxConns != int64(mc.MaxConns) && mc.MaxConns > 0 {
				t.Errorf("MaxConns = %d, want %d", s.MaxConns, mc.MaxConns)
			}
			lines := strings.Count(logBuf.String(), "connections refused for capacity")
			if maxLines := 1 + int(elapsed/time.Second); lines < 1 || lines > maxLines {
				t.Errorf("%d log lines about capacity refusals in %v, want 1..%d:\n%s", lines, elapsed, maxLines, logBuf.String())
			}
			if !strings.Contains(logBuf.String(), "reason="+mqttapi.ShedReasonNames[why]) {
				t.Errorf("log lacks reason=%s:\n%s", mqttapi.ShedReasonNames[why], logBuf.String())
			}
		})
	}
	f("over the cap", mqttapi.Config{MaxConns: 2}, 2, 0x97, "", mqttapi.ShedQuota)
	f("over the cap, redirected", mqttapi.Config{MaxConns: 1, ServerReference: "mqtt2.example.net:1883"}, 1, 0x9C, "mqtt2.example.net:1883", mqttapi.ShedRedirect)
	f("shedding", mqttapi.Config{Shedding: func() bool { return true }}, 0, 0x89, "", mqttapi.ShedBusy)
}

// TestReconnectStorm is make chaos's mqttstorm in small: a node near its
// cap takes many kettles connecting at once; every CONNECT gets a CONNACK
// (accepted up to the cap, 0x97 / 0x03 past it) within a bound, none a bare
// close, and the kettles already connected stay.
func TestReconnectStorm(t *testing.T) {
	const held, storm, maxConns = 40, 300, 60
	e := startWith(t, fleet.Config{}, mqttapi.Config{MaxConns: maxConns}, testLog(t))
	for range held {
		c, err := connectAndSubscribe(e.broker.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	var mu sync.Mutex
	codes := map[byte]int{}
	var slowest time.Duration
	var wg sync.WaitGroup
	for i := range storm {
		wg.Add(1)
		go func() {
			defer wg.Done()
			version := byte(5)
			if i%4 == 3 {
				version = 4
			}
			t0 := time.Now()
			c, code, err := rawConnect(e.broker.Addr(), uuid.New(), version)
			d := time.Since(t0)
			if err != nil {
				t.Errorf("kettle %d (MQTT %d): no CONNACK after %v: %v", i, version, d, err)
				return
			}
			mu.Lock()
			codes[code]++
			slowest = max(slowest, d)
			mu.Unlock()
			if code == 0 {
				t.Cleanup(func() { c.Close() })
			}
		}()
	}
	wg.Wait()
	t.Logf("CONNACK codes %v, slowest %v", codes, slowest)
	if codes[0] != maxConns-held || codes[0x97]+codes[0x03] != storm-(maxConns-held) {
		t.Errorf("CONNACK codes %v: want %d accepted, the rest 0x97 (MQTT 5) or 0x03 (3.1.1)", codes, maxConns-held)
	}
	if slowest > 5*time.Second {
		t.Errorf("slowest CONNACK %v, want ≤ 5s", slowest)
	}
	if got := e.broker.Counters().Connections.Load(); got != maxConns {
		t.Errorf("%d connections after the storm, want %d", got, maxConns)
	}
}

// rawConnect sends a kettle's CONNECT and returns the CONNACK's code (the
// connection stays open when it is 0).
func rawConnect(addr string, id uuid.UUID, version byte) (net.Conn, byte, error) {
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return nil, 0, err
	}
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: version}
	pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 60, ClientIdentifier: id.String(),
		UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))}
	var buf bytes.Buffer
	_ = pk.ConnectEncode(&buf)
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(buf.Bytes()); err != nil {
		c.Close()
		return nil, 0, err
	}
	hdr := make([]byte, 4) // CONNACK: type, length, flags, code (MQTT 5 properties follow)
	if _, err := io.ReadFull(c, hdr); err != nil {
		c.Close()
		return nil, 0, err
	}
	if hdr[0] != 0x20 {
		c.Close()
		return nil, 0, fmt.Errorf("want CONNACK, got % x", hdr)
	}
	if hdr[3] != 0 {
		c.Close()
	}
	return c, hdr[3], nil
}
