package server

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
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
	}), log, 1e-12, time.Now)
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

// TestAccessLogThinsRefusals: under overload a 503 line is written once a
// second with the count of those not written, and so is a 429 line (a kettle
// over --device-rate), each counted apart; other failures get failedLines
// a second per status, and a cookie of any length is written cut to 64.
func TestAccessLogThinsRefusals(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	now := time.Unix(1_800_000_000, 0)
	h := accessLog(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/bad":
			http.Error(w, "no", http.StatusBadRequest)
		case "/limited":
			http.Error(w, "over --device-rate", http.StatusTooManyRequests)
		default:
			http.Error(w, "busy", http.StatusServiceUnavailable)
		}
	}), log, 0.01, func() time.Time { return now })
	f := func(path string, n int, step time.Duration) {
		t.Helper()
		for range n {
			h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("POST", path, nil))
			now = now.Add(step)
		}
	}
	f("/busy", 500, time.Millisecond)    // one line, then 499 held back
	f("/limited", 500, time.Millisecond) // a line of its own (429s counted apart), then 499 held back
	f("/bad", 2, 0)                      // always written
	f("/busy", 1, 500*time.Millisecond)  // a second on: a line saying 499 were not
	f("/limited", 1, 0)                  // and one for the 429s, a second after theirs
	got := buf.String()
	if n := strings.Count(got, `"status":503`); n != 2 {
		t.Errorf("%d lines of 503, want 2:\n%s", n, got)
	}
	if n := strings.Count(got, `"status":400`); n != 2 {
		t.Errorf("%d lines of 400, want 2", n)
	}
	if n := strings.Count(got, `"status":429`); n != 2 {
		t.Errorf("%d lines of 429, want 2:\n%s", n, got)
	}
	if !strings.Contains(got, `"status":503,`) || !strings.Contains(got, `"suppressed_503":499`) || !strings.Contains(got, `"suppressed_429":499`) {
		t.Errorf("no suppressed_503 and suppressed_429 counts of 499:\n%s", got)
	}
	// Other failures: failedLines a second of each status, then the rest
	// counted; the cookie written only as its short hash.
	buf.Reset()
	now = now.Add(time.Minute)
	for range 100 {
		req := httptest.NewRequest("POST", "/bad", nil)
		req.Header.Set("servant-auth-cookie", strings.Repeat("x", 15000))
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	now = now.Add(time.Second)
	f("/bad", 1, 0)
	got = buf.String()
	if n := strings.Count(got, `"status":400`); n != failedLines+1 || !strings.Contains(got, fmt.Sprintf(`"suppressed_400":%d`, 100-failedLines)) {
		t.Errorf("100 failures of one status in a second, then one: %d lines, want %d and the last saying %d were left out:\n%.2000s", n, failedLines+1, 100-failedLines, got)
	}
	if strings.Contains(got, "xxxxxxxx") || !strings.Contains(got, `"device":"`+cookieHash(strings.Repeat("x", 15000))+`"`) {
		t.Errorf("the cookie itself, not its short hash, in the access log:\n%.500s", got)
	}
}
