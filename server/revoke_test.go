package server_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestRevoke: DELETE /v1/devices/{id} decommissions a device: its v1 token,
// its case-study UUID and its MQTT password are refused, also after a
// restart; its history stays in the statistics.
func TestRevoke(t *testing.T) { forEachStore(t, testRevoke) }

func testRevoke(t *testing.T, dsn string) {
	dir := t.TempDir()
	cfg := func(c *server.Config) {
		c.DataDir, c.Secret, c.OperatorToken = dir, "device-secret-test", "operator-token-test"
		c.MQTT.Addr = "127.0.0.1:0"
	}
	srv := start(t, dsn, cfg)
	c := newClient(t, srv)
	id := uuid.New()
	tok := bearer(kettle.DeviceToken([]byte("device-secret-test"), id))
	body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":5,"battery_full_mwh":10,"battery_rate_mw":1,"ambient_temp_c":20,"water_temp_c":70,"water_level_ml":500}`, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339))
	if r := c.do("POST", "/v1/measurements", tok, body); r.status != 200 {
		t.Fatalf("upload: %d", r.status)
	}
	v0 := login(t, c)
	if r := c.do("DELETE", "/v1/devices/"+id.String(), tok, ""); r.status != 403 {
		t.Errorf("a device revoking itself: %d, want 403", r.status)
	}
	for _, d := range []string{id.String(), v0} {
		if r := c.do("DELETE", "/v1/devices/"+d, bearer("operator-token-test"), ""); r.status != 204 {
			t.Fatalf("revoke: %d %s", r.status, r.body)
		}
	}
	if r := c.do("DELETE", "/v1/devices/"+uuid.NewString(), bearer("operator-token-test"), ""); r.status != 404 {
		t.Errorf("revoking an unknown device: %d, want 404", r.status)
	}
	refused := func(c *client, mqttAddr string) {
		t.Helper()
		for _, f := range []struct {
			method, path string
			hdr          map[string]string
			body         string
		}{
			{"POST", "/v1/measurements", tok, body},
			{"GET", "/v1/command", tok, ""},
			{"GET", "/v1/devices/" + id.String(), tok, ""},
			{"GET", "/command", cookie(v0), ""},
			{"POST", "/measurement", cookie(v0), v0Body(time.Now().Add(-time.Minute), 1, 2, 3, 4, 5, 6)},
		} {
			if r := c.do(f.method, f.path, f.hdr, f.body); r.status != 401 {
				t.Errorf("revoked: %s %s → %d, want 401", f.method, f.path, r.status)
			}
		}
		conn, err := net.Dial("tcp", mqttAddr)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cl := paho.NewClient(paho.ClientConfig{Conn: conn})
		ca, _ := cl.Connect(ctx, &paho.Connect{ClientID: id.String(), CleanStart: true, UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken([]byte("device-secret-test"), id))})
		if ca == nil || ca.ReasonCode == 0 {
			t.Errorf("revoked device connected over MQTT: %+v", ca)
		}
		conn.Close()
		// History stays, and the operator sees the revocation.
		var d httpapi.DeviceJSON
		c.do("GET", "/v1/devices/"+id.String(), bearer("operator-token-test"), "").json(t, &d)
		if d.RevokedAt == nil || d.Measurements != 1 {
			t.Errorf("revoked device as the operator sees it: %+v", d)
		}
		var s httpapi.StatsJSON
		c.do("GET", "/v1/statistics", bearer("operator-token-test"), "").json(t, &s)
		if s.MeasurementCount != 1 {
			t.Errorf("history gone from statistics: %d", s.MeasurementCount)
		}
	}
	refused(c, srv.MQTTAddr())
	srv.Close()
	srv2 := start(t, dsn, cfg)
	refused(newClient(t, srv2), srv2.MQTTAddr())
}
