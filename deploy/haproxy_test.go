package deploy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
)

// The addresses of TestHAProxyConfig: deploy/cluster.sh's layout (nodes
// @NET@.2N, the balancer @NET@.30) on a block of its own.
const haproxyNet = "127.0.56"

// TestHAProxyConfig runs the shipped deploy/haproxy/haproxy.cfg, rendered
// as cluster.sh renders it, in front of two kettle serve nodes: a browser
// that signed in to the dashboard stays on the node holding its session
// (every later request 200, not one in two 401 from the other node), and
// the devices' frontend refuses /metrics and pprof.
func TestHAProxyConfig(t *testing.T) {
	bin := tool(t, "haproxy", "haproxy")
	dir := t.TempDir()
	const op = "haproxy-test-operator-token"
	for i := 1; i <= 2; i++ {
		srv, err := server.Start(context.Background(), server.Config{
			Addr: fmt.Sprintf("%s.2%d:8080", haproxyNet, i), DB: "sqlite:" + filepath.Join(dir, fmt.Sprintf("k%d.db", i)),
			DataDir: filepath.Join(dir, fmt.Sprint(i)), OperatorToken: op, Logger: slog.New(slog.DiscardHandler)})
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
		line = strings.NewReplacer("@NET@", haproxyNet, "@LBNET@", haproxyNet, "@DIR@", dir, "@STATS_PASSWORD@", "stats-password-0123").Replace(line)
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
	cmd := exec.Command(bin, "-db", "-f", path)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	base := "http://" + haproxyNet + ".30:8080"
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 5 * time.Second}
	deadline := time.Now().Add(20 * time.Second)
	for {
		res, err := c.Get(base + "/healthz")
		if err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("haproxy not routing: %v\n%s", err, out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
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
