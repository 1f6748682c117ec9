package server_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/wire"
)

// TestAuthChaosHTTP: over HTTP a kettle reads and writes only its own data
// and commands (v1 tokens and case-study cookies), and every operator
// endpoint refuses a device's credential.
func TestAuthChaosHTTP(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	a, b := uuid.New(), uuid.New()
	ta, tb := bearer(kettle.DeviceToken(srv.Secret(), a)), bearer(kettle.DeviceToken(srv.Secret(), b))
	for _, tok := range []map[string]string{ta, tb} {
		if r := c.do("POST", "/v1/measurements", tok, v1Body(time.Now().Add(-time.Minute), 100, 1000, 0, 20, 60, 500)); r.status != 200 {
			t.Fatalf("upload: %d %s", r.status, r.body)
		}
	}
	exp := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	override := fmt.Sprintf(`{"flush_ml_per_s":42,"expires_at":%q}`, exp)
	if r := c.do("PUT", "/v1/devices/"+b.String()+"/override", op, override); r.status != 200 {
		t.Fatalf("override on b: %d %s", r.status, r.body)
	}
	want := func(name string, method, path string, hdr map[string]string, body string, status int) {
		t.Helper()
		t.Run(name, func(t *testing.T) {
			r := c.do(method, path, hdr, body)
			if r.status != status {
				t.Fatalf("%s %s → %d, want %d (%s)", method, path, r.status, status, truncate(r.body))
			}
			if status >= 400 && (strings.Contains(string(r.body), "battery") || strings.Contains(string(r.body), "flush_ml")) {
				t.Fatalf("refused, but the answer carries data: %s", r.body)
			}
		})
	}
	want("v1/read-another-device", "GET", "/v1/devices/"+b.String(), ta, "", 403)
	want("v1/read-another-history", "GET", "/v1/devices/"+b.String()+"/measurements", ta, "", 403)
	want("v1/override-another-device", "PUT", "/v1/devices/"+b.String()+"/override", ta, override, 403)
	want("v1/clear-another-override", "DELETE", "/v1/devices/"+b.String()+"/override", ta, "", 403)
	want("v1/override-own-device", "PUT", "/v1/devices/"+a.String()+"/override", ta, override, 403)
	t.Run("v1/command-is-the-callers-own", func(t *testing.T) {
		var ca, cb wire.CommandJSON
		c.do("GET", "/v1/command", ta, "").json(t, &ca)
		c.do("GET", "/v1/command", tb, "").json(t, &cb)
		if ca.FlushMLPerS == 42 || cb.FlushMLPerS != 42 {
			t.Fatalf("a's command %+v, b's %+v: the override on b must reach b only", ca, cb)
		}
	})
	t.Run("v1/upload-is-stored-for-the-token-device", func(t *testing.T) {
		at := time.Now().Add(-10 * time.Minute).UTC().Truncate(time.Second)
		body := strings.Replace(v1Body(at, 1, 2, 3, 20, 60, 7), "{", fmt.Sprintf(`{"device_id":%q,"id":%q,`, b, b), 1)
		if r := c.do("POST", "/v1/measurements", ta, body); r.status != 200 {
			t.Fatalf("upload: %d", r.status)
		}
		var hb struct{ Measurements []httpapi.MeasurementJSON }
		c.do("GET", "/v1/devices/"+b.String()+"/measurements", op, "").json(t, &hb)
		for _, m := range hb.Measurements {
			if m.Time.Equal(at) {
				t.Fatal("a's upload naming b in the body was stored for b")
			}
		}
	})

	// Case-study cookies.
	a0, b0 := login(t, c), login(t, c)
	if r := c.do("PUT", "/v1/devices/"+b0+"/override", op, override); r.status != 200 {
		t.Fatalf("override on b0: %d", r.status)
	}
	t.Run("v0/command-is-the-callers-own", func(t *testing.T) {
		ra, rb := c.do("GET", "/command", cookie(a0), ""), c.do("GET", "/command", cookie(b0), "")
		if strings.Contains(string(ra.body), `"contents":42`) || !strings.Contains(string(rb.body), `"contents":42`) {
			t.Fatalf("a0 %s, b0 %s: the override on b0 must reach b0 only", ra.body, rb.body)
		}
	})

	// Operator endpoints: a device credential is refused, v1 token (403) or
	// case-study cookie (401), and so is nothing at all (401).
	id := a.String()
	type route struct{ method, path, body string }
	ops := []route{
		{"GET", "/statistics", ""}, {"GET", "/v1/statistics", ""}, {"GET", "/v1/devices", ""},
		{"POST", "/v1/devices", `{"count":1}`}, {"PUT", "/v1/devices/" + id + "/override", override},
		{"DELETE", "/v1/devices/" + id + "/override", ""},
		{"POST", "/v1/devices/prune", `{"older_than":"10m"}`},
		{"DELETE", "/v1/devices/" + b.String(), ""},
	}
	for _, o := range ops {
		want("operator/device-token/"+o.method+" "+o.path, o.method, o.path, ta, o.body, 403)
		want("operator/cookie/"+o.method+" "+o.path, o.method, o.path, cookie(a0), o.body, 401)
		want("operator/none/"+o.method+" "+o.path, o.method, o.path, nil, o.body, 401)
	}
}

// noConnack is mqttConnect's code when the server sent no CONNACK at all (a
// dropped connection, a transport error): not a refusal the protocol names.
const noConnack = 0xff

// mqttConnect connects a paho MQTT 5 client and returns the CONNACK code
// (noConnack when there was none).
func mqttConnect(t *testing.T, addr, user, pass, clientID string) (*paho.Client, byte) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return mqttConnectOn(t, conn, user, pass, clientID)
}

// mqttConnectOn is mqttConnect on a connection already dialed (from an
// address of the test's choosing, or after bytes of its own).
func mqttConnectOn(t *testing.T, conn net.Conn, user, pass, clientID string) (*paho.Client, byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl := paho.NewClient(paho.ClientConfig{Conn: conn, ClientID: clientID})
	ca, err := cl.Connect(ctx, &paho.Connect{
		ClientID: clientID, CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: user, PasswordFlag: true, Password: []byte(pass),
	})
	if ca == nil {
		conn.Close()
		t.Logf("no CONNACK: %v", err)
		return nil, noConnack
	}
	if ca.ReasonCode != 0 {
		conn.Close()
		return nil, ca.ReasonCode
	}
	t.Cleanup(func() { cl.Disconnect(&paho.Disconnect{}) })
	return cl, 0
}

// TestAuthChaosMQTT: on the embedded listener of a real kettle serve, a
// kettle cannot sign in as another, take over another's session, publish
// readings for another, or subscribe to another's (or everyone's) commands.
func TestAuthChaosMQTT(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.MQTT.Addr = "127.0.0.1:0" })
	c := newClient(t, srv)
	a, b := uuid.New(), uuid.New()
	ta, tb := kettle.DeviceToken(srv.Secret(), a), kettle.DeviceToken(srv.Secret(), b)
	// A refusal is a CONNACK with a failure code (0x86 bad user name or
	// password, 0x87 not authorized, 0x85 client id): a connection dropped
	// without one is not a refusal, it is something else going wrong.
	refused := func(name, user, pass, cid string) {
		t.Run(name, func(t *testing.T) {
			if _, code := mqttConnect(t, srv.MQTTAddr(), user, pass, cid); code < 0x80 || code == noConnack {
				t.Fatalf("connect as %q with client id %q: CONNACK 0x%02x, want a refusal (0x80 or more; 0x%02x is no CONNACK)", user, cid, code, noConnack)
			}
		})
	}
	refused("mqtt/connect-as-another-with-own-token", b.String(), ta, "")
	refused("mqtt/connect-with-another's-session-id", a.String(), ta, b.String())
	refused("mqtt/connect-with-the-operator-token", a.String(), srv.OperatorToken(), "")
	refused("mqtt/connect-with-a-forged-token", a.String(), a.String()+"."+strings.Repeat("A", 43), "")
	if _, code := mqttConnect(t, srv.MQTTAddr(), b.String(), tb, ""); code != 0 {
		t.Fatalf("b's own connect refused: 0x%02x", code)
	}
	cl, code := mqttConnect(t, srv.MQTTAddr(), a.String(), ta, "")
	if code != 0 {
		t.Fatalf("a's own connect refused: 0x%02x", code)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t.Run("mqtt/publish-to-another's-topic", func(t *testing.T) {
		body := v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)
		pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + b.String() + "/measurements", QoS: 1, Payload: []byte(body)})
		// paho returns a refusing PUBACK with an error: the PUBACK counts.
		if pr == nil || pr.ReasonCode < 0x80 {
			t.Fatalf("publish to b's topic: PUBACK %v, err %v; want a PUBACK refusing it (0x87)", pr, err)
		}
		r := c.do("GET", "/v1/devices/"+b.String()+"/measurements", bearer(srv.OperatorToken()), "")
		if r.status == 200 && strings.Contains(string(r.body), "battery") {
			t.Fatalf("a reading a published to b's topic was stored: %s", r.body)
		}
	})
	for _, filter := range []string{"kettles/" + b.String() + "/command", "kettles/+/command", "#", "kettles/" + b.String() + "/measurements"} {
		t.Run("mqtt/subscribe/"+filter, func(t *testing.T) {
			sa, err := cl.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}})
			// paho returns the SUBACK with an error when a reason is a
			// failure: the SUBACK itself is what counts.
			if sa == nil || len(sa.Reasons) != 1 || sa.Reasons[0] < 0x80 {
				t.Fatalf("subscribe %s: SUBACK %v, err %v; want one reason refusing it (0x87)", filter, sa, err)
			}
		})
	}
	// Refusals are answers on a live session: a's own publish still goes
	// through on the same connection (a check passed by a dropped
	// connection would have proved nothing).
	t.Run("mqtt/session-still-alive", func(t *testing.T) {
		pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + a.String() + "/measurements", QoS: 1, Payload: []byte(v1Body(time.Now().Add(-2*time.Minute), 1, 2, 3, 20, 60, 500))})
		if err != nil || pr == nil || pr.ReasonCode != 0 {
			t.Fatalf("a's own publish after the refusals: PUBACK %v, err %v; want 0x00 on the same connection", pr, err)
		}
	})
}

// TestAuthChaosRevocation: tokens of a deleted device are refused over HTTP
// and MQTT.
func TestAuthChaosRevocation(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.MQTT.Addr = "127.0.0.1:0" })
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	a := uuid.New()
	ta := kettle.DeviceToken(srv.Secret(), a)
	if r := c.do("POST", "/v1/measurements", bearer(ta), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)); r.status != 200 {
		t.Fatalf("upload before revocation: %d", r.status)
	}
	live, code := mqttConnect(t, srv.MQTTAddr(), a.String(), ta, "")
	if code != 0 {
		t.Fatalf("connect before revocation: 0x%02x", code)
	}
	if r := c.do("DELETE", "/v1/devices/"+a.String(), op, ""); r.status/100 != 2 {
		t.Fatalf("DELETE /v1/devices/%s: %d %s", a, r.status, r.body)
	}
	for _, rq := range []struct{ method, path, body string }{
		{"POST", "/v1/measurements", v1Body(time.Now().Add(-30*time.Second), 1, 2, 3, 20, 60, 500)},
		{"GET", "/v1/command", ""},
		{"GET", "/v1/devices/" + a.String(), ""},
	} {
		t.Run("revoked/http/"+rq.method+" "+rq.path, func(t *testing.T) {
			if r := c.do(rq.method, rq.path, bearer(ta), rq.body); r.status != 401 && r.status != 403 {
				t.Fatalf("revoked token: %s %s → %d", rq.method, rq.path, r.status)
			}
		})
	}
	t.Run("revoked/mqtt/connect", func(t *testing.T) {
		if _, code := mqttConnect(t, srv.MQTTAddr(), a.String(), ta, ""); code < 0x80 || code == noConnack {
			t.Fatalf("revoked device's MQTT connect: CONNACK 0x%02x, want a refusal (0x80 or more; 0x%02x is no CONNACK)", code, noConnack)
		}
	})
	t.Run("revoked/mqtt/live-session", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		at := time.Now().Add(-20 * time.Second).UTC().Truncate(time.Millisecond)
		pr, err := live.Publish(ctx, &paho.Publish{Topic: "kettles/" + a.String() + "/measurements", QoS: 1, Payload: []byte(v1Body(at, 1, 2, 3, 20, 60, 500))})
		if err == nil && pr != nil && pr.ReasonCode < 0x80 {
			t.Fatal("a revoked device's open MQTT session still gets its readings acknowledged")
		}
		// Refused or dropped, the reading must not be stored either.
		var h struct{ Measurements []httpapi.MeasurementJSON }
		c.do("GET", "/v1/devices/"+a.String()+"/measurements?from="+at.Format(time.RFC3339Nano), op, "").json(t, &h)
		if len(h.Measurements) != 0 {
			t.Fatalf("a revoked device's reading published on its open session was stored: %+v", h.Measurements)
		}
	})
}
