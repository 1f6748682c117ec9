package server_test

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestDeviceRate: kettle serve --device-rate 0.1 --device-burst 2. Over
// HTTP (both protocols, uploads and polls) a kettle's third request in a
// burst is held a second, then answered 429 with Retry-After (what is left
// of its wait) and the error named, and nothing of it is stored; other kettles are not touched; the refusals are counted.
// Over MQTT (--device-rate 5, bursts of 1) four QoS 1 publishes are all
// acknowledged and stored, the last no sooner than 600 ms after the first
// was sent: the kettle is slowed down, not refused.
func TestDeviceRate(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.Ingest.DeviceRate, c.Ingest.DeviceBurst = 0.1, 2
	})
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	at := time.Now().Add(-time.Hour).UTC()
	tooMany := func(method, path string, hdr map[string]string, body string) {
		t.Helper()
		began := time.Now()
		r := c.do(method, path, hdr, body)
		took := time.Since(began)
		var e struct{ Error, Message string }
		if r.status == 429 {
			r.json(t, &e)
		}
		ra, _ := strconv.Atoi(r.header.Get("Retry-After"))
		if r.status != 429 || ra < 1 || ra > 9 || took < 900*time.Millisecond || e.Error != "rate_limited" || !strings.Contains(e.Message, "--device-rate") {
			t.Errorf("%s %s over the rate: %d after %s, Retry-After %q %s; want 429 after a 1 s hold, Retry-After 1–9 (what is left of the 10 s wait), rate_limited naming --device-rate",
				method, path, r.status, took.Round(time.Millisecond), r.header.Get("Retry-After"), r.body)
		}
	}
	stored := func(id string) int64 {
		t.Helper()
		var d httpapi.DeviceJSON
		c.do("GET", "/v1/devices/"+id, op, "").json(t, &d)
		return d.Measurements
	}

	// Case-study protocol: an upload and a poll, then a third request.
	v0 := login(t, c)
	if r := c.do("POST", "/measurement", cookie(v0), v0Body(at, 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Fatalf("upload: %d %s", r.status, r.body)
	}
	if r := c.do("GET", "/command", cookie(v0), ""); r.status != 200 {
		t.Fatalf("poll: %d %s", r.status, r.body)
	}
	tooMany("POST", "/measurement", cookie(v0), v0Body(at.Add(time.Second), 1, 2, 3, 4, 5, 6))
	tooMany("GET", "/command", cookie(v0), "")
	if n := stored(v0); n != 1 {
		t.Errorf("the kettle's readings stored: %d, want 1 (the refused one is not)", n)
	}

	// v1: the first upload registers the kettle (not limited before it is
	// known), then its burst of two, then 429.
	id := uuid.New()
	tok := bearer(kettle.DeviceToken(srv.Secret(), id))
	for i := range 3 {
		if r := c.do("POST", "/v1/measurements", tok, v1Body(at.Add(time.Duration(i)*time.Second), 1, 2, 3, 4, 5, 6)); r.status != 200 {
			t.Fatalf("v1 upload %d: %d %s", i+1, r.status, r.body)
		}
	}
	tooMany("GET", "/v1/command", tok, "")
	tooMany("POST", "/v1/measurements", tok, v1Body(at.Add(time.Minute), 1, 2, 3, 4, 5, 6))
	tooMany("GET", "/v1/devices/"+id.String()+"/measurements?limit=1000", tok, "") // its own history, read by itself
	if n := stored(id.String()); n != 3 {
		t.Errorf("the v1 kettle's readings stored: %d, want 3", n)
	}
	// Another kettle, and the operator, are not touched.
	other := login(t, c)
	for range 2 {
		if r := c.do("GET", "/command", cookie(other), ""); r.status != 200 {
			t.Errorf("another kettle's poll: %d", r.status)
		}
	}
	for range 5 {
		if r := c.do("GET", "/v1/devices/"+v0, op, ""); r.status != 200 {
			t.Errorf("the operator reading a limited kettle: %d", r.status)
		}
	}
	if n := metric(t, c, `kettle_device_rate_limited_total{kind="refused"}`); n != 5 {
		t.Errorf(`kettle_device_rate_limited_total{kind="refused"} = %v, want 5`, n)
	}
	if n := metric(t, c, "kettle_device_rate_limit_per_second"); n != 0.1 {
		t.Errorf("kettle_device_rate_limit_per_second = %v, want 0.1", n)
	}

	// MQTT: paced, never refused.
	msrv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.MQTT.Addr = "127.0.0.1:0"
		c.Ingest.DeviceRate, c.Ingest.DeviceBurst = 5, 1
	})
	mc := newClient(t, msrv)
	mid := uuid.New()
	if r := mc.do("POST", "/v1/measurements", bearer(kettle.DeviceToken(msrv.Secret(), mid)), v1Body(at, 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Fatalf("registering upload: %d %s", r.status, r.body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := mqttDevice(ctx, t, msrv, mid)
	time.Sleep(250 * time.Millisecond) // the HTTP upload's slot is past
	began := time.Now()
	for i := range 4 {
		body := v1Body(at.Add(time.Duration(i+1)*time.Minute), 5, 10, 1, 20, 70, 500)
		pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + mid.String() + "/measurements", QoS: 1, Payload: []byte(body)})
		if err != nil || pr.ReasonCode != 0 {
			t.Fatalf("publish %d: %v %+v", i+1, err, pr)
		}
	}
	took := time.Since(began)
	var d httpapi.DeviceJSON
	mc.do("GET", "/v1/devices/"+mid.String(), bearer(msrv.OperatorToken()), "").json(t, &d)
	paced := metric(t, mc, `kettle_device_rate_limited_total{kind="paced"}`)
	if d.Measurements != 5 || took < 550*time.Millisecond || paced < 1 {
		t.Errorf("4 publishes at 5 a second, bursts of 1: acknowledged in %s, %d readings stored, %v paced; want all 4 stored (5 with the HTTP one), no sooner than 600 ms, paced ≥ 1", took, d.Measurements, paced)
	}
	t.Logf("MQTT: 4 publishes acknowledged in %s, %v paced", took.Round(time.Millisecond), paced)
}

// TestRegistrationBounds: kettle serve --login-rate 0.1 --login-burst 2
// --max-devices 3. POST /login past the burst is held a second, then
// answered 429 + Retry-After; POST /v1/devices (and a login) past
// --max-devices is refused 403 naming it, nothing registered; a kettle with
// a v1 token still registers by uploading. All counted on /metrics.
func TestRegistrationBounds(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.Ingest.LoginRate, c.Ingest.LoginBurst, c.Ingest.MaxDevices = 0.1, 2, 3
	})
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	login(t, c)
	login(t, c)
	began := time.Now()
	r := c.do("POST", "/login", nil, `{"username":"kettle"}`)
	ra, _ := strconv.Atoi(r.header.Get("Retry-After"))
	if took := time.Since(began); r.status != 429 || ra < 1 || ra > 9 || took < 900*time.Millisecond || !strings.Contains(string(r.body), "--login-rate") {
		t.Errorf("third login in a burst of 2: %d after %s, Retry-After %q, %s; want 429 after ~1 s naming --login-rate", r.status, took, r.header.Get("Retry-After"), r.body)
	}
	full := func(r resp, what string) {
		t.Helper()
		if r.status != 403 || !strings.Contains(string(r.body), "--max-devices") {
			t.Errorf("%s past --max-devices: %d %s; want 403 naming --max-devices", what, r.status, r.body)
		}
	}
	full(c.do("POST", "/v1/devices", op, `{"count":2}`), "POST /v1/devices count 2")
	if r := c.do("POST", "/v1/devices", op, `{"count":1}`); r.status != 201 {
		t.Errorf("the third device: %d %s", r.status, r.body)
	}
	full(c.do("POST", "/v1/devices", op, `{"count":1}`), "POST /v1/devices, a fourth")
	id := uuid.New()
	if r := c.do("POST", "/v1/measurements", bearer(kettle.DeviceToken(srv.Secret(), id)), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Errorf("a v1 kettle's first upload past --max-devices: %d %s; want 200 (its token is the operator's)", r.status, r.body)
	}
	if n := metric(t, c, "kettle_devices_registered"); n != 4 {
		t.Errorf("kettle_devices_registered = %v, want 4", n)
	}
	for series, want := range map[string]float64{`kettle_registrations_refused_total{reason="login_rate"}`: 1, `kettle_registrations_refused_total{reason="registry_full"}`: 2, "kettle_devices_max": 3} {
		if n := metric(t, c, series); n != want {
			t.Errorf("%s = %v, want %v", series, n, want)
		}
	}
}

// TestLoginRatePerSource: kettle serve --login-rate-per-source 0.1
// --login-burst-per-source 2. A client past its burst is held a second,
// then answered 429 naming the flag, while a client on another address
// (127.0.0.2: a real second source on loopback) still registers; counted
// on /metrics apart from --login-rate's refusals.
func TestLoginRatePerSource(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.Ingest.LoginSourceRate, c.Ingest.LoginSourceBurst = 0.1, 2
	})
	c := newClient(t, srv)
	login(t, c)
	login(t, c)
	began := time.Now()
	r := c.do("POST", "/login", nil, `{"username":"kettle"}`)
	ra, _ := strconv.Atoi(r.header.Get("Retry-After"))
	if took := time.Since(began); r.status != 429 || ra < 1 || ra > 10 || took < 900*time.Millisecond || !strings.Contains(string(r.body), "--login-rate-per-source") || !strings.Contains(string(r.body), "127.0.0.1") {
		t.Errorf("third login from 127.0.0.1 in a burst of 2: %d after %s, Retry-After %q, %s; want 429 after ~1 s naming --login-rate-per-source and the address", r.status, took, r.header.Get("Retry-After"), r.body)
	}
	other := newClient(t, srv)
	other.hc.Transport = &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext}
	login(t, other)
	for series, want := range map[string]float64{`kettle_registrations_refused_total{reason="login_rate_source"}`: 1, `kettle_registrations_refused_total{reason="login_rate"}`: 0, "kettle_devices_registered": 3} {
		if n := metric(t, c, series); n != want {
			t.Errorf("%s = %v, want %v", series, n, want)
		}
	}
}
