package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"
	"github.com/pires/go-proxyproto"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/server"
)

// The addresses of TestTrustedProxyThroughHAProxy: the balancer, two
// kettles' sources, and a client that forges X-Forwarded-For.
const (
	proxyAddr  = "127.0.54.1"
	kettleA    = "127.0.54.11"
	kettleB    = "127.0.54.12"
	forgerAddr = "127.0.54.13"
)

// TestTrustedProxyThroughHAProxy: kettle serve behind a real HAProxy
// (option forwardfor, as deploy/haproxy/haproxy.cfg) with --trusted-proxies
// naming it: the per-source login limit counts each kettle's own address,
// so one source over its burst does not refuse another; a client that
// reaches the node directly and forges X-Forwarded-For is counted under
// its own address.
func TestTrustedProxyThroughHAProxy(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Fatal("haproxy not found: apt-get install -y haproxy (make deps)")
	}
	const burst = 3
	tp, err := server.ParseTrustedProxies(proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.TrustedProxies = tp
		c.Ingest.LoginSourceRate, c.Ingest.LoginSourceBurst = 0.001, burst
		c.Ingest.LoginRate, c.Ingest.LoginBurst = 1000, 1000
	})
	node := strings.TrimPrefix(srv.URL(), "http://")
	front, _ := startHAProxy(t, bin, node, "")

	login := func(from, url string, header map[string]string) int {
		t.Helper()
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}).DialContext}}
		req, _ := http.NewRequest("POST", url+"/login", strings.NewReader(`{"username":"k"}`))
		for k, v := range header {
			req.Header.Set(k, v)
		}
		res, err := c.Do(req)
		if err != nil {
			t.Fatalf("login from %s: %v", from, err)
		}
		res.Body.Close()
		return res.StatusCode
	}
	count := func(from, url string, header map[string]string, n int) (ok, refused int) {
		for range n {
			switch code := login(from, url, header); code {
			case 200:
				ok++
			case 429, 503:
				refused++
			default:
				t.Fatalf("login from %s: %d", from, code)
			}
		}
		return ok, refused
	}
	if ok, refused := count(kettleA, front, nil, burst+2); ok != burst || refused != 2 {
		t.Fatalf("kettle A through HAProxy: %d registered, %d refused; want %d and 2 (its own burst)", ok, refused, burst)
	}
	if ok, _ := count(kettleB, front, nil, burst); ok != burst {
		t.Fatalf("kettle B through HAProxy after A's burst: %d of %d registered; want all: B is its own source", ok, burst)
	}
	// Straight to the node, claiming to be a fresh address: not believed,
	// so its burst is its own address's.
	forged := map[string]string{"X-Forwarded-For": "198.51.100.77"}
	if ok, refused := count(forgerAddr, srv.URL(), forged, burst+2); ok != burst || refused != 2 {
		t.Fatalf("a forged X-Forwarded-For from outside the trusted range: %d registered, %d refused; want %d and 2", ok, refused, burst)
	}
	// And the forger cannot borrow kettle B's (already spent) budget
	// either: it is refused under its own address, now spent.
	if code := login(forgerAddr, srv.URL(), map[string]string{"X-Forwarded-For": kettleB}); code == 200 {
		t.Fatal("the forger registered again: its forged header was believed")
	}
}

// startHAProxy runs haproxy in front of node (host:port) on proxyAddr and
// returns its base URL; with mqttNode, also a TCP frontend sending a PROXY
// protocol v2 header to it (as deploy/haproxy/haproxy.cfg), whose address
// it returns second.
func startHAProxy(t *testing.T, bin, node, mqttNode string) (string, string) {
	t.Helper()
	port, mqttPort := freePort(t, proxyAddr), freePort(t, proxyAddr)
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global
	maxconn 256
defaults
	timeout connect 2s
	timeout client 10s
	timeout server 10s
frontend devices
	mode http
	option forwardfor
	bind %s:%d
	default_backend nodes
backend nodes
	mode http
	source %s
	server n1 %s
`, proxyAddr, port, proxyAddr, node)
	if mqttNode != "" {
		cfg += fmt.Sprintf(`frontend mqtt
	mode tcp
	bind %s:%d
	default_backend mqtt_nodes
backend mqtt_nodes
	mode tcp
	source %s
	server m1 %s send-proxy-v2
`, proxyAddr, mqttPort, proxyAddr, mqttNode)
	}
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-db", "-f", path)
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	url := fmt.Sprintf("http://%s:%d", proxyAddr, port)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		if res, err := http.Get(url + "/healthz"); err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				return url, fmt.Sprintf("%s:%d", proxyAddr, mqttPort)
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("haproxy not routing within 20 s:\n%s", out)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// freePort is a TCP port free on addr just now.
func freePort(t *testing.T, addr string) int {
	t.Helper()
	l, err := net.Listen("tcp", addr+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestMQTTProxyProtocolThroughHAProxy: the MQTT listener behind a real
// HAProxy (TCP mode, send-proxy-v2, as deploy/haproxy/haproxy.cfg) with
// --trusted-proxies naming it: a kettle's session works through it, and a
// refused CONNECT is logged under the kettle's own address, not the
// balancer's. A peer outside the trusted range that sends a PROXY header
// naming someone else is refused, and so is the trusted balancer's address
// sending none.
func TestMQTTProxyProtocolThroughHAProxy(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Fatal("haproxy not found: apt-get install -y haproxy (make deps)")
	}
	tp, err := server.ParseTrustedProxies(proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) {
		c.TrustedProxies = tp
		c.MQTT.Addr = "127.0.0.1:0"
		c.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	})
	_, front := startHAProxy(t, bin, strings.TrimPrefix(srv.URL(), "http://"), srv.MQTTAddr())
	dial := func(from, to string) net.Conn {
		t.Helper()
		c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}).Dial("tcp", to)
		if err != nil {
			t.Fatalf("dial %s from %s: %v", to, from, err)
		}
		return c
	}
	// lines are the log's lines with msg containing what, as maps.
	lines := func(what string) []map[string]any {
		var out []map[string]any
		for _, l := range strings.Split(logs.String(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(l), &m) == nil && strings.Contains(fmt.Sprint(m["msg"]), what) {
				out = append(out, m)
			}
		}
		return out
	}
	// logged waits for a line with msg containing what and key's value
	// starting with prefix.
	logged := func(what, key, prefix string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			for _, m := range lines(what) {
				if strings.HasPrefix(fmt.Sprint(m[key]), prefix) {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("no log line %q with %s=%s…; the log:\n%s", what, key, prefix, logs.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	a, b := uuid.New(), uuid.New()
	cl, code := mqttConnectOn(t, dial(kettleA, front), a.String(), kettle.DeviceToken(srv.Secret(), a), "")
	if code != 0 {
		t.Fatalf("kettle A through HAProxy: CONNACK 0x%02x, want 0x00", code)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	body := v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)
	if pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + a.String() + "/measurements", QoS: 1, Payload: []byte(body)}); err != nil || pr.ReasonCode != 0 {
		t.Fatalf("kettle A's reading through HAProxy: PUBACK %v, err %v", pr, err)
	}

	if _, code := mqttConnectOn(t, dial(kettleB, front), b.String(), kettle.DeviceToken(srv.Secret(), a), ""); code < 0x80 || code == noConnack {
		t.Fatalf("kettle B with A's token through HAProxy: CONNACK 0x%02x, want a refusal", code)
	}
	logged("mqtt: connection refused", "remote", kettleB+":")
	for _, m := range lines("mqtt: connection refused") {
		if strings.HasPrefix(fmt.Sprint(m["remote"]), proxyAddr+":") {
			t.Fatalf("a refusal logged under the balancer's address: %v", m)
		}
	}

	// Straight to the node from outside the trusted range, with a PROXY
	// header claiming a fresh address and a valid CONNECT after it.
	const claimed = "198.51.100.77"
	c := dial(forgerAddr, srv.MQTTAddr())
	hdr := proxyproto.HeaderProxyFromAddrs(2, &net.TCPAddr{IP: net.ParseIP(claimed), Port: 4000}, c.RemoteAddr())
	if _, err := hdr.WriteTo(c); err != nil {
		t.Fatal(err)
	}
	if _, code := mqttConnectOn(t, c, b.String(), kettle.DeviceToken(srv.Secret(), b), ""); code != noConnack {
		t.Fatalf("a PROXY header from %s, outside the trusted range: CONNACK 0x%02x, want the connection refused", forgerAddr, code)
	}
	logged("PROXY protocol header from a peer not in --trusted-proxies", "peer", forgerAddr+":")

	// The balancer's own address without a PROXY header: refused, as it
	// could be anyone behind it.
	if _, code := mqttConnectOn(t, dial(proxyAddr, srv.MQTTAddr()), b.String(), kettle.DeviceToken(srv.Secret(), b), ""); code != noConnack {
		t.Fatalf("a connection from the trusted proxy without a PROXY header: CONNACK 0x%02x, want refused", code)
	}
	logged("PROXY protocol header from a trusted proxy", "peer", proxyAddr+":")
	if strings.Contains(logs.String(), claimed) {
		t.Fatalf("the forged address %s reached the log:\n%s", claimed, logs.String())
	}
}
