package sim

import (
	"bufio"
	"strings"
	"testing"
	"time"
)

// TestReadResponse: the swarm's own response reader against the shapes a
// server sends, and what it must refuse.
func TestReadResponse(t *testing.T) {
	f := func(raw string, want rawResponse, wantBody string, wantErr bool) {
		t.Helper()
		br := bufio.NewReaderSize(strings.NewReader(raw+"HTTP/1.1 204 No Content\r\n\r\n"), 256)
		r, err := readResponse(br)
		if (err != nil) != wantErr {
			t.Fatalf("%q: err %v, want error %v", raw, err, wantErr)
		}
		if wantErr {
			return
		}
		if r.status != want.status || string(r.body) != wantBody || r.close != want.close || r.etag != want.etag ||
			r.retryAfter != want.retryAfter || r.maxAge != want.maxAge {
			t.Errorf("%q: got %+v body %q, want %+v body %q", raw, r, r.body, want, wantBody)
		}
		// The connection is positioned at the next response.
		if next, err := readResponse(br); err != nil || next.status != 204 {
			t.Errorf("%q: the next response: %+v %v", raw, next, err)
		}
	}
	ok := rawResponse{response: response{status: 200}}
	f("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"stored\":1}\n", ok, "{\"stored\":1}\n", false)
	f("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nEtag: \"c1\"\r\nCache-Control: private, max-age=5\r\n\r\n{}",
		rawResponse{response: response{status: 200, etag: `"c1"`, maxAge: 5 * time.Second}}, "{}", false)
	f("HTTP/1.1 304 Not Modified\r\nETag: \"c1\"\r\n\r\n", rawResponse{response: response{status: 304, etag: `"c1"`}}, "", false)
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
