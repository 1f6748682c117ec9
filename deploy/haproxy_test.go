package deploy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// The addresses of TestHAProxyConfig: deploy/cluster.sh's layout (nodes
// @NET@.2N, the balancer @NET@.30) on a block of its own.
const haproxyNet = "127.0.56"

// TestHAProxyConfig runs the shipped deploy/haproxy/haproxy.cfg, rendered
// as cluster.sh renders it, in front of two kettle serve nodes: a browser
// that signed in to the dashboard stays on the node holding its session
// (every later request 200, not one in two 401 from the other node), the
// devices' frontend refuses /metrics and pprof, and an MQTT kettle reaches
// a node with its own address (PROXY protocol v2: the node's log names it).
func TestHAProxyConfig(t *testing.T) {
	bin := testkit.Tool(t, "haproxy", "haproxy")
	dir := t.TempDir()
	const op = "haproxy-test-operator-token"
	const secret = "haproxy-test-device-secret"
	lb, err := server.ParseTrustedProxies(haproxyNet + ".30")
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	for i := 1; i <= 2; i++ {
		mc := mqttapi.DefaultConfig()
		mc.Addr = fmt.Sprintf("%s.2%d:1883", haproxyNet, i)
		srv, err := server.Start(context.Background(), server.Config{
			Addr: fmt.Sprintf("%s.2%d:8080", haproxyNet, i), DB: "sqlite:" + filepath.Join(dir, fmt.Sprintf("k%d.db", i)),
			DataDir: filepath.Join(dir, fmt.Sprint(i)), OperatorToken: op, Secret: secret, MQTT: mc, TrustedProxies: lb,
			Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
	}
	tmpl, err := os.ReadFile("haproxy/haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	var cfg strings.Builder
	for _, line := range strings.SplitAfter(string(tmpl), "\n") {
		// Plain frontends only (KETTLE_HA_TLS=0): TestHA runs the TLS ones.
		line = strings.NewReplacer("@NET@", haproxyNet, "@LBNET@", haproxyNet, "@DIR@", dir, "@STATS_PASSWORD@", "stats-password-0123",
			"@TLS@", "#", "@TLSDIR@", dir).Replace(line)
		if strings.Contains(line, "@N@") { // once per node, as cluster.sh writes it
			for n := 1; n <= 2; n++ {
				cfg.WriteString(strings.ReplaceAll(line, "@N@", fmt.Sprint(n)))
			}
			continue
		}
		cfg.WriteString(line)
	}
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	testkit.Start(t, bin, "-db", "-f", path)
	base := "http://" + haproxyNet + ".30:8080"
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 5 * time.Second}
	testkit.WaitFor(t, "haproxy routing /healthz", 20*time.Second, func() bool { return testkit.Answers200(c, base+"/healthz") })
	req, _ := http.NewRequest("POST", base+"/session", strings.NewReader(`{"token":"`+op+`"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Origin", base)
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, res.Body)
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("sign-in through HAProxy: %d", res.StatusCode)
	}
	codes := map[int]int{}
	for range 12 {
		res, err := c.Get(base + "/v1/statistics")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		codes[res.StatusCode]++
	}
	if codes[200] != 12 {
		t.Errorf("12 dashboard reads after one sign-in through round-robin HAProxy: %v, want all 200 (the browser stays on its node)", codes)
	}
	stats := "http://" + haproxyNet + ".30:8404/stats"
	if code := status(t, nil, stats); code != 401 {
		t.Errorf("the stats page without its password: %d, want 401", code)
	}
	sreq, _ := http.NewRequest("GET", stats, nil)
	sreq.SetBasicAuth("kettle", "stats-password-0123")
	if code := status(t, sreq, ""); code != 200 {
		t.Errorf("the stats page with its password: %d, want 200", code)
	}
	mqttThrough(t, haproxyNet+".30:1883", secret, haproxyNet+".41", haproxyNet+".42", func(from string) bool {
		return strings.Contains(logs.String(), `"remote":"`+from+`:`)
	})
	for _, p := range []string{"/metrics", "/debug/pprof/"} {
		res, err := c.Get(base + p)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != 404 {
			t.Errorf("GET %s through the devices' frontend: %d, want 404", p, res.StatusCode)
		}
	}
}

// status is the status of req (or of a GET of url).
func status(t *testing.T, req *http.Request, url string) int {
	t.Helper()
	if req == nil {
		req, _ = http.NewRequest("GET", url, nil)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	return res.StatusCode
}

// mqttThrough connects two MQTT kettles to the balancer's MQTT frontend at
// addr, from okFrom with its own token (CONNACK 0) and from refusedFrom
// with another's (refused), and waits until logged(refusedFrom) reports
// the refusal logged under that address — the kettle's, not the
// balancer's (PROXY protocol v2).
func mqttThrough(t *testing.T, addr, secret, okFrom, refusedFrom string, logged func(from string) bool) {
	t.Helper()
	connect := func(from string, id uuid.UUID, tok string) byte {
		t.Helper()
		c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}).Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cl := paho.NewClient(paho.ClientConfig{Conn: c, ClientID: id.String()})
		ca, err := cl.Connect(ctx, &paho.Connect{ClientID: id.String(), CleanStart: true, KeepAlive: 30,
			UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(tok)})
		if ca == nil {
			t.Fatalf("MQTT from %s through %s: no CONNACK: %v", from, addr, err)
		}
		if ca.ReasonCode == 0 {
			cl.Disconnect(&paho.Disconnect{})
		}
		return ca.ReasonCode
	}
	a, b := uuid.New(), uuid.New()
	if code := connect(okFrom, a, kettle.DeviceToken([]byte(secret), a)); code != 0 {
		t.Fatalf("an MQTT kettle through HAProxy: CONNACK 0x%02x, want 0x00", code)
	}
	if code := connect(refusedFrom, b, kettle.DeviceToken([]byte(secret), a)); code < 0x80 {
		t.Fatalf("an MQTT kettle with another's token through HAProxy: CONNACK 0x%02x, want a refusal", code)
	}
	testkit.WaitFor(t, "a refusal logged under the kettle's address "+refusedFrom+" (the balancer's MQTT server lines need send-proxy-v2)", 10*time.Second, func() bool { return logged(refusedFrom) })
}
