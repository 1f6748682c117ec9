package nemesis_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
)

// TestStatisticsAgainstRows: the checker's recompute of the six statistics
// from the rows equals what a real node serves, and a row the store's
// totals and rollups never saw (written around it) makes them differ.
func TestStatisticsAgainstRows(t *testing.T) {
	dsn := pgtest.Start(t)
	now := time.Now().UTC()
	u := node(t, dsn, now, 0, 0)
	op := map[string]string{"Authorization": "Bearer " + opToken}
	for d := range 4 {
		tok := map[string]string{"Authorization": "Bearer " + kettle.DeviceToken([]byte(secret), uuid.New())}
		for i := range 6 {
			at := now.Add(-time.Duration(d*5+i) * 47 * time.Minute)
			if c := do(t, "POST", u+"/v1/measurements", tok, reading(at, 40+float64(d*7+i)), nil); c != 200 {
				t.Fatalf("reading: %d", c)
			}
		}
	}
	check := func() nemesis.Check {
		t.Helper()
		served, err := nemesis.ServedStats(t.Context(), u, opToken)
		if err != nil {
			t.Fatal(err)
		}
		rows, err := nemesis.RecomputeStats(t.Context(), dsn, httpapi.ReportingWindow)
		if err != nil {
			t.Fatal(err)
		}
		return nemesis.Stats(served, rows)
	}
	if c := check(); !c.Pass || !strings.Contains(c.Detail, "24 measurements, 4 devices (4 reporting)") {
		t.Errorf("served vs rows: %+v", c)
	}
	var st httpapi.StatsJSON
	do(t, "GET", u+"/v1/statistics", op, "", &st)
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var dev uuid.UUID
	if err := conn.QueryRow(t.Context(), `SELECT device FROM measurements LIMIT 1`).Scan(&dev); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(t.Context(), `INSERT INTO measurements (device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml) VALUES ($1, $2, 1, 1, 0, 20, 99, 1)`, dev, now.Add(-time.Minute)); err != nil {
		t.Fatal(err)
	}
	if c := check(); c.Pass || !strings.Contains(c.Detail, "1. measurement_count served 24, rows say 25") {
		t.Errorf("a row around the store: %+v", c)
	}
}

func TestMembersOfOneDatabase(t *testing.T) {
	dsn := pgtest.Start(t)
	u := node(t, dsn, time.Now(), 0, 0)
	tok := map[string]string{"Authorization": "Bearer " + kettle.DeviceToken([]byte(secret), uuid.New())}
	do(t, "POST", u+"/v1/measurements", tok, reading(time.Now().Add(-time.Minute), 55), nil)
	a, b := nemesis.ReadMember(t.Context(), "a", dsn), nemesis.ReadMember(t.Context(), "b", dsn)
	if a.Err != "" || a.Rows != 1 || len(a.Checksum) != 32 || a.Checksum != b.Checksum {
		t.Errorf("members: %+v %+v", a, b)
	}
	do(t, "POST", u+"/v1/measurements", tok, reading(time.Now(), 56), nil)
	if c := nemesis.ReadMember(t.Context(), "a", dsn); c.Rows != 2 || c.Checksum == a.Checksum {
		t.Errorf("a row more, the same digest: %+v then %+v", a, c)
	}
	if m := nemesis.ReadMember(t.Context(), "gone", "postgres://kettle:x@127.0.0.1:1/kettle?connect_timeout=1"); m.Err == "" {
		t.Errorf("a member that does not answer: %+v", m)
	}
}

func TestMemberDSNs(t *testing.T) {
	got, err := nemesis.MemberDSNs("postgres://kettle:pw@198.18.2.11:5432,198.18.2.12:5432,198.18.2.13:5432/kettle?target_session_attrs=read-write&connect_timeout=2")
	if err != nil || len(got) != 3 || got[1] != "postgres://kettle:pw@198.18.2.12:5432/kettle?connect_timeout=2&target_session_attrs=any" {
		t.Errorf("MemberDSNs = %q, %v", got, err)
	}
}

// TestOverrideDriver: against a node, every override the driver set is
// acknowledged and reaches the kettle's next poll; against a node that
// acknowledges overrides and never applies them, none does.
func TestOverrideDriver(t *testing.T) {
	dsn := pgtest.Start(t)
	u := node(t, dsn, time.Now(), 0, 0)
	d, err := nemesis.StartOverrides(t.Context(), u, opToken, 3, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("no override acknowledged in 10 s")
		}
		if d.Acked() >= 3 {
			break
		}
	}
	os, refused := d.Stop()
	if c := nemesis.Overrides(os); !c.Pass || len(os) < 3 || len(refused) > 0 {
		t.Errorf("overrides on a real node: %+v (%d, refused %v)", c, len(os), refused)
	}

	// A node that forgets: 200 to the operator, the kettle's command never changes.
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case "POST":
			w.WriteHeader(201)
			fmt.Fprintf(w, `{"devices":[{"id":%q,"token":"t"}]}`, uuid.New())
		case "PUT":
			w.Write([]byte(`{}`))
		default:
			w.Write([]byte(`{"charge":false,"fill":false,"flush_ml_per_s":0,"reason":"","poll_after_s":1}`))
		}
	}))
	defer fake.Close()
	defer func(w time.Duration) { nemesis.OverrideMaxWait = w }(nemesis.OverrideMaxWait)
	nemesis.OverrideMaxWait = 2 * time.Second
	d, err = nemesis.StartOverrides(t.Context(), fake.URL, opToken, 1, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(10 * time.Second); d.Acked() < 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the forgetting node acknowledged no override in 10 s")
		}
	}
	os, _ = d.Stop()
	if c := nemesis.Overrides(os); c.Pass || !strings.Contains(c.Detail, fmt.Sprintf("0 by the kettle's next poll, 0 later, %d never", len(os))) {
		t.Errorf("overrides a node forgot: %+v", c)
	}
}
