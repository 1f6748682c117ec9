// Package liar is a reverse proxy in front of a real kettle serve that lies
// the way a broken server would: it acknowledges uploads it never stores, or
// reports a stored reading twice. The audit is what is under test, so the
// lie sits at the edge and everything behind it is real.
package liar

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards to a real server and lies as its fields say.
type Proxy struct {
	// Lose, if set, is asked for every POST /v1/measurements (n counts
	// them from 1, from is the client's source IP): true answers 200 as if
	// stored and drops the readings.
	Lose func(from string, n int64) bool
	// Double: the first history page that has a reading lists it twice
	// (a store that kept a reading twice).
	Double bool
	// Delay, if set, holds every device request (uploads and polls) from
	// a source IP this long before it is answered: known latencies.
	Delay func(from string) time.Duration

	seen map[string]int64 // "source-IP endpoint" → device requests

	uploads atomic.Int64
	mu      sync.Mutex
	lost    []Reading
	doubled []string // history paths answered with a doubled reading
	rp      *httputil.ReverseProxy
	srv     *httptest.Server
}

// Reading is one reading the proxy acknowledged and dropped.
type Reading struct {
	Token string // the device's bearer token
	Time  time.Time
}

// Start starts a proxy to target (a kettle serve base URL) on 127.0.0.1:0.
func Start(t *testing.T, target string, p *Proxy) *Proxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p.rp = httputil.NewSingleHostReverseProxy(u)
	p.srv = httptest.NewServer(p)
	t.Cleanup(p.srv.Close)
	return p
}

// URL is the proxy's base URL.
func (p *Proxy) URL() string { return p.srv.URL }

// Lost returns the readings acknowledged and dropped so far.
func (p *Proxy) Lost() []Reading {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Reading(nil), p.lost...)
}

// Doubled returns the history requests answered with a doubled reading.
func (p *Proxy) Doubled() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.doubled...)
}

// Seen counts the device requests of one endpoint ("measurement" or
// "command") the proxy received from a source IP.
func (p *Proxy) Seen(from, endpoint string) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seen[from+" "+endpoint]
}

// ServeHTTP lies where asked to and forwards everything else.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	from, _, _ := net.SplitHostPort(r.RemoteAddr)
	ep := ""
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/v1/measurements":
		ep = "measurement"
	case r.Method == http.MethodGet && r.URL.Path == "/v1/command":
		ep = "command"
	}
	if ep != "" {
		p.mu.Lock()
		if p.seen == nil {
			p.seen = map[string]int64{}
		}
		p.seen[from+" "+ep]++
		p.mu.Unlock()
		if p.Delay != nil {
			time.Sleep(p.Delay(from))
		}
	}
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/v1/measurements" && p.Lose != nil:
		body, err := io.ReadAll(io.LimitReader(r.Body, 4<<20))
		if err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		if p.Lose(from, p.uploads.Add(1)) {
			times := readingTimes(body)
			p.mu.Lock()
			for _, t := range times {
				p.lost = append(p.lost, Reading{Token: strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "), Time: t})
			}
			p.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]int{"stored": len(times), "duplicates": 0})
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		p.rp.ServeHTTP(w, r)
	case r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/measurements") && strings.HasPrefix(r.URL.Path, "/v1/devices/") && p.Double:
		rec := httptest.NewRecorder()
		p.rp.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		if rec.Code == 200 {
			var page map[string]json.RawMessage
			var ms []json.RawMessage
			if json.Unmarshal(body, &page) == nil && json.Unmarshal(page["measurements"], &ms) == nil && len(ms) > 0 {
				p.mu.Lock()
				if len(p.doubled) == 0 {
					p.doubled = append(p.doubled, r.URL.Path)
					ms = append([]json.RawMessage{ms[0]}, ms...)
					page["measurements"], _ = json.Marshal(ms)
					body, _ = json.Marshal(page)
				}
				p.mu.Unlock()
			}
		}
		for k, v := range rec.Header() {
			if k != "Content-Length" {
				w.Header()[k] = v
			}
		}
		w.WriteHeader(rec.Code)
		w.Write(body)
	default:
		p.rp.ServeHTTP(w, r)
	}
}

// readingTimes are the device times of a v1 upload (one object or an array).
func readingTimes(body []byte) []time.Time {
	type m struct {
		Time time.Time `json:"time"`
	}
	var arr []m
	if len(body) > 0 && body[0] == '[' {
		_ = json.Unmarshal(body, &arr)
	} else {
		var one m
		if json.Unmarshal(body, &one) == nil {
			arr = append(arr, one)
		}
	}
	out := make([]time.Time, len(arr))
	for i, a := range arr {
		out[i] = a.Time
	}
	return out
}
