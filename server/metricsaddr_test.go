package server_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/server"
)

// TestMetricsAddr: with --metrics-addr, /metrics is on the operators'
// listener only; the API's listener (what kettles and a balancer reach)
// answers 404 for it.
func TestMetricsAddr(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.MetricsAddr = "127.0.0.1:0" })
	get := func(url string) (int, string) {
		t.Helper()
		res, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if srv.MetricsURL() == srv.URL()+"/metrics" {
		t.Fatalf("MetricsURL %s is on the API's listener", srv.MetricsURL())
	}
	if code, body := get(srv.MetricsURL()); code != 200 || !strings.Contains(body, "kettle_ingest_queue_rows") {
		t.Fatalf("GET %s: %d, want 200 with kettle's metrics", srv.MetricsURL(), code)
	}
	if code, _ := get(srv.URL() + "/metrics"); code != 404 {
		t.Fatalf("GET /metrics on the API's listener: %d, want 404", code)
	}
	if code, _ := get(srv.URL() + "/healthz"); code != 200 {
		t.Fatalf("GET /healthz on the API's listener: %d, want 200", code)
	}
}
