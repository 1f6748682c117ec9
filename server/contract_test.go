package server_test

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/server"
)

// errorJSON is an error answer's body as a client reads it.
type errorJSON struct {
	Error     string
	Message   string
	Fields    []kettle.FieldError
	RequestID string `json:"request_id"`
}

// checkErrorBody holds an error answer to its contract: JSON with a code, a
// message and the request id the X-Request-Id header carries.
func checkErrorBody(t *testing.T, what string, r resp, code string) errorJSON {
	t.Helper()
	var e errorJSON
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("%s: error body is not JSON: %q", what, truncate(r.body))
	}
	if e.Error != code || e.Message == "" || e.RequestID == "" || e.RequestID != r.header.Get("X-Request-Id") {
		t.Fatalf("%s → %d %s (X-Request-Id %q); want code %q, a message and the request id", what, r.status, truncate(r.body), r.header.Get("X-Request-Id"), code)
	}
	return e
}

// TestRouterMethods: on every path the API serves, every method it does not
// declare is answered 405 with Allow naming exactly the declared ones; a
// path it does not serve is answered 404; both as JSON errors.
func TestRouterMethods(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	// A path with a wildcard has the methods of every route pattern it
	// matches; a literal one (/v1/devices/prune, which GET
	// /v1/devices/{id} would match too) only its own.
	matches := func(pattern, path string) bool {
		ps, qs := strings.Split(pattern, "/"), strings.Split(path, "/")
		if len(ps) != len(qs) {
			return false
		}
		for i := range ps {
			if ps[i] != qs[i] && !strings.HasPrefix(ps[i], "{") {
				return false
			}
		}
		return true
	}
	id := uuid.NewString()
	declared := map[string][]string{} // path → methods
	for _, rt := range srv.Routes() {
		_, pattern, _ := strings.Cut(rt, " ")
		declared[strings.ReplaceAll(pattern, "{id}", id)] = nil
	}
	for path := range declared {
		literal := !strings.Contains(path, id) // its own methods only, whatever a wildcard route matches
		for _, rt := range srv.Routes() {
			method, pattern, _ := strings.Cut(rt, " ")
			if literal && pattern != path {
				continue
			}
			if matches(pattern, path) && !slices.Contains(declared[path], method) {
				declared[path] = append(declared[path], method)
				if method == "GET" {
					declared[path] = append(declared[path], "HEAD")
				}
			}
		}
	}
	if len(declared) < 10 {
		t.Fatalf("only %d paths routed: %v", len(declared), srv.Routes())
	}
	n := 0
	for path, methods := range declared {
		slices.Sort(methods)
		for _, m := range []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "TRACE", "OPTIONS"} {
			if slices.Contains(methods, m) || m == "HEAD" {
				continue
			}
			r := c.do(m, path, nil, "")
			if r.status != 405 {
				t.Errorf("%s %s → %d, want 405 (declared: %v)", m, path, r.status, methods)
				continue
			}
			allow := strings.Split(r.header.Get("Allow"), ", ")
			slices.Sort(allow)
			if !slices.Equal(allow, methods) {
				t.Errorf("%s %s → Allow %q, want %v", m, path, r.header.Get("Allow"), methods)
			}
			checkErrorBody(t, m+" "+path, r, "method_not_allowed")
			n++
		}
	}
	if n < 40 {
		t.Errorf("only %d undeclared method/path pairs tried", n)
	}
	t.Logf("%d undeclared method/path pairs on %d paths answered 405 with the exact Allow", n, len(declared))
	for _, p := range []string{"/v1/nothing", "/v1/devices/" + uuid.NewString() + "/nothing", "/nothing"} {
		r := c.do("GET", p, nil, "")
		if r.status != 404 {
			t.Errorf("GET %s → %d, want 404", p, r.status)
			continue
		}
		checkErrorBody(t, "GET "+p, r, "not_found")
	}
}

// internalText is what no error body may carry: driver and SQL words, DSN
// and file path pieces.
var internalText = regexp.MustCompile(`(?i)sqlite|sql:|\bsql\b|database is|select |insert |update |delete from|postgres|pgx|dial tcp|connect:|password|user=|host=|dbname|\.db\b|/tmp/|no such|driver|goroutine|\.go:\d`)

// TestErrorsRevealNothing: with the store broken under a running server
// (the real SQLite store closed), every route that needs the store answers
// a 5xx whose body has a stable code, a message for a person and the
// request id, and none of the store's text; the log line with that request
// id has the store's error.
func TestErrorsRevealNothing(t *testing.T) {
	dir := t.TempDir()
	var logs syncbuf.Buffer
	srv := start(t, "sqlite:"+dir+"/k.db", func(c *server.Config) {
		c.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	})
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	dev := uuid.New()
	tok := bearer(kettle.DeviceToken(srv.Secret(), dev))
	now := time.Now().UTC()
	if r := c.do("POST", "/v1/measurements", tok, v1Body(now.Add(-time.Minute), 1, 2, 3, 20, 60, 500)); r.status != 200 {
		t.Fatalf("first reading: %d %s", r.status, r.body)
	}
	cookieID := login(t, c)
	if err := srv.Store().Close(); err != nil {
		t.Fatal(err)
	}

	f := func(method, path string, hdr map[string]string, body string) {
		t.Helper()
		r := c.do(method, path, hdr, body)
		what := method + " " + path
		if r.status < 500 {
			t.Errorf("%s with the store closed → %d %s; want a 5xx", what, r.status, truncate(r.body))
			return
		}
		if m := internalText.Find(r.body); m != nil || bytes.Contains(r.body, []byte(dir)) {
			t.Errorf("%s → %d body carries internal text %q: %s", what, r.status, m, truncate(r.body))
		}
		if path == "/readyz" {
			return
		}
		e := checkErrorBody(t, what, r, "unavailable")
		if r.status == 503 && r.header.Get("Retry-After") == "" {
			t.Errorf("%s → 503 without Retry-After", what)
		}
		// The log names the request id with the store's own words.
		found := false
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, `"request_id":"`+e.RequestID+`"`) && strings.Contains(line, "closed") {
				found = true
			}
		}
		if !found {
			t.Errorf("%s: no log line with request id %s and the store's error:\n%s", what, e.RequestID, logs.String())
		}
		time.Sleep(110 * time.Millisecond) // the detail log is thinned to 10 lines a second
	}
	id := dev.String()
	f("POST", "/v1/measurements", tok, v1Body(now, 1, 2, 3, 20, 60, 500))
	f("POST", "/measurement", cookie(cookieID), v0Body(now, 1, 2, 3, 20, 60, 500))
	f("POST", "/login", nil, `{"username":"kettle"}`)
	f("POST", "/v1/devices", op, `{"count":2}`)
	f("GET", "/v1/devices", op, "")
	f("GET", "/v1/devices/"+id, op, "")
	f("GET", "/v1/devices/"+id+"/measurements", op, "")
	f("PUT", "/v1/devices/"+id+"/override", op, `{"charge":true,"expires_at":"`+now.Add(time.Hour).Format(time.RFC3339)+`"}`)
	f("DELETE", "/v1/devices/"+id+"/override", op, "")
	f("DELETE", "/v1/devices/"+id, op, "")
	f("POST", "/v1/devices/prune", op, `{"older_than":"30d"}`)
	f("GET", "/v1/statistics", op, "")
	f("GET", "/statistics", op, "")
	f("GET", "/readyz", nil, "")
	// Polls are answered from memory whatever the store does.
	if r := c.do("GET", "/v1/command", tok, ""); r.status != 200 {
		t.Errorf("poll with the store closed → %d %s", r.status, truncate(r.body))
	}
}

// TestContractEdges: the four requests the document calls invalid that were
// accepted, the three it calls valid that were refused (now stated), and
// the range /v1/statistics answers: the whole hours it aggregated.
func TestContractEdges(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db")
	c := newClient(t, srv)
	op := bearer(srv.OperatorToken())
	dev := uuid.New()
	if r := c.do("POST", "/v1/measurements", bearer(kettle.DeviceToken(srv.Secret(), dev)), v1Body(time.Now().Add(-time.Minute), 1, 2, 3, 20, 60, 500)); r.status != 200 {
		t.Fatalf("upload: %d %s", r.status, r.body)
	}
	f := func(method, path, body string, status int, field string) {
		t.Helper()
		r := c.do(method, path, op, body)
		if r.status != status {
			t.Errorf("%s %s %s → %d, want %d: %s", method, path, body, r.status, status, truncate(r.body))
			return
		}
		if field != "" {
			e := checkErrorBody(t, method+" "+path, r, "invalid")
			if len(e.Fields) == 0 || e.Fields[0].Field != field {
				t.Errorf("%s %s %s: fields %+v, want %q named", method, path, body, e.Fields, field)
			}
		}
	}
	f("GET", "/v1/devices?limit=&after=", "", 400, "limit")
	f("GET", "/v1/devices?after=", "", 400, "after")
	f("GET", "/v1/statistics?to=", "", 400, "to")
	f("GET", "/v1/devices/"+dev.String()+"/measurements?after=", "", 400, "after")
	f("GET", "/v1/devices/"+dev.String()+"/measurements?from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z", "", 400, "to")
	f("POST", "/v1/devices", "null", 400, "body")
	f("POST", "/v1/devices", `{"count":null}`, 400, "count")
	f("POST", "/v1/devices", `{"count":2,"note":null}`, 201, "") // members it does not name are ignored
	f("POST", "/v1/devices/prune", `{"older_than":""}`, 400, "older_than")
	f("POST", "/v1/devices/prune", `{"older_than":"7d","dry_run":null}`, 400, "dry_run")
	f("PUT", "/v1/devices/"+dev.String()+"/override", `{"charge":true,"expires_at":"2001-01-01T00:00:00Z"}`, 400, "expires_at")
	f("GET", "/v1/statistics?from=2026-01-01T10:00:00Z&to=2026-01-01T10:00:00Z", "", 400, "to")

	var s struct{ From, To *time.Time }
	c.do("GET", "/v1/statistics?from=2026-01-01T10:15:00Z&to=2026-01-01T12:45:30Z", op, "").json(t, &s)
	if s.From == nil || s.To == nil || !s.From.Equal(time.Date(2026, 1, 1, 10, 0, 0, 0, time.UTC)) || !s.To.Equal(time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)) {
		t.Errorf("statistics over 10:15–12:45:30 answered the range %v–%v, want the whole hours it aggregated, 10:00–12:00", s.From, s.To)
	}
}
