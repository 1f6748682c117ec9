package server

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestAccessLogKeepsFailures: with a tiny sample, successful requests are
// (almost surely) not logged, every failed one is.
func TestAccessLogKeepsFailures(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	h := accessLog(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/bad" {
			http.Error(w, "no", http.StatusBadRequest)
			return
		}
		w.Write([]byte("ok"))
	}), log, 1e-12)
	for range 1000 {
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/good", nil))
	}
	for range 3 {
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/bad", nil))
	}
	lines := strings.Count(buf.String(), "\n")
	if lines != 3 || strings.Count(buf.String(), `"status":400`) != 3 {
		t.Errorf("logged %d lines, want the 3 failures only:\n%s", lines, buf.String())
	}
}
