package server_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/server"
)

// skewedClock is a server clock that tests move forward.
type skewedClock struct{ skew atomic.Int64 }

func (c *skewedClock) now() time.Time          { return time.Now().Add(time.Duration(c.skew.Load())) }
func (c *skewedClock) forward(d time.Duration) { c.skew.Add(int64(d)) }

type pruneAnswer struct {
	Removed           int    `json:"removed"`
	RegisteredBefore  string `json:"registered_before"`
	DryRun            bool   `json:"dry_run"`
	DevicesRegistered int    `json:"devices_registered"`
}

// TestPrune: POST /v1/devices/prune removes the registrations nothing came
// of — logged in or provisioned, never a reading, older than older_than —
// and keeps kettles that reported, revoked ones (their credentials must stay
// refused) and young ones; the registry, its bound and the statistics count
// only what is left; a pruned case-study kettle must log in again, a pruned
// v1 kettle is registered again by its upload.
func TestPrune(t *testing.T) {
	forEachStore(t, func(t *testing.T, dsn string) {
		clock := &skewedClock{}
		srv := start(t, dsn, func(c *server.Config) {
			c.OperatorToken, c.Now = "operator-token-test", clock.now
			c.Ingest.MaxDevices = 5
		})
		c := newClient(t, srv)
		op := bearer("operator-token-test")
		idle1, idle2, reporter := login(t, c), login(t, c), login(t, c)
		var prov struct{ Devices []struct{ ID, Token string } }
		if r := c.do("POST", "/v1/devices", op, `{"count":2}`); r.status != 201 {
			t.Fatalf("provision: %d %s", r.status, r.body)
		} else {
			r.json(t, &prov)
		}
		provisioned, revoked := prov.Devices[0], prov.Devices[1]
		if r := c.do("DELETE", "/v1/devices/"+revoked.ID, op, ""); r.status != 204 {
			t.Fatalf("revoke: %d %s", r.status, r.body)
		}
		if r := c.do("POST", "/measurement", cookie(reporter), v0Body(clock.now().UTC(), 50, 100, 1, 20, 60, 500)); r.status != 200 {
			t.Fatalf("reading: %d %s", r.status, r.body)
		}
		if r := c.do("POST", "/login", nil, `{"username":"kettle"}`); r.status != 403 {
			t.Fatalf("a sixth login with --max-devices 5: %d %s", r.status, r.body)
		}

		bad := func(body, want string) {
			t.Helper()
			r := c.do("POST", "/v1/devices/prune", op, body)
			if r.status != 400 || !strings.Contains(string(r.body), `"older_than"`) || !strings.Contains(string(r.body), want) {
				t.Errorf("prune %s: %d %s; want 400 naming older_than (%s)", body, r.status, r.body, want)
			}
		}
		bad(`{}`, "required")
		bad(`{"older_than":"5m"}`, "at least 10m")
		bad(`{"older_than":"soon"}`, "90d")
		bad(`{"older_than":"-1h"}`, "2160h")
		if r := c.do("POST", "/v1/devices/prune", nil, `{"older_than":"1h"}`); r.status != 401 {
			t.Errorf("prune without the operator token: %d", r.status)
		}
		if r := c.do("POST", "/v1/devices/prune", bearer(provisioned.Token), `{"older_than":"1h"}`); r.status != 403 {
			t.Errorf("prune with a device token: %d", r.status)
		}
		prune := func(body string, want pruneAnswer) {
			t.Helper()
			r := c.do("POST", "/v1/devices/prune", op, body)
			var got pruneAnswer
			if r.status != 200 {
				t.Fatalf("prune %s: %d %s", body, r.status, r.body)
			}
			r.json(t, &got)
			if got.Removed != want.Removed || got.DryRun != want.DryRun || got.DevicesRegistered != want.DevicesRegistered {
				t.Errorf("prune %s: %s; want removed %d, dry run %v, %d registered", body, r.body, want.Removed, want.DryRun, want.DevicesRegistered)
			}
		}
		prune(`{"older_than":"1h"}`, pruneAnswer{Removed: 0, DevicesRegistered: 5}) // all registered just now
		clock.forward(2 * time.Hour)
		prune(`{"older_than":"1h","dry_run":true}`, pruneAnswer{Removed: 3, DryRun: true, DevicesRegistered: 5})
		prune(`{"older_than":"1h"}`, pruneAnswer{Removed: 3, DevicesRegistered: 2})
		prune(`{"older_than":"1h"}`, pruneAnswer{Removed: 0, DevicesRegistered: 2})

		if n := metric(t, c, "kettle_devices_pruned_total"); n != 3 {
			t.Errorf("kettle_devices_pruned_total %v, want 3", n)
		}
		if n := metric(t, c, "kettle_devices_registered"); n != 2 {
			t.Errorf("kettle_devices_registered %v, want 2", n)
		}
		var st httpapi.StatsJSON
		c.do("GET", "/v1/statistics", op, "").json(t, &st)
		if st.DevicesRegistered != 2 || st.MeasurementCount != 1 {
			t.Errorf("statistics after the prune: %d devices, %d readings; want 2, 1", st.DevicesRegistered, st.MeasurementCount)
		}
		for _, id := range []string{idle1, idle2} {
			if r := c.do("POST", "/measurement", cookie(id), v0Body(clock.now().UTC(), 50, 100, 1, 20, 60, 500)); r.status != 401 || !strings.Contains(string(r.body), "POST /login") {
				t.Errorf("a pruned case-study kettle's reading: %d %s; want 401 telling it to log in", r.status, r.body)
			}
			if r := c.do("GET", "/v1/devices/"+id, op, ""); r.status != 404 {
				t.Errorf("GET a pruned device: %d", r.status)
			}
		}
		if r := c.do("POST", "/measurement", cookie(reporter), v0Body(clock.now().UTC(), 40, 100, 1, 20, 60, 500)); r.status != 200 {
			t.Errorf("the kettle that reported: %d %s", r.status, r.body)
		}
		if r := c.do("POST", "/v1/measurements", bearer(revoked.Token), v1Body(clock.now().UTC(), 1, 2, 3, 4, 5, 6)); r.status != 401 && r.status != 403 {
			t.Errorf("the revoked kettle after a prune: %d %s; want it still refused", r.status, r.body)
		}
		if r := c.do("POST", "/v1/measurements", bearer(provisioned.Token), v1Body(clock.now().UTC(), 1, 2, 3, 4, 5, 6)); r.status != 200 {
			t.Errorf("a pruned v1 kettle's upload: %d %s; want 200 (registered again)", r.status, r.body)
		}
		// The registry has room again: new logins fill it back to the bound.
		for range 2 {
			login(t, c)
		}
		if r := c.do("POST", "/login", nil, `{"username":"kettle"}`); r.status != 403 {
			t.Errorf("a login past --max-devices after the prune: %d", r.status)
		}
		c.do("GET", "/v1/statistics", op, "").json(t, &st)
		if st.DevicesRegistered != 5 || st.MeasurementCount != 3 {
			t.Errorf("statistics at the end: %d devices, %d readings; want 5, 3", st.DevicesRegistered, st.MeasurementCount)
		}
	})
}

// TestPruneOtherNode: devices pruned through node A leave node B's registry
// at B's next cache refresh: B refuses them and counts them no more.
func TestPruneOtherNode(t *testing.T) {
	dsn := pgtest.Start(t)
	clock := &skewedClock{}
	mod := func(c *server.Config) {
		c.Secret, c.OperatorToken, c.Now = "shared-secret-0123456789", "operator-token-test", clock.now
		c.Ingest = fleet.Config{Refresh: 100 * time.Millisecond}
	}
	a, b := start(t, dsn, mod), start(t, dsn, mod)
	ca, cb := newClient(t, a), newClient(t, b)
	var ids []string
	for range 3 {
		ids = append(ids, login(t, cb))
	}
	kept := uuid.New() // a v1 kettle that reports through B
	if r := cb.do("POST", "/v1/measurements", bearer(kettle.DeviceToken([]byte("shared-secret-0123456789"), kept)), v1Body(clock.now().UTC(), 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Fatalf("upload: %d %s", r.status, r.body)
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !ok(); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 5 s", what)
			}
		}
	}
	waitFor("node A sees B's 4 devices", func() bool { return metric(t, ca, "kettle_devices_registered") == 4 })
	clock.forward(time.Hour)
	var got pruneAnswer
	if r := ca.do("POST", "/v1/devices/prune", bearer("operator-token-test"), `{"older_than":"30m"}`); r.status != 200 {
		t.Fatalf("prune on A: %d %s", r.status, r.body)
	} else if r.json(t, &got); got.Removed != 3 || got.DevicesRegistered != 1 {
		t.Fatalf("prune on A: %+v; want 3 removed, 1 left", got)
	}
	waitFor("node B drops the pruned devices", func() bool { return metric(t, cb, "kettle_devices_registered") == 1 })
	if n := metric(t, cb, "kettle_devices_pruned_total"); n != 3 {
		t.Errorf("node B's kettle_devices_pruned_total %v, want 3", n)
	}
	if r := cb.do("POST", "/measurement", cookie(ids[0]), v0Body(clock.now().UTC(), 50, 100, 1, 20, 60, 500)); r.status != 401 {
		t.Errorf("a pruned kettle's reading on node B: %d %s; want 401", r.status, r.body)
	}
	if r := cb.do("GET", "/v1/command", bearer(kettle.DeviceToken([]byte("shared-secret-0123456789"), kept)), ""); r.status != 200 {
		t.Errorf("the kettle that reported, on node B: %d", r.status)
	}
}
