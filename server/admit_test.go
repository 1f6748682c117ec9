package server_test

import (
	"bufio"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/server"
)

// metricValue reads one sample of the server's /metrics (0 when absent).
func metricValue(t *testing.T, srv *server.Server, series string) float64 {
	t.Helper()
	res, err := http.Get(srv.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	sc := bufio.NewScanner(res.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// TestIngestAdmission: with --ingest-queue 2 filled by two uploads waiting
// for a commit (the store's write lock is held by another connection), a
// third upload is refused with 503 + Retry-After before its body is read —
// its body is never even sent — and counted by reason; command polls are
// still answered; once the store is back the two queued readings commit.
func TestIngestAdmission(t *testing.T) {
	dir := t.TempDir()
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		// The store's lock is held longer than the default --store-timeout:
		// this test is about admission, not about the store's deadline.
		c.Ingest = fleet.Config{QueueRows: 2, BatchRows: 1, StoreTimeout: time.Minute}
	})
	c := newClient(t, srv)
	id := uuid.New()
	tok := kettle.DeviceToken(srv.Secret(), id)

	db, err := sql.Open("sqlite3", dir+"/k.db")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := db.Conn(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(t.Context(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	locked := true
	defer func() {
		if locked {
			conn.ExecContext(t.Context(), "ROLLBACK")
		}
		conn.Close()
	}()

	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	var wg sync.WaitGroup
	statuses := make(chan int, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", srv.URL()+"/v1/measurements", strings.NewReader(v1Body(base.Add(time.Duration(i)*time.Second), 1, 2, 3, 20, 60, 500)))
			req.Header.Set("Authorization", "Bearer "+tok)
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				statuses <- -1
				return
			}
			res.Body.Close()
			statuses <- res.StatusCode
		}()
	}
	for deadline := time.Now().Add(20 * time.Second); metricValue(t, srv, "kettle_ingest_queue_rows") < 2; {
		if time.Now().After(deadline) {
			t.Fatal("the two uploads never filled the queue")
		}
		time.Sleep(10 * time.Millisecond)
	}

	// The third: headers announce a body that is never sent.
	nc, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(nc, "POST /v1/measurements HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n", tok)
	res, err := http.ReadResponse(bufio.NewReader(nc), nil)
	if err != nil {
		t.Fatalf("no answer before the body was sent: %v", err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 503 || res.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "--ingest-queue") {
		t.Fatalf("third upload → %d Retry-After %q %s; want 503 with Retry-After naming --ingest-queue", res.StatusCode, res.Header.Get("Retry-After"), body)
	}
	if v := metricValue(t, srv, `kettle_http_requests_shed_total{reason="ingest_queue_full"}`); v != 1 {
		t.Errorf(`kettle_http_requests_shed_total{reason="ingest_queue_full"} = %v, want 1`, v)
	}
	if r := c.do("GET", "/v1/command", bearer(tok), ""); r.status != 200 {
		t.Errorf("command poll while ingest is at its limit: %d", r.status)
	}

	conn.ExecContext(t.Context(), "ROLLBACK")
	locked = false
	wg.Wait()
	close(statuses)
	for s := range statuses {
		if s != 200 {
			t.Errorf("a queued upload got %d after the store came back, want 200", s)
		}
	}
}
