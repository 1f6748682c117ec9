package server_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
	"github.com/kettlefleet/kettlefleet/server"
)

func tlsClient(t *testing.T, srv *server.Server, roots *x509.CertPool) *client {
	return &client{t: t, base: srv.URL(), hc: &http.Client{Timeout: 10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, DisableKeepAlives: true}}}
}

// metric reads one sample of /metrics.
func metric(t *testing.T, c *client, name string) float64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindSubmatch(c.do("GET", "/metrics", nil, "").body)
	if m == nil {
		t.Fatalf("/metrics has no %s", name)
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// gathered reads one unlabelled sample from the server's metrics registry,
// in process: for a test whose connections are all taken (--max-conns),
// where GET /metrics would be one more (0 when absent).
func gathered(t *testing.T, srv *server.Server, name string) float64 {
	t.Helper()
	mfs, err := srv.Metrics().Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) == 0 {
			continue
		}
		m := mf.GetMetric()[0]
		switch {
		case m.GetGauge() != nil:
			return m.GetGauge().GetValue()
		case m.GetCounter() != nil:
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestTLS: with --tls-cert/--tls-key, kettle serve takes readings over
// HTTPS and over MQTT with TLS (a real paho client), answers a plain HTTP
// request to its port with 400, counts failed handshakes, and picks up a
// renewed certificate written over the files without a restart — keeping
// the old one while the renewal is half written.
func TestTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	old, oldRoots, _, _ := tlscerttest.Write(t, certFile, keyFile, time.Now().Add(30*24*time.Hour))
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		c.TLSCert, c.TLSKey = certFile, keyFile
		c.MQTT.Addr = "127.0.0.1:0"
	})
	if !strings.HasPrefix(srv.URL(), "https://") {
		t.Fatalf("URL %s", srv.URL())
	}
	c := tlsClient(t, srv, oldRoots)
	op := bearer(srv.OperatorToken())

	// A reading over HTTPS, case-study protocol.
	dev := login(t, c)
	ts := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	up := fmt.Sprintf(`{"time":%q,"charge_now":5,"charge_full":10,"charge_rate":1,"ambient_temp":20,"water_temp":70,"water_level":500}`, ts.Format(time.RFC3339))
	if r := c.do("POST", "/measurement", cookie(dev), up); r.status != 200 {
		t.Fatalf("upload over HTTPS: %d %s", r.status, r.body)
	}
	var d httpapi.DeviceJSON
	c.do("GET", "/v1/devices/"+dev, op, "").json(t, &d)
	if d.Measurements != 1 {
		t.Errorf("after the upload over HTTPS the store holds %+v", d)
	}

	// Plain HTTP to the TLS port: 400 that says so, counted as a failed
	// handshake.
	before := metric(t, c, "kettle_tls_handshake_errors_total")
	res, err := http.Get("http://" + srv.Addr() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 400 || !strings.Contains(string(body), "HTTPS") {
		t.Errorf("plain HTTP to the TLS port: %d %q", res.StatusCode, body)
	}
	if got := metric(t, c, "kettle_tls_handshake_errors_total"); got != before+1 {
		t.Errorf("kettle_tls_handshake_errors_total %v after a plain request, %v before", got, before)
	}

	// MQTT over TLS: QoS 1, PUBACK after the commit.
	id := uuid.New()
	conn, err := tls.Dial("tcp", srv.MQTTAddr(), &tls.Config{RootCAs: oldRoots})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := mqttDeviceOn(ctx, srv, conn, id)
	if err != nil {
		t.Fatalf("over TLS: %v", err)
	}
	msg := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":5,"battery_full_mwh":10,"battery_rate_mw":1,"ambient_temp_c":20,"water_temp_c":70,"water_level_ml":500}`, ts.Format(time.RFC3339))
	pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + id.String() + "/measurements", QoS: 1, Payload: []byte(msg)})
	if err != nil || pr.ReasonCode != 0 {
		reason := ""
		if pr != nil && pr.Properties != nil {
			reason = pr.Properties.ReasonString
		}
		t.Fatalf("MQTT publish over TLS: %v, PUBACK %+v, reason %q, payload %s", err, pr, reason, msg)
	}
	cl.Disconnect(&paho.Disconnect{})
	c.do("GET", "/v1/devices/"+id.String(), op, "").json(t, &d)
	if d.Measurements != 1 {
		t.Errorf("after PUBACK over TLS the store holds %+v", d)
	}
	// Plain MQTT to the TLS port: no session, a failed handshake counted.
	before = metric(t, c, "kettle_tls_handshake_errors_total")
	pc, err := net.Dial("tcp", srv.MQTTAddr())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mqttDeviceOn(ctx, srv, pc, id); err == nil {
		t.Error("plain MQTT CONNECT on the TLS port was accepted")
	}
	pc.Close()
	waitFor(t, func() bool { return metric(t, c, "kettle_tls_handshake_errors_total") == before+1 }, "plain MQTT counted as a failed handshake")

	if got := metric(t, c, "kettle_tls_certificate_expiry_timestamp_seconds"); got != float64(old.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v, certificate's NotAfter %d", got, old.NotAfter.Unix())
	}

	// Renewal, half written: the new certificate beside the old key. The
	// old pair stays in force, and the failure is counted.
	renewed, newRoots, _, newKey := tlscerttest.Write(t, certFile, "", time.Now().Add(90*24*time.Hour))
	waitFor(t, func() bool { return metric(t, c, "kettle_tls_certificate_reload_errors_total") == 1 }, "the half-written renewal counted")
	if r := c.do("GET", "/healthz", nil, ""); r.status != 200 {
		t.Errorf("with the old pair in force: %d", r.status)
	}
	if _, err := tlsClient(t, srv, newRoots).hc.Get(srv.URL() + "/healthz"); err == nil {
		t.Error("the renewed certificate was served before its key was written")
	}
	// The key written: the next handshakes get the new pair.
	if err := os.WriteFile(keyFile, newKey, 0o600); err != nil {
		t.Fatal(err)
	}
	nc := tlsClient(t, srv, newRoots)
	waitFor(t, func() bool {
		r, err := nc.hc.Get(srv.URL() + "/healthz")
		if err == nil {
			r.Body.Close()
		}
		return err == nil && r.StatusCode == 200
	}, "the renewed certificate served")
	if got := metric(t, nc, "kettle_tls_certificate_expiry_timestamp_seconds"); got != float64(renewed.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v after the renewal, its NotAfter %d", got, renewed.NotAfter.Unix())
	}
	if got := metric(t, nc, "kettle_tls_certificate_reloads_total"); got != 1 {
		t.Errorf("kettle_tls_certificate_reloads_total %v", got)
	}
	if _, err := c.hc.Get(srv.URL() + "/healthz"); err == nil {
		t.Error("a client trusting only the old certificate still connects after the renewal")
	}
}

// TestTLSConnectionCap: over TLS, a connection beyond --max-conns is told
// 503 with Retry-After over TLS (a plain-text refusal would be garbage to a
// TLS client); one that never starts its handshake is closed within the
// refusal's 1 s bound.
func TestTLSConnectionCap(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_, roots, _, _ := tlscerttest.Write(t, certFile, keyFile, time.Now().Add(24*time.Hour))
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		c.TLSCert, c.TLSKey = certFile, keyFile
		c.MaxConns = 3
	})
	var held []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	waitFor(t, func() bool { return gathered(t, srv, "kettle_http_connections_open") == 3 }, "the server holds the 3 connections")
	c, err := tls.Dial("tcp", srv.Addr(), &tls.Config{RootCAs: roots})
	if err != nil {
		t.Fatalf("excess connection's handshake: %v", err)
	}
	expectRefusal(t, c)

	// Not before its 1 s (closedAfter's clock starts before the dial, the
	// server's at the accept); the upper bound leaves 4 s for a loaded
	// machine and still fails a refusal held several times too long.
	if took, err := closedAfter(srv.Addr()); err != nil || took < time.Second || took > 5*time.Second {
		t.Errorf("an excess connection without a handshake: %v after %v, want it closed after 1 s", err, took)
	}

	// Stopping the server ends a refusal in progress at once, before its
	// own 1 s bound: the time from before the dial to the end stays under
	// 1 s, which a refusal left to its bound cannot.
	refused := gathered(t, srv, "kettle_http_connections_refused_total")
	dialed := time.Now()
	pending, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer pending.Close()
	waitFor(t, func() bool { return gathered(t, srv, "kettle_http_connections_refused_total") == refused+1 }, "the server refusing the pending connection")
	for _, c := range held { // else Shutdown waits 5 s for them (net/http's StateNew)
		c.Close()
	}
	closed := make(chan time.Duration, 1)
	go func() {
		pending.SetReadDeadline(time.Now().Add(5 * time.Second))
		pending.Read(make([]byte, 1))
		closed <- time.Since(dialed)
	}()
	srv.Close()
	if took := <-closed; took >= time.Second {
		t.Errorf("a refusal in its handshake ended %v after its dial, not when the server closed", took)
	}
}

// closedAfter opens a connection to addr, sends nothing, and says how long
// the server took to close it; an error if the dial failed, the server sent
// something, or it kept the connection open 10 s.
func closedAfter(addr string) (time.Duration, error) {
	began := time.Now()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetReadDeadline(began.Add(10 * time.Second))
	n, err := c.Read(make([]byte, 1))
	took := time.Since(began)
	if n > 0 {
		return took, errors.New("the server sent data")
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return took, err
	}
	return took, nil
}

func waitFor(t *testing.T, ok func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not within 5 s: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTLSSlowHandshakeBounded: a client that opens a connection to the TLS
// port and never sends its ClientHello (a slowloris at the handshake) is cut
// off after --read-header-timeout on HTTP, and after the CONNECT timeout on
// MQTT, while others are served meanwhile.
func TestTLSSlowHandshakeBounded(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_, roots, _, _ := tlscerttest.Write(t, certFile, keyFile, time.Now().Add(24*time.Hour))
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		c.TLSCert, c.TLSKey = certFile, keyFile
		c.ReadHeaderTimeout = time.Second
		c.MQTT.Addr = "127.0.0.1:0"
		c.MQTT.ConnectTimeout = time.Second
	})
	cut := func(addr string) {
		if took, err := closedAfter(addr); err != nil || took < 800*time.Millisecond || took > 3*time.Second {
			t.Errorf("%s: a silent connection: %v after %v, want it closed after ~1 s", addr, err, took)
		}
	}
	done := make(chan struct{})
	go func() { defer close(done); cut(srv.MQTTAddr()) }()
	c := tlsClient(t, srv, roots)
	if r := c.do("GET", "/healthz", nil, ""); r.status != 200 {
		t.Errorf("served meanwhile: %d", r.status)
	}
	cut(srv.Addr())
	<-done
}
