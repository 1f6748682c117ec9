package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/servertest"
	"github.com/kettlefleet/kettlefleet/server"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// forEachStore runs f once against a fresh SQLite file and once against a
// fresh PostgreSQL database: one API suite, every store.
func forEachStore(t *testing.T, f func(t *testing.T, dsn string)) {
	t.Run("sqlite", func(t *testing.T) { f(t, "sqlite:"+t.TempDir()+"/kettle.db") })
	t.Run("postgres", func(t *testing.T) { f(t, pgtest.Start(t)) })
}

// start runs a real kettle serve on 127.0.0.1:0 with a temp data dir, as a
// user would, and stops it at the end of the test.
func start(t *testing.T, dsn string, mod ...func(*server.Config)) *server.Server {
	t.Helper()
	return servertest.Start(t, dsn, mod...)
}

var (
	specOnce   sync.Once
	specRouter routers.Router
	specErr    error
)

func openAPIRouter(t *testing.T) routers.Router {
	specOnce.Do(func() {
		loader := openapi3.NewLoader()
		doc, err := loader.LoadFromData(httpapi.OpenAPI)
		if err != nil {
			specErr = err
			return
		}
		if err := doc.Validate(context.Background()); err != nil {
			specErr = err
			return
		}
		specRouter, specErr = gorillamux.NewRouter(doc)
	})
	if specErr != nil {
		t.Fatalf("openapi.json: %v", specErr)
	}
	return specRouter
}

// client talks to the server over the wire and holds every request and
// response against the OpenAPI document: the document is true or the test
// fails.
type client struct {
	t    *testing.T
	base string
	hc   *http.Client
}

func newClient(t *testing.T, srv *server.Server) *client {
	return &client{t: t, base: srv.URL(), hc: &http.Client{Timeout: 10 * time.Second}}
}

type resp struct {
	status int
	header http.Header
	body   []byte
}

func (r resp) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decode %s: %v", r.body, err)
	}
}

func (c *client) do(method, path string, hdr map[string]string, body string) resp {
	c.t.Helper()
	req, err := http.NewRequest(method, c.base+path, strings.NewReader(body))
	if err != nil {
		c.t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	c.validate(req, body, res, b)
	return resp{res.StatusCode, res.Header, b}
}

// validate checks a documented route's response against the document. Bad
// requests are sent on purpose, so the request is checked only when the
// server accepted it (a 2xx to a request the document calls invalid is a
// lie in one of the two).
func (c *client) validate(req *http.Request, body string, res *http.Response, resBody []byte) {
	c.t.Helper()
	router := openAPIRouter(c.t)
	vreq := req.Clone(context.Background())
	vreq.Body = io.NopCloser(strings.NewReader(body))
	route, params, err := router.FindRoute(vreq)
	if err != nil {
		if res.StatusCode < 400 {
			c.t.Errorf("%s %s answered %d but is not in openapi.json: %v", req.Method, req.URL.Path, res.StatusCode, err)
		}
		return
	}
	in := &openapi3filter.RequestValidationInput{
		Request: vreq, PathParams: params, Route: route,
		Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc, MultiError: true},
	}
	if res.StatusCode < 300 {
		if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
			c.t.Errorf("%s %s → %d, but the request breaks openapi.json: %v", req.Method, req.URL.Path, res.StatusCode, err)
		}
	}
	out := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: in, Status: res.StatusCode, Header: res.Header,
		Body:    io.NopCloser(bytes.NewReader(resBody)),
		Options: &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true},
	}
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		c.t.Errorf("%s %s → %d %s: response breaks openapi.json: %v", req.Method, req.URL.Path, res.StatusCode, truncate(resBody), err)
	}
}

func truncate(b []byte) string {
	if len(b) > 300 {
		return string(b[:300]) + "…"
	}
	return string(b)
}

func bearer(tok string) map[string]string { return map[string]string{"Authorization": "Bearer " + tok} }

func cookie(id string) map[string]string { return map[string]string{"servant-auth-cookie": id} }
