package server_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
)

// TestConnectionCap: connections beyond --max-conns are answered 503 with
// Retry-After and closed at once; when a slot frees, service resumes.
func TestConnectionCap(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.MaxConns = 5 })
	var held []net.Conn
	for i := 0; i < 5; i++ {
		c, err := net.Dial("tcp", srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	waitFor(t, func() bool { return gathered(t, srv, "kettle_http_connections_open") == 5 }, "the server holds the 5 connections")
	c, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, c)
	// Free one slot: a new client is served.
	held[0].Close()
	held = held[1:]
	deadline := time.Now().Add(5 * time.Second)
	for {
		hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		r, err := hc.Get(srv.URL() + "/healthz")
		if err == nil && r.StatusCode == 200 {
			r.Body.Close()
			break
		}
		if r != nil {
			r.Body.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("no service after a slot freed: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, c := range held {
		c.Close()
	}
}

// TestSlowHeadersBounded: a client that never finishes its headers is cut
// off after --read-header-timeout, and others are served meanwhile.
func TestSlowHeadersBounded(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.ReadHeaderTimeout = 300 * time.Millisecond })
	c, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "))
	if r, err := http.Get(srv.URL() + "/healthz"); err != nil || r.StatusCode != 200 {
		t.Fatalf("others not served while a client is slow: %v", err)
	}
	// The server closes the connection (possibly after a 408) well before
	// this deadline: running into it means nobody cut the client off.
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("slow client: %v after reading %q; want the server to close the connection after --read-header-timeout", err, got)
	}
	if len(got) > 0 && !strings.Contains(string(got), "408") {
		t.Errorf("slow client got %q, want the connection closed (after a 408 at most)", got)
	}
}

// expectRefusal reads the answer to a connection over --max-conns: 503 with
// Retry-After. It closes c.
func expectRefusal(t *testing.T, c net.Conn) {
	t.Helper()
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("excess connection: %v", err)
	}
	if res.StatusCode != 503 || res.Header.Get("Retry-After") == "" {
		t.Errorf("excess connection: %d Retry-After %q", res.StatusCode, res.Header.Get("Retry-After"))
	}
}
