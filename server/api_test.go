package server_test

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	_ "github.com/mattn/go-sqlite3"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/wire"
)

func v0Body(t time.Time, charge, full, rate, amb, water, level float64) string {
	return fmt.Sprintf(`{"id":7,"time":%q,"charge_now":%v,"charge_full":%v,"charge_rate":%v,"ambient_temp":%v,"water_temp":%v,"water_level":%v}`,
		t.Format(time.RFC3339Nano), charge, full, rate, amb, water, level)
}

func v1Body(t time.Time, charge, full, rate, amb, water, level float64) string {
	return fmt.Sprintf(`{"time":%q,"battery_charge_mwh":%v,"battery_full_mwh":%v,"battery_rate_mw":%v,"ambient_temp_c":%v,"water_temp_c":%v,"water_level_ml":%v}`,
		t.Format(time.RFC3339Nano), charge, full, rate, amb, water, level)
}

func login(t *testing.T, c *client) string {
	t.Helper()
	r := c.do("POST", "/login", nil, `{"username":"kettle"}`)
	if r.status != 200 {
		t.Fatalf("login: %d %s", r.status, r.body)
	}
	var out struct{ Username string }
	r.json(t, &out)
	if _, err := uuid.Parse(out.Username); err != nil {
		t.Fatalf("login returned %q, not a UUID", out.Username)
	}
	return out.Username
}

func TestCaseStudyProtocol(t *testing.T) {
	forEachStore(t, func(t *testing.T, dsn string) {
		srv := start(t, dsn)
		c := newClient(t, srv)
		op := bearer(srv.OperatorToken())

		// Credentials: missing, malformed, never issued.
		f := func(hdr map[string]string, want int) {
			t.Helper()
			if r := c.do("GET", "/command", hdr, ""); r.status != want {
				t.Errorf("GET /command with %v: %d, want %d (%s)", hdr, r.status, want, r.body)
			}
		}
		f(nil, 401)
		f(cookie("not-a-uuid"), 401)
		f(cookie(uuid.NewString()), 401)

		// The case study's own client: random but plausible values, never a 4xx.
		rng := rand.New(rand.NewPCG(1, 2))
		now := time.Now().UTC()
		ids := make([]string, 5)
		for i := range ids {
			ids[i] = login(t, c)
			f(cookie(ids[i]), 200)
		}
		sent := map[string]bool{}
		for i := 0; i < 200; i++ {
			id := ids[rng.IntN(len(ids))]
			ts := now.Add(-time.Duration(rng.IntN(86400*30)) * time.Second).Add(time.Duration(rng.IntN(1e6)) * time.Microsecond)
			body := v0Body(ts, float64(rng.IntN(101)), float64(rng.IntN(101)), rng.Float64()*200-100, 20+rng.Float64()*40, 20+rng.Float64()*40, float64(rng.IntN(101)))
			r := c.do("POST", "/measurement", cookie(id), body)
			if r.status != 200 {
				t.Fatalf("case-study reading %s → %d %s", body, r.status, r.body)
			}
			sent[id+ts.Truncate(time.Microsecond).String()] = true
		}
		var st map[string]any
		r := c.do("GET", "/statistics", op, "")
		if r.status != 200 {
			t.Fatalf("GET /statistics: %d %s", r.status, r.body)
		}
		r.json(t, &st)
		if got := st["statsMeasurementCount"].(float64); int(got) != len(sent) {
			t.Errorf("statsMeasurementCount = %v, want %d", got, len(sent))
		}
		if got := st["statsNumDevices"].(float64); got != 5 {
			t.Errorf("statsNumDevices = %v, want 5", got)
		}
		if c.do("GET", "/statistics", nil, "").status != 401 {
			t.Error("GET /statistics without operator token was not refused")
		}
		if c.do("GET", "/statistics", cookie(ids[0]), "").status != 401 {
			t.Error("GET /statistics with a device cookie was not refused")
		}
	})
}

func TestV1DevicesMeasurementsCommands(t *testing.T) {
	forEachStore(t, func(t *testing.T, dsn string) {
		srv := start(t, dsn)
		c := newClient(t, srv)
		op := bearer(srv.OperatorToken())

		r := c.do("POST", "/v1/devices", op, `{"count":3}`)
		if r.status != 201 {
			t.Fatalf("provision: %d %s", r.status, r.body)
		}
		var prov struct {
			Devices []struct{ ID, Token string }
		}
		r.json(t, &prov)
		if len(prov.Devices) != 3 {
			t.Fatalf("provisioned %d devices, want 3", len(prov.Devices))
		}
		d0 := prov.Devices[0]
		dev := bearer(d0.Token)

		// A batch with a duplicate inside it, then the same batch again.
		base := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
		var parts []string
		for i := 0; i < 10; i++ {
			parts = append(parts, v1Body(base.Add(time.Duration(i)*30*time.Second), 500-float64(i), 1000, -5, 21, 90, 800))
		}
		parts = append(parts, parts[3])
		batch := "[" + strings.Join(parts, ",") + "]"
		want := func(body string, stored, dups int) {
			t.Helper()
			r := c.do("POST", "/v1/measurements", dev, body)
			if r.status != 200 {
				t.Fatalf("upload: %d %s", r.status, r.body)
			}
			var got struct{ Stored, Duplicates int }
			r.json(t, &got)
			if got.Stored != stored || got.Duplicates != dups {
				t.Errorf("upload → stored %d duplicates %d, want %d and %d", got.Stored, got.Duplicates, stored, dups)
			}
		}
		want(batch, 10, 1)
		want(batch, 0, 11)
		want(parts[0], 0, 1)
		// Back-dated: stored, but does not replace the latest state.
		want(v1Body(base.Add(-48*time.Hour), 1, 1000, 0, 5, 5, 5), 1, 0)

		// The device reads itself; latest is the newest by device time.
		r = c.do("GET", "/v1/devices/"+d0.ID, dev, "")
		if r.status != 200 {
			t.Fatalf("GET device: %d %s", r.status, r.body)
		}
		var dj httpapi.DeviceJSON
		r.json(t, &dj)
		if dj.Latest == nil || !dj.Latest.Time.Equal(base.Add(9*30*time.Second)) || dj.Measurements != 11 || dj.CapacityML != 800 {
			t.Errorf("device state = %+v latest %+v", dj, dj.Latest)
		}
		if dj.Command == nil || dj.Command.Reason == "" {
			t.Errorf("device has no command/reason: %s", r.body)
		}

		// History pages in time order with a cursor.
		var all []time.Time
		for _, m := range history(t, c, op, d0.ID, 4) {
			all = append(all, m.Time)
		}
		if len(all) != 11 || !sort.SliceIsSorted(all, func(i, j int) bool { return all[i].Before(all[j]) }) {
			t.Errorf("history: %d rows, sorted=%v", len(all), sort.SliceIsSorted(all, func(i, j int) bool { return all[i].Before(all[j]) }))
		}

		// Command with ETag; an override changes it; clearing restores it.
		r = c.do("GET", "/v1/command", dev, "")
		var cmd wire.CommandJSON
		r.json(t, &cmd)
		etag := r.header.Get("ETag")
		if etag == "" || cmd.PollAfterS < 1 {
			t.Fatalf("command %s etag %q", r.body, etag)
		}
		if r := c.do("GET", "/v1/command", map[string]string{"Authorization": "Bearer " + d0.Token, "If-None-Match": etag}, ""); r.status != 304 {
			t.Errorf("If-None-Match with the current ETag: %d, want 304", r.status)
		}
		exp := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
		r = c.do("PUT", "/v1/devices/"+d0.ID+"/override", op, fmt.Sprintf(`{"charge":%v,"flush_ml_per_s":25,"expires_at":%q}`, !cmd.Charge, exp))
		if r.status != 200 {
			t.Fatalf("override: %d %s", r.status, r.body)
		}
		var cmd2 wire.CommandJSON
		r = c.do("GET", "/v1/command", map[string]string{"Authorization": "Bearer " + d0.Token, "If-None-Match": etag}, "")
		if r.status != 200 {
			t.Fatalf("command after override: %d, want 200 with a new ETag", r.status)
		}
		r.json(t, &cmd2)
		if cmd2.Charge == cmd.Charge || cmd2.FlushMLPerS != 25 || !strings.Contains(cmd2.Reason, "override") {
			t.Errorf("override not applied: %+v", cmd2)
		}
		if r := c.do("DELETE", "/v1/devices/"+d0.ID+"/override", op, ""); r.status != 204 {
			t.Errorf("clear override: %d %s", r.status, r.body)
		}
		var cmd3 wire.CommandJSON
		c.do("GET", "/v1/command", dev, "").json(t, &cmd3)
		if cmd3.Charge != cmd.Charge || cmd3.FlushMLPerS != cmd.FlushMLPerS {
			t.Errorf("after clearing: %+v, want %+v", cmd3, cmd)
		}

		// Device list with cursor pagination.
		seen := map[string]bool{}
		after := ""
		for page := 0; page < 5; page++ {
			r = c.do("GET", "/v1/devices?limit=2"+after, op, "")
			var l struct {
				Devices []httpapi.DeviceJSON
				Next    string
			}
			r.json(t, &l)
			for _, d := range l.Devices {
				seen[d.ID.String()] = true
			}
			if l.Next == "" {
				break
			}
			after = "&after=" + l.Next
		}
		if len(seen) != 3 {
			t.Errorf("device list saw %d devices, want 3", len(seen))
		}

		// Statistics: open and ranged.
		var s httpapi.StatsJSON
		c.do("GET", "/v1/statistics", op, "").json(t, &s)
		if s.MeasurementCount != 11 || s.DevicesRegistered != 3 || s.DevicesReporting != 1 || s.TotalWaterML != 800 {
			t.Errorf("statistics: %+v", s)
		}
		from := base.Add(-time.Hour).Format(time.RFC3339)
		c.do("GET", "/v1/statistics?from="+from, op, "").json(t, &s)
		if s.RangeCount != 10 || s.MeasurementCount != 11 {
			t.Errorf("ranged statistics: range %d total %d, want 10 and 11", s.RangeCount, s.MeasurementCount)
		}
		if r := c.do("GET", "/v1/devices/"+uuid.NewString(), op, ""); r.status != 404 {
			t.Errorf("unknown device: %d, want 404", r.status)
		}
		for _, p := range []string{"/healthz", "/readyz", "/openapi.json"} {
			if r := c.do("GET", p, nil, ""); r.status != 200 {
				t.Errorf("GET %s: %d", p, r.status)
			}
		}
	})
}

// TestOfflineTokens: a device provisioned offline (kettle token) uploads
// without being registered first, and is registered by its first upload.
func TestOfflineTokens(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	id := uuid.New()
	tok := kettle.DeviceToken(srv.Secret(), id)
	if r := c.do("POST", "/v1/measurements", bearer(tok), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 4, 5, 6)); r.status != 200 {
		t.Fatalf("offline-provisioned upload: %d %s", r.status, r.body)
	}
	if r := c.do("GET", "/v1/devices/"+id.String(), bearer(srv.OperatorToken()), ""); r.status != 200 {
		t.Fatalf("device not registered by its first upload: %d", r.status)
	}
}

func TestAuth(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	a, b := uuid.New(), uuid.New()
	ta, tb := kettle.DeviceToken(srv.Secret(), a), kettle.DeviceToken(srv.Secret(), b)
	for _, tok := range []string{ta, tb} {
		if r := c.do("POST", "/v1/measurements", bearer(tok), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 4, 5, 6)); r.status != 200 {
			t.Fatalf("upload: %d", r.status)
		}
	}
	forged := a.String() + "." + strings.Repeat("A", 43)
	other := kettle.DeviceToken([]byte("another secret"), a)
	f := func(method, path string, hdr map[string]string, want int) {
		t.Helper()
		body := ""
		if method == "PUT" {
			body = `{"charge":true,"expires_at":"2999-01-01T00:00:00Z"}`
		}
		r := c.do(method, path, hdr, body)
		if r.status != want {
			t.Errorf("%s %s %v: %d, want %d (%s)", method, path, hdr, r.status, want, r.body)
		}
		if r.status >= 400 && strings.Contains(string(r.body), "battery") {
			t.Errorf("%s %s refused but leaked data: %s", method, path, r.body)
		}
	}
	f("GET", "/v1/devices/"+b.String(), bearer(ta), 403)
	f("GET", "/v1/devices/"+b.String()+"/measurements", bearer(ta), 403)
	f("GET", "/v1/devices/"+a.String(), bearer(ta), 200)
	f("GET", "/v1/devices", bearer(ta), 403)
	f("GET", "/v1/statistics", bearer(ta), 403)
	f("POST", "/v1/devices", bearer(ta), 403)
	f("PUT", "/v1/devices/"+a.String()+"/override", bearer(ta), 403)
	f("DELETE", "/v1/devices/"+a.String()+"/override", bearer(ta), 403)
	f("GET", "/v1/statistics", bearer("wrong"), 401)
	f("GET", "/v1/statistics", nil, 401)
	f("GET", "/v1/command", bearer(forged), 401)
	f("GET", "/v1/command", bearer(other), 401)
	f("GET", "/v1/command", bearer(srv.OperatorToken()), 401)
	f("GET", "/v1/command", nil, 401)
	f("POST", "/v1/measurements", bearer(forged), 401)
	f("GET", "/v1/devices/"+a.String(), bearer(forged), 401)
}

// TestBadInput: every bad reading gets a 4xx naming the field; never a 500.
func TestBadInput(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	tok := bearer(kettle.DeviceToken(srv.Secret(), uuid.New()))
	now := time.Now().UTC()
	ok := v1Body(now.Add(-time.Minute), 1, 2, 3, 4, 5, 6)
	f := func(body string, wantStatus int, wantField string) {
		t.Helper()
		r := c.do("POST", "/v1/measurements", tok, body)
		if r.status != wantStatus {
			t.Errorf("%s → %d, want %d (%s)", truncate([]byte(body)), r.status, wantStatus, truncate(r.body))
			return
		}
		if wantField == "" {
			return
		}
		var e struct {
			Error  string
			Fields []kettle.FieldError
		}
		r.json(t, &e)
		for _, fe := range e.Fields {
			if fe.Field == wantField {
				return
			}
		}
		t.Errorf("%s → %s: no field %q named", truncate([]byte(body)), r.body, wantField)
	}
	repl := func(field, value string) string {
		var m map[string]json.RawMessage
		json.Unmarshal([]byte(ok), &m)
		if value == "" {
			delete(m, field)
		} else {
			m[field] = json.RawMessage(value)
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	f(ok, 200, "")
	f(repl("battery_charge_mwh", `-3`), 400, "battery_charge_mwh")
	f(repl("battery_full_mwh", `-1`), 400, "battery_full_mwh")
	f(repl("water_level_ml", `-0.5`), 400, "water_level_ml")
	f(repl("water_temp_c", `150.5`), 400, "water_temp_c")
	f(repl("ambient_temp_c", `-51`), 400, "ambient_temp_c")
	f(repl("water_temp_c", `"hot"`), 400, "water_temp_c")
	f(repl("battery_rate_mw", `1e400`), 400, "battery_rate_mw")
	f(repl("battery_rate_mw", `NaN`), 400, "")
	f(repl("water_level_ml", ""), 400, "water_level_ml")
	f(repl("time", `"yesterday"`), 400, "time")
	f(repl("time", `"1999-12-31T23:59:59Z"`), 400, "time")
	f(repl("time", fmt.Sprintf("%q", now.Add(25*time.Hour).Format(time.RFC3339))), 400, "time")
	f(repl("time", `12`), 400, "time")
	f(`{"time":`, 400, "")
	f(`not json`, 400, "")
	f(``, 400, "")
	f(ok+ok, 400, "")
	f("[]", 400, "batch")
	f("["+strings.Repeat(ok+",", 1000)+ok+"]", 400, "batch")
	f("["+ok+","+repl("water_level_ml", `-1`)+"]", 400, "[1].water_level_ml")
	f(strings.Repeat("[", 100000), 400, "")
	f(`{"time":"`+strings.Repeat("x", 2<<20)+`"}`, 413, "")
	f("{\"time\":\"\xff\xfe\"}", 400, "")
	f(repl("water_temp_c", `"'; DROP TABLE measurements; --"`), 400, "water_temp_c")
	f(repl("battery_charge_mwh", `{"$gt":0}`), 400, "battery_charge_mwh")
	f(repl("battery_charge_mwh", `1e308`), 400, "battery_charge_mwh")
	f(repl("battery_charge_mwh", `1e9`), 200, "")

	// Case-study endpoint and operator inputs.
	id := login(t, c)
	g := func(method, path string, hdr map[string]string, body string, want int) {
		t.Helper()
		if r := c.do(method, path, hdr, body); r.status != want {
			t.Errorf("%s %s %s → %d, want %d (%s)", method, path, truncate([]byte(body)), r.status, want, truncate(r.body))
		}
	}
	g("POST", "/measurement", cookie(id), `{"charge_now":1}`, 400)
	g("POST", "/measurement", cookie(id), `[1,2]`, 400)
	g("POST", "/login", nil, `{}`, 400)
	g("POST", "/login", nil, `{"username":5}`, 400)
	op := bearer(srv.OperatorToken())
	g("GET", "/v1/statistics?from=nope", op, "", 400)
	g("GET", "/v1/statistics?from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z", op, "", 400)
	g("GET", "/v1/devices?limit=0", op, "", 400)
	g("GET", "/v1/devices?limit=1001", op, "", 400)
	g("GET", "/v1/devices?after=xyz", op, "", 400)
	g("GET", "/v1/devices/not-a-uuid", op, "", 400)
	g("GET", "/v1/devices/"+id+"/measurements?limit=-1", op, "", 400)
	g("GET", "/v1/devices/"+id+"/measurements?from=x", op, "", 400)
	g("POST", "/v1/devices", op, `{"count":0}`, 400)
	g("POST", "/v1/devices", op, `{"count":1001}`, 400)
	g("PUT", "/v1/devices/"+id+"/override", op, `{"charge":true}`, 400)
	g("PUT", "/v1/devices/"+id+"/override", op, `{"expires_at":"2999-01-01T00:00:00Z"}`, 400)
	g("PUT", "/v1/devices/"+id+"/override", op, `{"charge":true,"expires_at":"2000-01-01T00:00:00Z"}`, 400)
	g("PUT", "/v1/devices/"+uuid.NewString()+"/override", op, fmt.Sprintf(`{"charge":true,"expires_at":%q}`, now.Add(time.Hour).Format(time.RFC3339)), 404)
	g("DELETE", "/v1/devices/"+uuid.NewString()+"/override", op, "", 404)
	g("GET", "/no/such/route", nil, "", 404)

	// A batch of 1,000 empty readings (3 KB) has 7,000 field errors: the
	// answer lists the first 100 and counts the rest, its message names 10.
	r := c.do("POST", "/v1/measurements", tok, "["+strings.Repeat("{},", 999)+"{}]")
	var e struct {
		Message string
		Fields  []kettle.FieldError
	}
	if r.status == 400 {
		r.json(t, &e)
	}
	if last := len(e.Fields) - 1; r.status != 400 || len(r.body) > 20_000 || len(e.Fields) != 101 || e.Fields[last].Message != "6900 more field errors not listed" ||
		!strings.HasSuffix(e.Message, "; and 6990 more") || e.Fields[0].Field != "[0].time" {
		t.Errorf("1,000 empty readings: %d, %d bytes, %d fields; want 400 under 20 KB listing 100 fields and the count of the rest:\n%s", r.status, len(r.body), len(e.Fields), truncate(r.body))
	}
}

// TestQueueFull: while the store cannot commit, readings wait in the
// bounded queue; past its capacity they are refused at once with 503 and
// Retry-After, and command polls keep being answered from memory. When the
// store is back, everything queued commits and is acknowledged.
func TestQueueFull(t *testing.T) {
	dir := t.TempDir()
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		c.Ingest = fleet.Config{QueueRows: 4, BatchRows: 1}
	})
	c := newClient(t, srv)
	id := login(t, c)

	// Another process-like connection holds SQLite's write lock.
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
	var wg sync.WaitGroup
	statuses := make(chan int, 20)
	base := time.Now().Add(-time.Hour)
	for i := 0; i < 12; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			body := v0Body(base.Add(time.Duration(i)*time.Second), 1, 2, 3, 4, 5, 6)
			req, _ := http.NewRequest("POST", srv.URL()+"/measurement", strings.NewReader(body))
			req.Header.Set("servant-auth-cookie", id)
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				statuses <- -1
				return
			}
			res.Body.Close()
			if res.StatusCode == 503 && res.Header.Get("Retry-After") == "" {
				t.Error("503 without Retry-After")
			}
			statuses <- res.StatusCode
		}(i)
	}
	// Refusals come back while the store is still locked.
	refused := 0
	deadline := time.After(20 * time.Second)
	for refused < 12-4-1 {
		select {
		case s := <-statuses:
			if s != 503 {
				t.Fatalf("while the store is locked a reading got %d, want 503 (queue full)", s)
			}
			refused++
		case <-deadline:
			t.Fatalf("only %d refusals while the queue was full", refused)
		}
	}
	// Polls are answered from memory while ingest is stuck.
	if r := c.do("GET", "/command", cookie(id), ""); r.status != 200 {
		t.Errorf("command poll during a stuck store: %d", r.status)
	}
	conn.ExecContext(t.Context(), "ROLLBACK")
	conn.Close()
	wg.Wait()
	close(statuses)
	acked := 0
	for s := range statuses {
		if s == 200 {
			acked++
		} else if s != 503 {
			t.Errorf("status %d after the store came back", s)
		}
	}
	var st httpapi.StatsJSON
	c.do("GET", "/v1/statistics", bearer(srv.OperatorToken()), "").json(t, &st)
	if int(st.MeasurementCount) != acked || acked == 0 {
		t.Errorf("stored %d, acknowledged %d", st.MeasurementCount, acked)
	}
}

// TestOpenAPICoversRoutes: every route the API serves is in the document,
// with its method, and the document names no route that does not exist.
func TestOpenAPICoversRoutes(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	var doc struct {
		Paths map[string]map[string]json.RawMessage
	}
	c.do("GET", "/openapi.json", nil, "").json(t, &doc)
	documented := map[string]bool{}
	for p, ops := range doc.Paths {
		for m := range ops {
			documented[strings.ToUpper(m)+" "+p] = true
		}
	}
	served := map[string]bool{}
	for _, r := range srv.Routes() {
		served[r] = true
		if !documented[r] {
			t.Errorf("route %s is not in openapi.json", r)
		}
	}
	for r := range documented {
		if !served[r] {
			t.Errorf("openapi.json documents %s, which is not served", r)
		}
	}
}

// TestConcurrentUploadsKeepTheirReadings: v1 uploads reuse their body and
// reading buffers once acknowledged; many devices uploading at once must
// still each have exactly their own readings stored, value for value.
func TestConcurrentUploadsKeepTheirReadings(t *testing.T) {
	forEachStore(t, func(t *testing.T, dsn string) {
		srv := start(t, dsn)
		c := newClient(t, srv)
		op := bearer(srv.OperatorToken())
		const devices, uploads, per = 8, 12, 40
		r := c.do("POST", "/v1/devices", op, fmt.Sprintf(`{"count":%d}`, devices))
		if r.status != 201 {
			t.Fatalf("provision: %d %s", r.status, r.body)
		}
		var prov struct {
			Devices []struct{ ID, Token string }
		}
		r.json(t, &prov)
		base := time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
		// reading j of upload u of device d: its time and charge say which
		at := func(u, j int) time.Time { return base.Add(time.Duration(u*per+j) * time.Second) }
		charge := func(d, u, j int) float64 { return float64(d*100000 + u*100 + j) }
		var wg sync.WaitGroup
		errs := make(chan string, devices)
		for d := range devices {
			wg.Go(func() {
				hc := &http.Client{Timeout: 30 * time.Second}
				for u := range uploads {
					parts := make([]string, per)
					for j := range per {
						parts[j] = v1Body(at(u, j), charge(d, u, j), 1e6, -5, 21, 90, 800)
					}
					req, _ := http.NewRequest("POST", srv.URL()+"/v1/measurements", strings.NewReader("["+strings.Join(parts, ",")+"]"))
					req.Header.Set("Authorization", "Bearer "+prov.Devices[d].Token)
					req.Header.Set("Content-Type", "application/json")
					res, err := hc.Do(req)
					if err != nil {
						errs <- err.Error()
						return
					}
					var out struct{ Stored, Duplicates int }
					err = json.NewDecoder(res.Body).Decode(&out)
					res.Body.Close()
					if res.StatusCode != 200 || err != nil || out.Stored != per {
						errs <- fmt.Sprintf("device %d upload %d: %d %+v %v", d, u, res.StatusCode, out, err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Fatal(e)
		}
		for d, dev := range prov.Devices {
			got := history(t, c, op, dev.ID, 1000)
			for _, m := range got {
				k := int(m.Time.Sub(base) / time.Second)
				if want := charge(d, k/per, k%per); m.Charge != want {
					t.Fatalf("device %d reading at %v: charge %v, sent %v", d, m.Time, m.Charge, want)
				}
			}
			if len(got) != uploads*per {
				t.Errorf("device %d: %d readings stored, sent %d", d, len(got), uploads*per)
			}
		}
	})
}

// history reads a device's stored readings through GET
// /v1/devices/{id}/measurements, page by page (limit a page) to the end.
func history(t *testing.T, c *client, hdr map[string]string, id string, limit int) []httpapi.MeasurementJSON {
	t.Helper()
	var all []httpapi.MeasurementJSON
	after := ""
	for page := 0; ; page++ {
		if page > 10000 {
			t.Fatalf("history of %s: still paging after %d pages", id, page)
		}
		r := c.do("GET", fmt.Sprintf("/v1/devices/%s/measurements?limit=%d%s", id, limit, after), hdr, "")
		if r.status != 200 {
			t.Fatalf("history: %d %s", r.status, r.body)
		}
		var h struct {
			Measurements []httpapi.MeasurementJSON
			Next         string
		}
		r.json(t, &h)
		all = append(all, h.Measurements...)
		if h.Next == "" {
			return all
		}
		after = "&after=" + h.Next
	}
}
