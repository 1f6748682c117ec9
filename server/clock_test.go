package server_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/server"
)

const (
	secret  = "clock-test-device-secret"
	opToken = "clock-test-operator-token"
)

// TestClockSkew: a node on PostgreSQL whose clock (Config.Now) is moved
// away from the database's refuses to serve what its clock decides, saying
// why, and serves again once the clocks agree. An hour ahead: /readyz 503
// naming the skew, a reading 30 minutes inside retention 503 + Retry-After
// (not 400), statistics and overrides 503, kettle_clock_skew_seconds
// ≈ 3600. Two days ahead: the reading 10 minutes inside retention, whose
// day the node's clock calls wholly expired, is still stored after expiry
// rounds ran. An hour behind: not ready either. Back on time: ready, the
// refused reading accepted.
func TestClockSkew(t *testing.T) {
	dsn := pgtest.Start(t)
	var off atomic.Int64 // the node's clock minus the true one
	const keep = 30 * 24 * time.Hour
	srv := start(t, dsn, func(c *server.Config) {
		c.Secret, c.OperatorToken = secret, opToken
		c.Now = func() time.Time { return time.Now().Add(time.Duration(off.Load())) }
		c.Ingest.Retention, c.Ingest.ExpireEvery, c.Ingest.Refresh = keep, 20*time.Millisecond, 20*time.Millisecond
	})
	cl := newClient(t, srv)
	dev := uuid.New()
	tok := bearer(kettle.DeviceToken([]byte(secret), dev))
	op := bearer(opToken)
	upload := func(at time.Time) resp {
		t.Helper()
		return cl.do("POST", "/v1/measurements", tok, v1Body(at, 500, 1000, 0, 20, 60, 700))
	}
	// until waits for the node's next beats to see the clock moved.
	until := func(what string, ok func() bool) {
		t.Helper()
		for end := time.Now().Add(10 * time.Second); !ok(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("10 s without %s", what)
			}
		}
	}
	ready := func() int { return cl.do("GET", "/readyz", nil, "").status }

	edge := time.Now().Add(-keep + 10*time.Minute) // inside retention by 10 minutes
	if r := upload(edge); r.status != 200 {
		t.Fatalf("on time: a reading 10 minutes inside retention: %d %s", r.status, r.body)
	}
	if s := metric(t, cl, "kettle_clock_skew_seconds"); s > 1 || s < -1 {
		t.Errorf("on time: kettle_clock_skew_seconds %v", s)
	}

	off.Store(int64(time.Hour))
	until("/readyz 503 an hour ahead", func() bool { return ready() == 503 })
	if r := cl.do("GET", "/readyz", nil, ""); !strings.Contains(string(r.body), "1h0m0s ahead of the database") {
		t.Errorf("/readyz an hour ahead does not name the skew: %s", r.body)
	}
	inside := time.Now().Add(-keep + 30*time.Minute)
	r := upload(inside)
	if r.status != 503 || r.header.Get("Retry-After") == "" || !strings.Contains(string(r.body), "NTP") {
		t.Errorf("an hour ahead, a reading 30 minutes inside retention: %d Retry-After %q %s; want 503 + Retry-After telling the operator to fix the clock (NTP)",
			r.status, r.header.Get("Retry-After"), r.body)
	}
	if r := cl.do("GET", "/v1/statistics", op, ""); r.status != 503 {
		t.Errorf("an hour ahead, statistics (their reporting window is of the node's clock): %d %s", r.status, r.body)
	}
	if r := cl.do("PUT", fmt.Sprintf("/v1/devices/%s/override", dev), op, fmt.Sprintf(`{"charge":false,"expires_at":%q}`, time.Now().Add(2*time.Hour).Format(time.RFC3339))); r.status != 503 {
		t.Errorf("an hour ahead, an override (its expiry is of the node's clock): %d %s", r.status, r.body)
	}
	if s := metric(t, cl, "kettle_clock_skew_seconds"); s < 3590 || s > 3610 {
		t.Errorf("an hour ahead: kettle_clock_skew_seconds %v", s)
	}
	if n := metric(t, cl, `kettle_ingest_rejected_total{reason="clock_skew"}`); n < 1 {
		t.Errorf("kettle_ingest_rejected_total{reason=\"clock_skew\"} %v", n)
	}

	// Two days ahead the edge reading's day is wholly older than the node's
	// retention window: expiry rounds run (and fail, counted) but delete
	// nothing.
	off.Store(int64(48 * time.Hour))
	runs := metric(t, cl, "kettle_expire_errors_total")
	until("two expiry rounds refused", func() bool { return metric(t, cl, "kettle_expire_errors_total") >= runs+2 })
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM measurements WHERE device = $1`, dev).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("two days ahead: %d readings of the device stored, want the one 10 minutes inside retention", n)
	}

	off.Store(int64(-time.Hour))
	until("/readyz 503 an hour behind", func() bool {
		r := cl.do("GET", "/readyz", nil, "")
		return r.status == 503 && strings.Contains(string(r.body), "1h0m0s behind the database")
	})

	off.Store(0)
	until("/readyz 200 back on time", func() bool { return ready() == 200 })
	if r := upload(inside); r.status != 200 {
		t.Errorf("back on time: the reading 30 minutes inside retention: %d %s", r.status, r.body)
	}
	if r := cl.do("GET", "/v1/statistics", op, ""); r.status != 200 {
		t.Errorf("back on time: statistics %d %s", r.status, r.body)
	}
}

// TestClockSkewAtStart: a node started an hour ahead expires nothing at
// start (the first expiry runs at once) and is not ready from the start;
// with --max-clock-skew negative the check is off.
func TestClockSkewAtStart(t *testing.T) {
	dsn := pgtest.Start(t)
	const keep = 30 * 24 * time.Hour
	good := start(t, dsn, func(c *server.Config) { c.Secret = secret })
	dev := uuid.New()
	// Inside retention by 10 minutes on the true clock; two days ahead,
	// its day is wholly expired.
	edge := time.Now().Add(-keep + 10*time.Minute)
	if r := newClient(t, good).do("POST", "/v1/measurements", bearer(kettle.DeviceToken([]byte(secret), dev)), v1Body(edge, 500, 1000, 0, 20, 60, 700)); r.status != 200 {
		t.Fatalf("upload: %d %s", r.status, r.body)
	}
	skewed := func(max time.Duration) *client {
		return newClient(t, start(t, dsn, func(c *server.Config) {
			c.Now = func() time.Time { return time.Now().Add(48 * time.Hour) }
			c.Ingest.Retention, c.Ingest.MaxClockSkew = keep, max
		}))
	}
	c := skewed(0) // the default
	if r := c.do("GET", "/readyz", nil, ""); r.status != 503 {
		t.Errorf("started two days ahead: /readyz %d %s", r.status, r.body)
	}
	if m := metric(t, c, "kettle_clock_max_skew_seconds"); m != fleet.DefaultMaxClockSkew.Seconds() {
		t.Errorf("kettle_clock_max_skew_seconds %v, want the default %v", m, fleet.DefaultMaxClockSkew.Seconds())
	}
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	count := func() (n int) {
		if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM measurements WHERE device = $1`, dev).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 1 {
		t.Errorf("after a node two days ahead started: %d readings, want 1", n)
	}
	// Unchecked, the same node expires the reading at start: what the
	// check prevents.
	if r := skewed(-1).do("GET", "/readyz", nil, ""); r.status != 200 {
		t.Errorf("--max-clock-skew -1s: /readyz %d %s", r.status, r.body)
	}
	for end := time.Now().Add(10 * time.Second); count() != 0 && time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
	}
	if n := count(); n != 0 {
		t.Errorf("unchecked, a node two days ahead kept %d readings of a day it calls expired (the test no longer shows what the check prevents)", n)
	}
}
