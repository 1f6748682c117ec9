package mqttapi_test

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	mqtt3 "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"

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
