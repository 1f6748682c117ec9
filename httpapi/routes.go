package httpapi

import (
	"net/http"
	"net/url"
	"slices"
	"strings"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// methods are those a route may be declared for (HEAD goes with GET).
var methods = []string{"GET", "POST", "PUT", "PATCH", "DELETE"}

// literalMethods makes a path the API names literally (/v1/devices/prune)
// answer 405 to the methods it does not declare, even where a wildcard
// route (GET /v1/devices/{id}) would take them: to a client it is its own
// resource, with its own Allow.
func (a *API) literalMethods() {
	for path, ms := range a.literal {
		for _, m := range methods {
			if slices.Contains(ms, m) {
				continue
			}
			if _, pat := a.strict.Handler(&http.Request{Method: m, URL: &url.URL{Path: path}, Host: "x"}); pat != "" {
				a.mux.HandleFunc(m+" "+path, a.noRoute)
			}
		}
	}
}

// noRoute answers a request no route took: 405 with Allow when the path
// has routes for other methods, else 404; both as JSON errors.
func (a *API) noRoute(w http.ResponseWriter, r *http.Request) {
	allow := ""
	if ms, ok := a.literal[r.URL.Path]; ok {
		allow = allowOf(ms)
	} else {
		h, _ := a.strict.Handler(r)
		probe := &statusProbe{header: http.Header{}}
		h.ServeHTTP(probe, r)
		if probe.status == http.StatusMethodNotAllowed {
			allow = probe.header.Get("Allow")
		}
	}
	if allow != "" {
		w.Header().Set("Allow", allow)
		a.writeError(w, kettle.Errorf(kettle.EMethod, "method %s not allowed on %s; allowed: %s (see /openapi.json)", wire.Truncate(r.Method, 16), wire.Truncate(r.URL.Path, 128), allow))
		return
	}
	a.writeError(w, kettle.Errorf(kettle.ENotFound, "no route %s %s; see /openapi.json", wire.Truncate(r.Method, 16), wire.Truncate(r.URL.Path, 128)))
}

// allowOf is an Allow header for the declared methods ms (GET brings HEAD),
// sorted as net/http sorts its own.
func allowOf(ms []string) string {
	all := slices.Clone(ms)
	if slices.Contains(all, "GET") {
		all = append(all, "HEAD")
	}
	slices.Sort(all)
	return strings.Join(all, ", ")
}

// statusProbe records what the strict mux's own 404/405 handler answers.
type statusProbe struct {
	header http.Header
	status int
}

func (p *statusProbe) Header() http.Header         { return p.header }
func (p *statusProbe) Write(b []byte) (int, error) { return len(b), nil }
func (p *statusProbe) WriteHeader(code int)        { p.status = code }

// routeRecorder registers on the mux and remembers the API's own routes, so
// a test can hold the OpenAPI document against them.
type routeRecorder struct{ a *API }

func (r routeRecorder) HandleFunc(pattern string, h http.HandlerFunc) {
	r.a.mux.HandleFunc(pattern, h)
	r.a.strict.HandleFunc(pattern, h)
	if m, path, ok := strings.Cut(pattern, " "); ok && !strings.Contains(path, "{") {
		r.a.literal[path] = append(r.a.literal[path], m)
	}
	if strings.Contains(pattern, " ") {
		r.a.routes = append(r.a.routes, pattern)
	}
}

// Routes lists the API's route patterns ("METHOD /path/{param}").
func (a *API) Routes() []string { return append([]string(nil), a.routes...) }

// Handle mounts another handler on the API's mux (the dashboard).
func (a *API) Handle(pattern string, h http.Handler) {
	a.mux.Handle(pattern, h)
	a.strict.Handle(pattern, h)
}

// HandleRoute mounts a handler that is part of the documented API (e.g.
// /metrics): it is listed by Routes and must be in the OpenAPI document.
func (a *API) HandleRoute(pattern string, h http.Handler) {
	routeRecorder{a}.HandleFunc(pattern, h.ServeHTTP)
}

// ServeHTTP serves the routes. Every answer carries an X-Request-Id (the
// client's or a proxy's when it sent a usable one): an error body repeats
// it, and the log line with the error's internal cause names it.
func (a *API) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header()[RequestIDHeader] = []string{a.ids.of(r)}
	a.mux.ServeHTTP(w, r)
}
