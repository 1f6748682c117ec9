package server_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestCredentialRotation: kettle serve --operator-token NEW
// --operator-token-previous OLD --secret NEW --secret-previous OLD accepts
// the operator token and the device tokens of both (HTTP, a cached token
// again, a device's own read, an MQTT connection, a dashboard sign-in),
// refuses a third, hands out new devices' tokens of the new secret, and
// counts every use of an old one and logs it (a line a minute, naming
// the device of a device token). A previous
// value equal to the one in force is refused at start.
func TestCredentialRotation(t *testing.T) {
	var log syncbuf.Buffer
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.OperatorToken, c.PreviousOperatorToken = "op-new-0123456789", "op-old-0123456789"
		c.Secret, c.PreviousSecret = "sec-new-0123456789", "sec-old-0123456789"
		c.MQTT.Addr = "127.0.0.1:0"
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	c := newClient(t, srv)
	for tok, want := range map[string]int{"op-new-0123456789": 200, "op-old-0123456789": 200, "op-other": 401} {
		if r := c.do("GET", "/v1/devices", bearer(tok), ""); r.status != want {
			t.Errorf("GET /v1/devices with operator token %s: %d, want %d (%s)", tok, r.status, want, r.body)
		}
	}
	old, cur := uuid.New(), uuid.New()
	ts := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	oldTok := kettle.DeviceToken([]byte("sec-old-0123456789"), old)
	for i, tc := range []struct {
		tok  string
		want int
	}{
		{oldTok, 200},
		{oldTok, 200}, // from the token cache this time
		{kettle.DeviceToken([]byte("sec-new-0123456789"), cur), 200},
		{kettle.DeviceToken([]byte("sec-third"), uuid.New()), 401},
	} {
		if r := c.do("POST", "/v1/measurements", bearer(tc.tok), v1Body(ts.Add(time.Duration(i)*time.Second), 5, 10, 1, 20, 70, 500)); r.status != tc.want {
			t.Errorf("upload %d: %d, want %d (%s)", i+1, r.status, tc.want, r.body)
		}
	}
	if r := c.do("GET", "/v1/devices/"+old.String(), bearer(oldTok), ""); r.status != 200 {
		t.Errorf("the old-secret kettle reading itself: %d %s", r.status, r.body)
	}
	if r := c.do("GET", "/v1/devices", bearer(oldTok), ""); r.status != 403 {
		t.Errorf("an old-secret device token on an operator endpoint: %d, want 403 (%s)", r.status, r.body)
	}
	var created struct{ Devices []struct{ ID, Token string } }
	c.do("POST", "/v1/devices", bearer("op-new-0123456789"), `{"count":1}`).json(t, &created)
	if len(created.Devices) != 1 {
		t.Fatalf("POST /v1/devices: %+v", created)
	}
	if _, ok := kettle.VerifyDeviceToken([]byte("sec-new-0123456789"), created.Devices[0].Token); !ok {
		t.Errorf("a new device's token is not of the new secret: %s", created.Devices[0].Token)
	}

	if mc, code := mqttConnect(t, srv.MQTTAddr(), old.String(), oldTok, old.String()); code != 0 {
		t.Errorf("MQTT connect with an old-secret token: CONNACK %#x", code)
	} else {
		mc.Disconnect(&paho.Disconnect{})
	}

	// The dashboard's own route (not the API's: not in openapi.json).
	res, err := http.Post(srv.URL()+"/session", "application/json", strings.NewReader(`{"token":"op-old-0123456789"}`))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 200 || len(res.Cookies()) == 0 {
		t.Errorf("dashboard sign-in with the old operator token: %d, cookies %v", res.StatusCode, res.Cookies())
	}
	for series, want := range map[string]float64{
		`kettle_previous_credentials_used_total{kind="operator"}`: 2, // the GET and the sign-in
		`kettle_previous_credentials_used_total{kind="device"}`:   4, // two uploads, its read, MQTT
		`kettle_previous_credentials_accepted{kind="device"}`:     1,
		"kettle_devices_on_previous_secret":                       1,
	} {
		if n := metric(t, c, series); n != want {
			t.Errorf("%s = %v, want %v", series, n, want)
		}
	}
	// One line a minute: the first use, the operator's GET.
	if l := log.String(); !strings.Contains(l, "credential being retired was used") || !strings.Contains(l, "kind=operator") {
		t.Errorf("no log line of a retired credential's use:\n%s", l)
	}

	for _, c := range []server.Config{
		{OperatorToken: "same-token-0123456789", PreviousOperatorToken: "same-token-0123456789"},
		{Secret: "same-token-0123456789", PreviousSecret: "same-token-0123456789"},
	} {
		c.Addr, c.DB, c.DataDir, c.Logger = "127.0.0.1:0", "sqlite:"+t.TempDir()+"/k.db", t.TempDir(), slog.New(slog.NewTextHandler(io.Discard, nil))
		if s, err := server.Start(context.Background(), c); err == nil || !strings.Contains(err.Error(), "-previous is the") {
			if s != nil {
				s.Close()
			}
			t.Errorf("previous = in force: %v, want refused naming the flag", fmt.Sprint(err))
		}
	}
}
