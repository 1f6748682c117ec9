package server_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestTwoNodesOneDatabase: two kettle serve nodes on one PostgreSQL give the
// same answers: a reading taken by node A and an override set on node A
// reach node B's command polls (its cache refreshes from the store), and
// statistics agree.
func TestTwoNodesOneDatabase(t *testing.T) {
	dsn := pgtest.Start(t)
	secret := "shared-secret"
	mod := func(c *server.Config) {
		c.Secret, c.OperatorToken = secret, "op"
		c.Ingest = fleet.Config{Refresh: 200 * time.Millisecond}
	}
	a, b := start(t, dsn, mod), start(t, dsn, mod)
	ca, cb := newClient(t, a), newClient(t, b)
	id := uuid.New()
	tok := bearer(kettle.DeviceToken([]byte(secret), id))
	// Low battery on node A: the policy says charge.
	body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":5,"battery_full_mwh":100,"battery_rate_mw":-1,"ambient_temp_c":20,"water_temp_c":50,"water_level_ml":950}`, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339))
	if r := ca.do("POST", "/v1/measurements", tok, body); r.status != 200 {
		t.Fatalf("node A upload: %d %s", r.status, r.body)
	}
	eventually := func(what string, ok func(httpapi.CommandJSON) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			var c httpapi.CommandJSON
			cb.do("GET", "/v1/command", tok, "").json(t, &c)
			if ok(c) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("node B never saw %s: %+v", what, c)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	eventually("node A's reading", func(c httpapi.CommandJSON) bool {
		return c.Charge && c.Reason != "" && !contains(c.Reason, "no reading")
	})
	exp := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	if r := ca.do("PUT", "/v1/devices/"+id.String()+"/override", bearer("op"), fmt.Sprintf(`{"charge":false,"expires_at":%q}`, exp)); r.status != 200 {
		t.Fatalf("override on A: %d %s", r.status, r.body)
	}
	eventually("node A's override", func(c httpapi.CommandJSON) bool { return !c.Charge && contains(c.Reason, "override") })
	if r := ca.do("DELETE", "/v1/devices/"+id.String()+"/override", bearer("op"), ""); r.status != 204 {
		t.Fatalf("clear on A: %d", r.status)
	}
	eventually("the override cleared on A", func(c httpapi.CommandJSON) bool { return c.Charge })
	var sa, sb httpapi.StatsJSON
	ca.do("GET", "/v1/statistics", bearer("op"), "").json(t, &sa)
	cb.do("GET", "/v1/statistics", bearer("op"), "").json(t, &sb)
	ja, _ := json.Marshal(sa)
	jb, _ := json.Marshal(sb)
	if sa.MeasurementCount != 1 || string(ja) != string(jb) {
		t.Errorf("statistics differ between nodes:\n%+v\n%+v", sa, sb)
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }
