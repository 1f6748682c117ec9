package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestRetention: a server started with --retention 30d removes, at start,
// the days wholly older than 30 days (statistics and device counts follow;
// a kettle whose every reading went keeps its latest state), refuses
// uploads older than the window naming the time field (v1, v1 batch, case
// study), accepts one inside it, and says so on /metrics.
func TestRetention(t *testing.T) { forEachStore(t, testRetention) }

func testRetention(t *testing.T, dsn string) {
	dir := t.TempDir()
	base := func(c *server.Config) {
		c.DataDir, c.Secret, c.OperatorToken = dir, "device-secret-test", "operator-token-test"
	}
	now := time.Now().UTC()
	const keep = 30 * 24 * time.Hour
	before := kettle.ExpireBefore(now, keep)
	var (
		old1  = before.AddDate(0, -2, 14).Add(7 * time.Hour) // two months before the bound
		old2  = before.AddDate(0, 0, -1).Add(9 * time.Hour)  // the day before it
		kept1 = before.Add(50 * time.Hour)                   // after the bound: kept
		kept2 = now.Add(-time.Hour)
	)
	a, b := uuid.New(), uuid.New()
	tokA, tokB := bearer(kettle.DeviceToken([]byte("device-secret-test"), a)), bearer(kettle.DeviceToken([]byte("device-secret-test"), b))
	op := bearer("operator-token-test")
	batch := func(ts ...time.Time) string {
		parts := make([]string, len(ts))
		for i, x := range ts {
			parts[i] = v1Body(x, float64(100+i), 1000, -5, 20, 60+float64(i), 500+float64(i))
		}
		return "[" + strings.Join(parts, ",") + "]"
	}

	// History without retention.
	srv := start(t, dsn, base)
	c := newClient(t, srv)
	if r := c.do("POST", "/v1/measurements", tokA, batch(old1, old2, kept1, kept2)); r.status != 200 {
		t.Fatalf("upload history of a: %d %s", r.status, r.body)
	}
	if r := c.do("POST", "/v1/measurements", tokB, batch(old2.Add(time.Hour), old1)); r.status != 200 {
		t.Fatalf("upload history of b: %d %s", r.status, r.body)
	}
	var st httpapi.StatsJSON
	c.do("GET", "/v1/statistics", op, "").json(t, &st)
	if st.MeasurementCount != 6 {
		t.Fatalf("before retention: %d measurements, want 6", st.MeasurementCount)
	}
	var devB httpapi.DeviceJSON
	c.do("GET", "/v1/devices/"+b.String(), op, "").json(t, &devB)
	srv.Close()

	// Restart with retention: the first expiry runs at start.
	srv = start(t, dsn, base, func(c *server.Config) { c.Ingest.Retention = keep })
	c = newClient(t, srv)
	deadline := time.Now().Add(30 * time.Second)
	for metricValue(t, srv, "kettle_expired_measurements_total") != 4 {
		if time.Now().After(deadline) {
			t.Fatalf("no expiry after 30 s: kettle_expired_measurements_total %v, kettle_expire_errors_total %v",
				metricValue(t, srv, "kettle_expired_measurements_total"), metricValue(t, srv, "kettle_expire_errors_total"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if v := metricValue(t, srv, "kettle_retention_seconds"); v != keep.Seconds() {
		t.Errorf("kettle_retention_seconds %v, want %v", v, keep.Seconds())
	}
	if v := metricValue(t, srv, "kettle_expire_errors_total"); v != 0 {
		t.Errorf("kettle_expire_errors_total %v, want 0", v)
	}
	c.do("GET", "/v1/statistics", op, "").json(t, &st)
	if st.MeasurementCount != 2 {
		t.Errorf("after expiry: %d measurements, want 2 (a's %s and %s)", st.MeasurementCount, kept1, kept2)
	}
	var d httpapi.DeviceJSON
	c.do("GET", "/v1/devices/"+a.String(), op, "").json(t, &d)
	if d.Measurements != 2 || d.Latest == nil || !d.Latest.Time.Equal(kept2.Truncate(time.Microsecond)) {
		t.Errorf("device a after expiry: %d measurements, latest %+v; want 2 and the reading of %s", d.Measurements, d.Latest, kept2)
	}
	c.do("GET", "/v1/devices/"+b.String(), op, "").json(t, &d)
	if d.Measurements != 0 || d.Latest == nil || devB.Latest == nil || *d.Latest != *devB.Latest || d.CapacityML != devB.CapacityML {
		t.Errorf("device b, all of whose history expired: %+v; want 0 measurements and its latest state and capacity as before (%+v)", d, devB)
	}
	var h struct{ Measurements []httpapi.MeasurementJSON }
	c.do("GET", "/v1/devices/"+a.String()+"/measurements", op, "").json(t, &h)
	if len(h.Measurements) != 2 {
		t.Errorf("history of a after expiry: %d readings, want 2", len(h.Measurements))
	}

	// Uploads older than the window are refused, naming the field.
	tooOld := now.Add(-keep - time.Hour)
	for _, u := range []struct {
		path, body, field string
		hdr               map[string]string
	}{
		{"/v1/measurements", v1Body(tooOld, 1, 2, 3, 4, 5, 6), "time", tokA},
		{"/v1/measurements", batch(kept2.Add(time.Minute), tooOld), "[1].time", tokA},
		{"/measurement", v0Body(tooOld, 1, 2, 3, 4, 5, 6), "time", cookie(login(t, c))},
	} {
		r := c.do("POST", u.path, u.hdr, u.body)
		if r.status != 400 || !strings.Contains(string(r.body), `"field":"`+u.field+`"`) || !strings.Contains(string(r.body), "retention") {
			t.Errorf("POST %s older than the retention: %d %s; want 400 naming %s", u.path, r.status, r.body, u.field)
		}
	}
	if r := c.do("POST", "/v1/measurements", tokA, v1Body(now.Add(-keep+time.Hour), 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Errorf("upload inside the retention window: %d %s", r.status, r.body)
	}
	c.do("GET", "/v1/statistics", op, "").json(t, &st)
	if st.MeasurementCount != 3 {
		t.Errorf("after the refused and the accepted uploads: %d measurements, want 3", st.MeasurementCount)
	}
}
