package server

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestUploadHoldsBackgroundRead: while uploads wait for their commit, the
// connection's background read (one byte, net/http's) is answered at once,
// once per request, and the connection stays whole: pipelined uploads are
// all answered and stored, and a request after them on the same connection
// is served with a live context (a read error there would have cancelled the
// connection's context, failing the statistics query).
func TestUploadHoldsBackgroundRead(t *testing.T) {
	s, err := Start(context.Background(), Config{
		Addr:    "127.0.0.1:0",
		DB:      "sqlite:" + t.TempDir() + "/k.db",
		DataDir: t.TempDir(),
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	conn, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(conn)
	request := func(method, path string, hdr map[string]string, body string) string {
		var b strings.Builder
		fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: kettle\r\nContent-Length: %d\r\n", method, path, len(body))
		for k, v := range hdr {
			fmt.Fprintf(&b, "%s: %s\r\n", k, v)
		}
		return b.String() + "\r\n" + body
	}
	read := func(what string) []byte {
		t.Helper()
		res, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != 200 {
			t.Fatalf("%s: %d %s", what, res.StatusCode, body)
		}
		return body
	}
	io.WriteString(conn, request("POST", "/login", nil, `{"username":"kettle"}`))
	var login struct{ Username string }
	json.Unmarshal(read("login"), &login)
	upload := func(i int) string {
		return request("POST", "/measurement", map[string]string{"servant-auth-cookie": login.Username},
			fmt.Sprintf(`{"time":"2026-11-22T10:00:%02dZ","charge_now":40,"charge_full":100,"charge_rate":-2,"ambient_temp":21,"water_temp":80,"water_level":700}`, i))
	}
	const single, pipelined = 10, 4
	for i := range single {
		io.WriteString(conn, upload(i))
		read(fmt.Sprintf("upload %d", i))
	}
	var batch strings.Builder
	for i := range pipelined {
		batch.WriteString(upload(single + i))
	}
	io.WriteString(conn, batch.String())
	for i := range pipelined {
		read(fmt.Sprintf("pipelined upload %d", i))
	}
	io.WriteString(conn, request("GET", "/v1/statistics", map[string]string{"Authorization": "Bearer " + s.OperatorToken()}, ""))
	var st struct {
		MeasurementCount int64 `json:"measurement_count"`
	}
	json.Unmarshal(read("statistics after the uploads"), &st)
	if st.MeasurementCount != single+pipelined {
		t.Errorf("measurement_count %d, want %d", st.MeasurementCount, single+pipelined)
	}
	// Each upload's background read starts when its body is read, inside
	// the hold; it is answered once (not retried in a loop), and at least
	// some of them ran before their upload was answered.
	if held := s.ln.held.Load(); held < 1 || held > single+pipelined {
		t.Errorf("background reads answered during uploads: %d, want 1..%d", held, single+pipelined)
	}
}

// TestTrackedConnRead: a 1-byte read while holding reads nothing and leaves
// the byte for the next read; other reads are the connection's.
func TestTrackedConnRead(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	l := &limitListener{}
	c := &trackedConn{Conn: a, l: l}
	c.unhold = func() { c.holding.Store(false) }
	go b.Write([]byte("xy"))
	p := make([]byte, 1)
	unhold := c.hold()
	if n, err := c.Read(p); n != 0 || err != nil {
		t.Fatalf("1-byte read while holding: %d, %v; want 0, nil", n, err)
	}
	unhold()
	if n, err := c.Read(p); n != 1 || err != nil || p[0] != 'x' {
		t.Fatalf("1-byte read after the hold: %q, %v; want x", p[:n], err)
	}
	c.hold()
	buf := make([]byte, 4)
	if n, err := c.Read(buf); n != 1 || err != nil || buf[0] != 'y' {
		t.Fatalf("4-byte read while holding: %q, %v; want y", buf[:n], err)
	}
	if l.held.Load() != 1 {
		t.Errorf("held reads %d, want 1", l.held.Load())
	}
}
