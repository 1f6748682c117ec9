package sim

import (
	"bufio"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/rawio"
)

// TestReadResponse: the swarm's own response reader against the shapes a
// server sends, and what it must refuse.
func TestReadResponse(t *testing.T) {
	f := func(raw string, want rawResponse, wantBody string, wantErr bool) {
		t.Helper()
		br := bufio.NewReaderSize(strings.NewReader(raw+"HTTP/1.1 204 No Content\r\n\r\n"), 256)
		r, err := readResponse(br, nil)
		if (err != nil) != wantErr {
			t.Fatalf("%q: err %v, want error %v", raw, err, wantErr)
		}
		if wantErr {
			return
		}
		if r.status != want.status || string(r.body) != wantBody || r.close != want.close || string(r.etag) != string(want.etag) ||
			r.retryAfter != want.retryAfter || r.maxAge != want.maxAge {
			t.Errorf("%q: got %+v body %q, want %+v body %q", raw, r, r.body, want, wantBody)
		}
		// The connection is positioned at the next response.
		if next, err := readResponse(br, nil); err != nil || next.status != 204 {
			t.Errorf("%q: the next response: %+v %v", raw, next, err)
		}
	}
	ok := rawResponse{response: response{status: 200}}
	f("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"stored\":1}\n", ok, "{\"stored\":1}\n", false)
	f("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nEtag: \"c1\"\r\nCache-Control: private, max-age=5\r\n\r\n{}",
		rawResponse{response: response{status: 200, etag: []byte(`"c1"`), maxAge: 5 * time.Second}}, "{}", false)
	f("HTTP/1.1 304 Not Modified\r\nETag: \"c1\"\r\n\r\n", rawResponse{response: response{status: 304, etag: []byte(`"c1"`)}}, "", false)
	f("HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: 0\r\n\r\n",
		rawResponse{response: response{status: 503, retryAfter: 2 * time.Second}}, "", false)
	f("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\nX-Trailer: 1\r\n\r\n", ok, "abcdefg", false)
	f("HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbad",
		rawResponse{response: response{status: 400}, close: true}, "bad", false)
	f("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", rawResponse{response: response{status: 200}, close: true}, "x", false)
	f("HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\nab", ok, "", true)            // cut short
	f("HTTP/1.1 2x0 OK\r\n\r\n", ok, "", true)                                     // bad status
	f("HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", ok, "", true)               // bad length
	f("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", ok, "", true)          // unsupported
	f("HTTP/1.1 200 OK\r\nX: "+strings.Repeat("a", 300)+"\r\n\r\n", ok, "", true)  // longer than the buffer
	f("HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", ok, "", true)         // over maxBody
	f("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ok, "", true) // bad chunk size
	f("HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", ok, "", true)                    // no colon
}

// TestAckLog: the compact log gives back what went in, in order, signs and
// repeats included.
func TestAckLog(t *testing.T) {
	in := []int64{1_764_000_000_000_000, 1_764_000_030_000_001, 1_764_000_030_000_001, 1_764_000_000_000_007, 1_764_000_090_123_456}
	var a ackLog
	for _, v := range in {
		a.add(v)
	}
	got := a.times()
	if len(got) != len(in) {
		t.Fatalf("got %v, want %v", got, in)
	}
	for i := range in {
		if got[i] != in[i] {
			t.Fatalf("got %v, want %v", got, in)
		}
	}
	if per := float64(len(a.b)-8) / float64(len(in)-1); per > 5 {
		t.Errorf("%.1f bytes a reading after the first", per)
	}
}

// TestPoolDo: requests pipelined on one connection are answered in order;
// an answer with Connection: close sends the rest on a new connection; a
// reused connection the server closed while idle is redialed once; a fresh
// one that fails is an error for every request, not retried.
func TestPoolDo(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/close" {
			w.Header().Set("Connection", "close")
		}
		w.Header().Set("ETag", `"`+r.URL.Path+`"`)
		w.WriteHeader(200)
	}))
	srv.Config.IdleTimeout = 50 * time.Millisecond
	srv.Start()
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	p := newPool(1, false, dialer(addr, nil, time.Second, nil))
	sl := <-p.shared
	do := func(paths ...string) (got []string) {
		t.Helper()
		var raw []byte
		var ends []int
		for _, path := range paths {
			raw = endRequest(appendRequestLine(raw, "GET", addr, "", path), nil)
			ends = append(ends, len(raw))
		}
		p.do(sl, raw, ends, time.Now().Add(5*time.Second), func(j int, r response, err error) {
			if err != nil {
				got = append(got, "error")
				return
			}
			got = append(got, strconv.Itoa(j)+" "+string(r.etag))
		})
		return got
	}
	check := func(got []string, dials int64, want ...string) {
		t.Helper()
		if strings.Join(got, ",") != strings.Join(want, ",") || p.dials.Load() != dials {
			t.Errorf("answers %q after %d dials, want %q after %d", got, p.dials.Load(), want, dials)
		}
	}
	check(do("/a", "/b"), 1, `0 "/a"`, `1 "/b"`)
	if (sl.c.raw != nil) != rawio.Enabled {
		t.Errorf("plain TCP read and written by rawio: %v, want %v", sl.c.raw != nil, rawio.Enabled)
	}
	check(do("/close", "/c"), 2, `0 "/close"`, `1 "/c"`)
	time.Sleep(200 * time.Millisecond) // the server closes the idle connection
	check(do("/d", "/e"), 3, `0 "/d"`, `1 "/e"`)

	// A server that takes connections and closes them unanswered.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	p = newPool(1, false, dialer(ln.Addr().String(), nil, time.Second, nil))
	sl = <-p.shared
	check(do("/f", "/g"), 1, "error", "error")

	// A server that takes connections and never answers: the deadline ends
	// the wait, counted as a timeout.
	quiet, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer quiet.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := quiet.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	p = newPool(1, false, dialer(quiet.Addr().String(), nil, time.Second, nil))
	sl = <-p.shared
	raw := endRequest(appendRequestLine(nil, "GET", addr, "", "/h"), nil)
	var kinds []string
	start := time.Now()
	p.do(sl, raw, []int{len(raw)}, time.Now().Add(200*time.Millisecond), func(_ int, _ response, err error) {
		kinds = append(kinds, errKind(err))
	})
	if took := time.Since(start); strings.Join(kinds, ",") != "timeout" || took > 2*time.Second {
		t.Errorf("a server that never answers: errors %q after %v, want one timeout after the 200ms deadline", kinds, took)
	}
}
