package server_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
	front := startHAProxy(t, bin, node)

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
// returns its base URL.
func startHAProxy(t *testing.T, bin, node string) string {
	t.Helper()
	l, err := net.Listen("tcp", proxyAddr+":0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global
	maxconn 256
defaults
	mode http
	timeout connect 2s
	timeout client 10s
	timeout server 10s
	option forwardfor
frontend devices
	bind %s:%d
	default_backend nodes
backend nodes
	source %s
	server n1 %s
`, proxyAddr, port, proxyAddr, node)
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
				return url
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("haproxy not routing within 20 s:\n%s", out)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
