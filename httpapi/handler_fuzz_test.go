package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// fuzzAPI is the real handler on a real SQLite file, with one device that
// has a little history, shared by every input of a fuzz target.
type fuzzAPI struct {
	api    *httpapi.API
	op     string
	dev    uuid.UUID
	devTok string
}

const fuzzSecret = "fuzz-secret"

func newFuzzAPI(f *testing.F) *fuzzAPI {
	ctx := context.Background()
	svc, log := newService(f)
	a := &fuzzAPI{op: "fuzz-operator", dev: uuid.MustParse("7f9a1c52-3b1e-4c4e-9a51-0d7f6a1b2c3d")}
	a.devTok = kettle.DeviceToken([]byte(fuzzSecret), a.dev)
	a.api = httpapi.New(svc, httpapi.Config{OperatorToken: a.op, Secret: []byte(fuzzSecret)}, log)
	if err := svc.RegisterIDs(ctx, []uuid.UUID{a.dev}); err != nil {
		f.Fatal(err)
	}
	base := time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
	var ms []kettle.Measurement
	for i := range 5 {
		ms = append(ms, kettle.Measurement{Device: a.dev, Time: base.Add(time.Duration(i) * time.Minute), ChargeMWh: 10, FullMWh: 20, AmbientC: 20, WaterC: 60, LevelML: 500})
	}
	if _, _, err := svc.Ingest(ctx, ms); err != nil {
		f.Fatal(err)
	}
	return a
}

// newService is a fleet service on a real SQLite file in a temp dir,
// closed when the test ends.
func newService(tb testing.TB) (*fleet.Service, *slog.Logger) {
	tb.Helper()
	ctx := context.Background()
	st, err := sqlite.Open(ctx, tb.TempDir()+"/k.db")
	if err != nil {
		tb.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	svc, err := fleet.New(ctx, st, fleet.Config{}, log, nil, fleet.Hooks{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { svc.Close(); st.Close() })
	return svc, log
}

// serve runs one request through the handler and holds the answer to the
// API's promises: never a 5xx for anything a client sends, and a JSON body
// (an error body naming the error) whenever there is one.
func (a *fuzzAPI) serve(t *testing.T, req *http.Request) {
	t.Helper()
	w := httptest.NewRecorder()
	a.api.ServeHTTP(w, req)
	res := w.Result()
	body := w.Body.Bytes()
	if res.StatusCode >= 500 {
		t.Fatalf("%s %s?%s → %d %s", req.Method, req.URL.Path, req.URL.RawQuery, res.StatusCode, body)
	}
	if len(body) == 0 || res.StatusCode >= 300 && res.StatusCode < 400 {
		return // 204, 304, a redirect of an unclean path (net/http's own body)
	}
	if ct := res.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("%s %s → %d with a %q body, not JSON: %q", req.Method, req.URL.Path, res.StatusCode, ct, body)
	}
	if !json.Valid(body) {
		t.Fatalf("%s %s → %d with a body that is not JSON: %q", req.Method, req.URL.Path, res.StatusCode, body)
	}
	if res.StatusCode >= 400 {
		var e struct{ Error, Message string }
		if json.Unmarshal(body, &e) != nil || e.Error == "" || e.Message == "" {
			t.Fatalf("%s %s → %d without an error code and message: %s", req.Method, req.URL.Path, res.StatusCode, body)
		}
	}
}

// FuzzQueryParams: query strings and path ids of every GET route that takes
// them, decoded by the real handlers (time ranges, limits, cursors, UUIDs).
func FuzzQueryParams(f *testing.F) {
	a := newFuzzAPI(f)
	id := a.dev.String()
	for _, s := range []struct {
		route uint8
		id    string
		q     string
	}{
		{0, "", "from=2026-01-01T00:00:00Z&to=2026-01-02T00:00:00Z"},
		{0, "", "from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z"},
		{0, "", "from=nope&to=" + strings.Repeat("9", 300)},
		{1, "", "from=0001-01-01T00:00:00Z&to=9999-12-31T23:59:59.999999999Z"},
		{2, "", "limit=1000&after=" + id},
		{2, "", "limit=-1&after=xyz"},
		{2, "", "limit=99999999999999999999999&after=%zz"},
		{2, "", "limit=1e3&limit=2"},
		{3, id, ""},
		{3, "not-a-uuid", ""},
		{3, "' OR 1=1 --", ""},
		{4, id, "limit=2&after=2026-01-01T00:00:00Z"},
		{4, id, "from=2026-11-22T10:00:00+14:00&to=2026-11-22T10:00:00-12:00"},
		{4, id, "from=\x00&after=\xff\xfe"},
		{4, strings.ToUpper(id), "limit=0"},
		{5, "", ""},
		{6, "", ""},
	} {
		f.Add(s.route, s.id, s.q)
	}
	routes := []string{"/v1/statistics", "/statistics", "/v1/devices", "/v1/devices/%s", "/v1/devices/%s/measurements", "/v1/command", "/command"}
	f.Fuzz(func(t *testing.T, route uint8, pathID string, rawQuery string) {
		p := routes[int(route)%len(routes)]
		if strings.Contains(p, "%s") {
			p = fmt.Sprintf(p, pathID)
		}
		req := httptest.NewRequest("GET", "/", nil)
		req.URL.Path, req.URL.RawPath, req.URL.RawQuery = p, "", rawQuery
		switch {
		case strings.HasPrefix(p, "/v1/command"):
			req.Header.Set("Authorization", "Bearer "+a.devTok)
		case p == "/command":
			req.Header.Set("servant-auth-cookie", a.dev.String())
		default:
			req.Header.Set("Authorization", "Bearer "+a.op)
		}
		a.serve(t, req)
	})
}

// FuzzRequestBodies: every request body the API decodes, through the real
// handler: login, case-study and v1 readings, provisioning, overrides.
func FuzzRequestBodies(f *testing.F) {
	a := newFuzzAPI(f)
	now := time.Now().UTC().Add(-time.Minute).Format(time.RFC3339Nano)
	v1 := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":1,"battery_full_mwh":2,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":60,"water_level_ml":5}`, now)
	v0 := fmt.Sprintf(`{"id":1,"time":%q,"charge_now":1,"charge_full":2,"charge_rate":0,"ambient_temp":20,"water_temp":60,"water_level":5}`, now)
	for _, s := range []struct {
		route uint8
		body  string
	}{
		{0, `{"username":"k"}`}, {0, `{"username":null}`}, {0, `{"username":["a"]}`}, {0, ``},
		{1, v0}, {1, `{"charge_now":NaN}`}, {1, `{"time":"2026-11-22T10:00:00Z","charge_now":1e999}`},
		{2, v1}, {2, "[" + v1 + "," + v1 + "]"}, {2, `[[[[[[[[[[]]]]]]]]]]`}, {2, `{"time":"\ud800"}`},
		{3, `{"count":2}`}, {3, `{"count":1e3}`}, {3, `{"count":-1}`}, {3, ``},
		{4, `{"charge":true,"expires_at":"2999-01-01T00:00:00Z"}`}, {4, `{"flush_ml_per_s":1e308,"expires_at":"` + time.Now().Add(time.Hour).UTC().Format(time.RFC3339) + `"}`},
		{4, `{"fill":"yes","expires_at":12}`},
	} {
		f.Add(s.route, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		var req *http.Request
		switch route % 5 {
		case 0:
			req = httptest.NewRequest("POST", "/login", strings.NewReader(string(body)))
		case 1:
			req = httptest.NewRequest("POST", "/measurement", strings.NewReader(string(body)))
			req.Header.Set("servant-auth-cookie", a.dev.String())
		case 2:
			req = httptest.NewRequest("POST", "/v1/measurements", strings.NewReader(string(body)))
			req.Header.Set("Authorization", "Bearer "+a.devTok)
		case 3:
			req = httptest.NewRequest("POST", "/v1/devices", strings.NewReader(string(body)))
			req.Header.Set("Authorization", "Bearer "+a.op)
		case 4:
			req = httptest.NewRequest("PUT", "/v1/devices/"+a.dev.String()+"/override", strings.NewReader(string(body)))
			req.Header.Set("Authorization", "Bearer "+a.op)
		}
		req.Header.Set("Content-Type", "application/json")
		a.serve(t, req)
	})
}
