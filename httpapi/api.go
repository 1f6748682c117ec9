// Package httpapi is kettle serve's HTTP adapter: the case-study protocol
// (unchanged, for kettles in the field), the v1 API, health and the OpenAPI
// document. It decodes and validates, then hands readings to the fleet
// service; it never talks to the store on the poll path.
package httpapi

import (
	"bytes"
	"crypto/subtle"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	gojson "github.com/goccy/go-json"
	"github.com/google/uuid"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
	"github.com/kettlefleet/kettlefleet/wire"
)

// ReportingWindow is how recently a device must have stored a reading to
// count as reporting.
const ReportingWindow = 5 * time.Minute

// Config is what the handler needs besides the fleet service.
type Config struct {
	OperatorToken string
	Secret        []byte
	// PreviousOperatorToken and PreviousSecret, when set, are the operator
	// token and the device secret being retired (--operator-token-previous,
	// --secret-previous): accepted too, and every use of one is reported to
	// OnPreviousCredential (kind "operator", or "device" with its id).
	PreviousOperatorToken string
	PreviousSecret        []byte
	OnPreviousCredential  func(kind string, device kettle.DeviceID)
	// OperatorSession, when set, accepts a request as the operator without a
	// bearer token (the dashboard's session cookie).
	OperatorSession func(*http.Request) bool
	// AdmitIngest, when set, is asked before an ingest request's body is
	// read or its credentials checked, so that refusing excess load costs
	// as little as possible. An error (503 + Retry-After) is answered as is;
	// otherwise release is called once the request is answered.
	AdmitIngest func(*http.Request) (release func(), err error)
	// PollMaxAge, when set, is asked on every v1 command poll: a duration
	// above 0 is sent as Cache-Control max-age (whole seconds, at least 1),
	// asking the kettle not to poll again before then and to keep obeying
	// this answer; 0 sends no-cache (poll on schedule). The server raises
	// it while its CPU is saturated: polls are never refused, so only the
	// kettles polling less often relieves it.
	PollMaxAge func() time.Duration
}

// API holds the routes. Build it with New; it is an http.Handler.
type API struct {
	ingest   Ingester
	registry Registry
	limits   Limits
	reads    Reads
	health   Health
	cfg      Config
	log      *slog.Logger
	mux      *http.ServeMux
	routes   []string
	tokens   *tokenCache
	// strict holds every route of mux but its catch-all: asked only for a
	// request no route took, it tells 405 (with the methods the path
	// allows) from 404, by the mux's own matching rules.
	strict *http.ServeMux
	// literal holds the methods of each path the API names without a
	// wildcard (literalMethods).
	literal map[string][]string
	ids     requestIDs
	// errLog thins the log lines that carry the internal cause of a
	// failed request (an outage fails thousands a second).
	errLog logthin.Limiter
}

// New builds the handler. extra lets the server mount more routes (metrics,
// dashboard) on the same mux before it is served.
func New(svc Fleet, cfg Config, log *slog.Logger) *API {
	a := &API{ingest: svc, registry: svc, limits: svc, reads: svc, health: svc, cfg: cfg, log: log, mux: http.NewServeMux(), strict: http.NewServeMux(), literal: map[string][]string{}, ids: newRequestIDs()}
	a.errLog.Burst = 10
	a.tokens = newTokenCache(cfg.Secret, cfg.PreviousSecret, func(id kettle.DeviceID) { a.previousUsed("device", id) })
	m := routeRecorder{a}
	// Case-study protocol.
	m.HandleFunc("POST /login", a.v0Login)
	m.HandleFunc("GET /command", a.v0Command)
	m.HandleFunc("POST /measurement", a.v0Measurement)
	m.HandleFunc("GET /statistics", a.operator(a.v0Statistics))
	// v1.
	m.HandleFunc("POST /v1/devices", a.operator(a.createDevices))
	m.HandleFunc("GET /v1/devices", a.operator(a.listDevices))
	m.HandleFunc("GET /v1/devices/{id}", a.deviceOrOperator(a.getDevice))
	m.HandleFunc("GET /v1/devices/{id}/measurements", a.deviceOrOperator(a.history))
	m.HandleFunc("DELETE /v1/devices/{id}", a.operator(a.revokeDevice))
	m.HandleFunc("POST /v1/devices/prune", a.operator(a.pruneDevices))
	m.HandleFunc("PUT /v1/devices/{id}/override", a.operator(a.putOverride))
	m.HandleFunc("DELETE /v1/devices/{id}/override", a.operator(a.deleteOverride))
	m.HandleFunc("POST /v1/measurements", a.v1Measurements)
	m.HandleFunc("GET /v1/command", a.v1Command)
	m.HandleFunc("GET /v1/statistics", a.operator(a.v1Statistics))
	// Operations.
	m.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, map[string]string{"status": "ok"}) })
	m.HandleFunc("GET /readyz", a.readyz)
	m.HandleFunc("GET /openapi.json", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(OpenAPI)
	})
	a.mux.HandleFunc("/", a.noRoute)
	a.literalMethods()
	return a
}

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

// ---- errors and JSON ----

// Status maps an error code to its HTTP status — the one place this happens.
func Status(code kettle.Code) int {
	switch code {
	case kettle.EInvalid:
		return http.StatusBadRequest
	case kettle.EUnauthorized:
		return http.StatusUnauthorized
	case kettle.EForbidden:
		return http.StatusForbidden
	case kettle.ENotFound:
		return http.StatusNotFound
	case kettle.ETooLarge:
		return http.StatusRequestEntityTooLarge
	case kettle.ETooMany:
		return http.StatusTooManyRequests
	case kettle.EUnavailable:
		return http.StatusServiceUnavailable
	case kettle.EMethod:
		return http.StatusMethodNotAllowed
	}
	return http.StatusInternalServerError
}

func (a *API) writeError(w http.ResponseWriter, err error) {
	id := w.Header().Get(RequestIDHeader)
	var e *kettle.Error
	if !errors.As(err, &e) {
		e = &kettle.Error{Code: kettle.EInternal, Message: "internal error; the server log names this request id", Cause: err}
	}
	if e.Cause != nil {
		if ok, skipped := a.errLog.Allow(time.Now()); ok {
			a.log.Warn("request failed", "request_id", id, "code", string(e.Code), "err", e.Error(), "similar_not_logged_since_last_line", skipped)
		}
	}
	status := Status(e.Code)
	if e.Code == kettle.EUnavailable || e.Code == kettle.ETooMany {
		ra := e.RetryAfter
		if ra <= 0 {
			ra = time.Second
		}
		w.Header().Set("Retry-After", strconv.Itoa(int((ra+time.Second-1)/time.Second)))
	}
	if e.Code == kettle.EUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="kettlefleet"`)
	}
	writeJSON(w, status, wire.NewErrorJSON(e, id))
}

// writeJSON answers v as JSON with goccy/go-json, as the ingest path
// decodes: the same output as encoding/json (HTML-safe escaping, sorted map
// keys, shortest float forms), without its reflection on every value. A page
// of 1,000 readings of history spent half its CPU in encoding/json.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := gojson.Marshal(v)
	if err != nil {
		http.Error(w, `{"error":"internal","message":"encoding response"}`, 500)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

// ---- authentication ----

type ctxKey int

func bearer(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	if len(h) > 7 && strings.EqualFold(h[:7], "bearer ") {
		return strings.TrimSpace(h[7:]), true
	}
	return "", false
}

func (a *API) isOperator(tok string) bool {
	if subtle.ConstantTimeCompare([]byte(tok), []byte(a.cfg.OperatorToken)) == 1 {
		return true
	}
	if a.cfg.PreviousOperatorToken != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(a.cfg.PreviousOperatorToken)) == 1 {
		a.previousUsed("operator", uuid.Nil)
		return true
	}
	return false
}

// isDeviceToken reports whether tok is a device's token (of either secret).
func (a *API) isDeviceToken(tok string) bool {
	_, which := kettle.VerifyDeviceTokens(tok, a.cfg.Secret, a.cfg.PreviousSecret)
	return which >= 0
}

func (a *API) previousUsed(kind string, id kettle.DeviceID) {
	if a.cfg.OnPreviousCredential != nil {
		a.cfg.OnPreviousCredential(kind, id)
	}
}

// operator guards operator endpoints: the operator token, nothing else.
func (a *API) operator(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tok, ok := bearer(r)
		if !ok && a.cfg.OperatorSession != nil && a.cfg.OperatorSession(r) {
			h(w, r)
			return
		}
		if !ok {
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "operator token required: send Authorization: Bearer <token> (kettle serve prints where it is kept)"))
			return
		}
		if !a.isOperator(tok) {
			if a.isDeviceToken(tok) {
				a.writeError(w, kettle.Errorf(kettle.EForbidden, "a device token cannot use operator endpoints"))
				return
			}
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "wrong operator token"))
			return
		}
		h(w, r)
	}
}

// device authenticates a v1 device token (no store round trip) and takes
// the request against the device's rate (--device-rate: 429 over it).
func (a *API) device(r *http.Request) (kettle.DeviceID, error) {
	tok, ok := bearer(r)
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "device token required: send Authorization: Bearer <device token>")
	}
	id, ok := a.tokens.verify(tok)
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "invalid device token")
	}
	if a.registry.Revoked(id) {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "device %s is revoked", id)
	}
	return id, a.allow(r, id)
}

// rateHold is how long a request refused for a rate is held before it is
// answered 429.
const rateHold = time.Second

// allow takes the request against device id's rate (--device-rate); see
// holdOverRate.
func (a *API) allow(r *http.Request, id kettle.DeviceID) error {
	return holdOverRate(r, a.limits.Allow(id))
}

// holdOverRate holds a request refused for a rate (ETooMany: --device-rate,
// --login-rate) for rateHold before it is answered 429, and takes that off
// its Retry-After; any other err is returned at once. A client that retries
// at once, in a loop, is then answered once a second a connection instead
// of as often as it can send (bench/device-rate.sh: answered at once, one
// runaway kettle on 16 connections was refused 31,767 times a second, and
// the fleet's p99 rose with the CPU that took). The hold is the whole
// second even when the wait is shorter: the wait of a shared rate
// (--login-rate 100: 10 ms) is no bound on how often a loop comes back.
func holdOverRate(r *http.Request, err error) error {
	if err == nil { // every request: no allocation, inlined
		return nil
	}
	return holdRefusal(r, err)
}

// holdRefusal is holdOverRate's slow path.
func holdRefusal(r *http.Request, err error) error {
	var ke *kettle.Error
	if !errors.As(err, &ke) || ke.Code != kettle.ETooMany {
		return err
	}
	t := time.NewTimer(rateHold)
	select {
	case <-t.C:
		ke.RetryAfter -= rateHold // ≤ 0: Retry-After 1
	case <-r.Context().Done():
		t.Stop()
	}
	return ke
}

// remoteAddr is the client's address (the zero Addr if RemoteAddr is not
// an address and port, as under a test's handler).
func remoteAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr()
}

// deviceOrOperator lets the operator read any device and a device read only
// itself.
func (a *API) deviceOrOperator(h func(w http.ResponseWriter, r *http.Request, id kettle.DeviceID)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := uuid.Parse(r.PathValue("id"))
		if err != nil {
			a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid device id", Fields: []kettle.FieldError{{Field: "id", Message: fmt.Sprintf("must be a UUID, got %q", wire.Truncate(r.PathValue("id"), 64))}}})
			return
		}
		tok, ok := bearer(r)
		if !ok && a.cfg.OperatorSession != nil && a.cfg.OperatorSession(r) {
			h(w, r, id)
			return
		}
		if !ok {
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "token required: send Authorization: Bearer <operator or device token>"))
			return
		}
		if !a.isOperator(tok) {
			dev, ok := a.tokens.verify(tok)
			if !ok || a.registry.Revoked(dev) {
				a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "invalid or revoked token"))
				return
			}
			if dev != id {
				a.writeError(w, kettle.Errorf(kettle.EForbidden, "a device may read only its own data"))
				return
			}
			if err := a.allow(r, id); err != nil { // a device's reads count against its rate
				a.writeError(w, err)
				return
			}
		}
		h(w, r, id)
	}
}

// v0Device is the case-study credential: a UUID the fleet issued, on any
// node (an id this node has not seen yet is looked up in the store: 503 +
// Retry-After while the store cannot say, never 401 for an issued id). The
// request is taken against the device's rate (--device-rate: 429 over it).
func (a *API) v0Device(r *http.Request) (kettle.DeviceID, error) {
	c := r.Header.Get("servant-auth-cookie")
	if c == "" {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "missing servant-auth-cookie header; POST /login first")
	}
	id, err := uuid.Parse(c)
	ok := err == nil
	if ok {
		if ok, err = a.registry.Issued(r.Context(), id); err != nil {
			return uuid.Nil, err
		}
	}
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "unknown device; POST /login to register")
	}
	return id, a.allow(r, id)
}

// ---- case-study protocol ----

func (a *API) v0Login(w http.ResponseWriter, r *http.Request) {
	if err := holdOverRate(r, a.limits.AllowLogin(remoteAddr(r))); err != nil {
		a.writeError(w, err)
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req struct {
		Username *string `json:"username"`
	}
	if err := decodeJSON(body, &req); err != nil {
		a.writeError(w, err)
		return
	}
	if req.Username == nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid login", Fields: []kettle.FieldError{{Field: "username", Message: "required"}}})
		return
	}
	ids, err := a.registry.Register(r.Context(), 1)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]string{"username": ids[0].String()})
}

func (a *API) v0Command(w http.ResponseWriter, r *http.Request) {
	id, err := a.v0Device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	c, _ := a.registry.Command(id)
	b := wire.AppendCommandV0(make([]byte, 0, 128), c)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Write(b)
}

// admitIngest asks Config.AdmitIngest; ok false means the refusal is written.
func (a *API) admitIngest(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	if a.cfg.AdmitIngest == nil {
		return func() {}, true
	}
	release, err := a.cfg.AdmitIngest(r)
	if err != nil {
		a.writeError(w, err)
		return nil, false
	}
	return release, true
}

func (a *API) v0Measurement(w http.ResponseWriter, r *http.Request) {
	release, ok := a.admitIngest(w, r)
	if !ok {
		return
	}
	defer release()
	id, err := a.v0Device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	m, err := wire.DecodeV0(body, id, a.ingest.Window())
	if err != nil {
		a.writeError(w, err)
		return
	}
	if _, _, err := a.ingest.Ingest(r.Context(), []kettle.Measurement{m}); err != nil {
		a.writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", "3")
	w.Write([]byte("[]\n"))
}

func (a *API) statistics(r *http.Request) (kettle.Statistics, kettle.StatsQuery, error) {
	q := kettle.StatsQuery{ReportingSince: a.registry.Now().Add(-ReportingWindow)}
	var errs []kettle.FieldError
	queryTime(r, "from", &q.From, &errs)
	queryTime(r, "to", &q.To, &errs)
	checkRange(q.From, q.To, &errs)
	if len(errs) > 0 {
		return kettle.Statistics{}, q, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs}
	}
	s, err := a.reads.Statistics(r.Context(), q)
	return s, q, err
}

func (a *API) v0Statistics(w http.ResponseWriter, r *http.Request) {
	s, _, err := a.statistics(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	hours := make([][2]any, 0, 24)
	for _, h := range s.ByHour {
		if h.Water.N > 0 {
			hours = append(hours, [2]any{h.Hour, [2]float64{h.Water.Mean, h.Water.Stddev()}})
		}
	}
	writeJSON(w, 200, map[string]any{
		"statsMeasurementCount":   s.MeasurementCount,
		"statsNumDevices":         s.DevicesRegistered,
		"statsTotalBatteryCharge": s.TotalChargeMWh,
		"statsTotalWaterVolume":   s.TotalWaterML,
		"statsMeanTemperature":    hours,
		"statsTotalWaterEnergy":   s.TotalPotentialJ(),
	})
}

// ---- v1 ----

// MeasurementJSON is a stored reading as the v1 API returns it.
type MeasurementJSON struct {
	Time    time.Time `json:"time"`
	Charge  float64   `json:"battery_charge_mwh"`
	Full    float64   `json:"battery_full_mwh"`
	Rate    float64   `json:"battery_rate_mw"`
	Ambient float64   `json:"ambient_temp_c"`
	Water   float64   `json:"water_temp_c"`
	Level   float64   `json:"water_level_ml"`
}

func toJSON(m *kettle.Measurement) *MeasurementJSON {
	if m == nil {
		return nil
	}
	return &MeasurementJSON{m.Time, m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML}
}

// OverrideJSON is an operator override on the wire.
type OverrideJSON struct {
	Charge      *bool      `json:"charge,omitempty"`
	Fill        *bool      `json:"fill,omitempty"`
	FlushMLPerS *float64   `json:"flush_ml_per_s,omitempty"`
	ExpiresAt   *time.Time `json:"expires_at"`
	SetAt       *time.Time `json:"set_at,omitempty"`
	Active      bool       `json:"active"`
}

// DeviceJSON is a device with its latest state.
type DeviceJSON struct {
	ID           kettle.DeviceID   `json:"id"`
	RegisteredAt time.Time         `json:"registered_at"`
	LastSeen     *time.Time        `json:"last_seen"`
	Latest       *MeasurementJSON  `json:"latest"`
	CapacityML   float64           `json:"capacity_ml"`
	Measurements int64             `json:"measurements"`
	Command      *wire.CommandJSON `json:"command,omitempty"`
	Override     *OverrideJSON     `json:"override,omitempty"`
	RevokedAt    *time.Time        `json:"revoked_at,omitempty"`
}

func (a *API) deviceJSON(d kettle.DeviceState, withCommand bool) DeviceJSON {
	j := DeviceJSON{ID: d.ID, RegisteredAt: d.RegisteredAt, Latest: toJSON(d.Latest), CapacityML: d.CapacityML, Measurements: d.Measurements}
	if !d.RevokedAt.IsZero() {
		t := d.RevokedAt
		j.RevokedAt = &t
	}
	if !d.LastSeen.IsZero() {
		t := d.LastSeen
		j.LastSeen = &t
	}
	now := a.registry.Now()
	if o := d.Override; o != nil {
		exp, set := o.ExpiresAt, o.SetAt
		j.Override = &OverrideJSON{Charge: o.Charge, Fill: o.Fill, FlushMLPerS: o.FlushMLPerS, ExpiresAt: &exp, SetAt: &set, Active: o.ActiveAt(now)}
	}
	if withCommand {
		c := kettle.Decide(kettle.PolicyInput{Latest: d.Latest, CapacityML: d.CapacityML, Override: d.Override, Now: now})
		next := kettle.NextChange(now, d.Override, a.registry.PollInterval())
		cj := wire.NewCommandJSON(c, next)
		j.Command = &cj
	}
	return j
}

func (a *API) createDevices(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	req := struct {
		Count *int `json:"count"`
	}{}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := decodeObject(body, &req, "count"); err != nil {
			a.writeError(w, err)
			return
		}
	}
	n := 1
	if req.Count != nil {
		n = *req.Count
	}
	if n < 1 || n > kettle.MaxBatch {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid request", Fields: []kettle.FieldError{{Field: "count", Message: fmt.Sprintf("must be between 1 and %d, got %d", kettle.MaxBatch, n)}}})
		return
	}
	ids, err := a.registry.Register(r.Context(), n)
	if err != nil {
		a.writeError(w, err)
		return
	}
	type dev struct {
		ID    kettle.DeviceID `json:"id"`
		Token string          `json:"token"`
	}
	out := make([]dev, len(ids))
	for i, id := range ids {
		out[i] = dev{id, kettle.DeviceToken(a.cfg.Secret, id)}
	}
	writeJSON(w, http.StatusCreated, map[string]any{"devices": out})
}

// queryValue is a query parameter's value and whether it was given: a
// parameter given empty (?after=) is a value the document does not allow,
// not an absent one.
func queryValue(r *http.Request, name string) (string, bool) {
	vs, ok := r.URL.Query()[name]
	if !ok {
		return "", false
	}
	return vs[0], true
}

// queryTime parses an RFC 3339 query parameter into dst (UTC) when given.
func queryTime(r *http.Request, name string, dst *time.Time, errs *[]kettle.FieldError) {
	v, ok := queryValue(r, name)
	if !ok {
		return
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		*errs = append(*errs, kettle.FieldError{Field: name, Message: fmt.Sprintf("must be an RFC 3339 time, got %q", wire.Truncate(v, 64))})
		return
	}
	*dst = t.UTC()
}

// checkRange refuses a range whose end is not after its start: the same
// rule for history and statistics, stated in openapi.json's descriptions.
func checkRange(from, to time.Time, errs *[]kettle.FieldError) {
	if len(*errs) == 0 && !from.IsZero() && !to.IsZero() && !to.After(from) {
		*errs = append(*errs, kettle.FieldError{Field: "to", Message: fmt.Sprintf("must be after from (%s), got %s", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))})
	}
}

func queryInt(r *http.Request, name string, def, min, max int, errs *[]kettle.FieldError) int {
	v, ok := queryValue(r, name)
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < min || n > max {
		*errs = append(*errs, kettle.FieldError{Field: name, Message: fmt.Sprintf("must be an integer from %d to %d, got %q", min, max, wire.Truncate(v, 32))})
		return def
	}
	return n
}

func (a *API) listDevices(w http.ResponseWriter, r *http.Request) {
	var errs []kettle.FieldError
	limit := queryInt(r, "limit", 20, 1, 1000, &errs)
	after := uuid.Nil
	if v, ok := queryValue(r, "after"); ok {
		id, err := uuid.Parse(v)
		if err != nil {
			errs = append(errs, kettle.FieldError{Field: "after", Message: fmt.Sprintf("must be a device id (the previous page's next), got %q", wire.Truncate(v, 64))})
		}
		after = id
	}
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs})
		return
	}
	ds, err := a.reads.Devices(r.Context(), after, limit)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := make([]DeviceJSON, len(ds))
	for i, d := range ds {
		out[i] = a.deviceJSON(d, false)
	}
	next := ""
	if len(ds) == limit {
		next = ds[len(ds)-1].ID.String()
	}
	writeJSON(w, 200, map[string]any{"devices": out, "next": next})
}

func (a *API) getDevice(w http.ResponseWriter, r *http.Request, id kettle.DeviceID) {
	d, err := a.reads.Device(r.Context(), id)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, a.deviceJSON(d, true))
}

func (a *API) history(w http.ResponseWriter, r *http.Request, id kettle.DeviceID) {
	var errs []kettle.FieldError
	q := kettle.HistoryQuery{Device: id}
	q.Limit = queryInt(r, "limit", 100, 1, 1000, &errs)
	queryTime(r, "from", &q.From, &errs)
	queryTime(r, "to", &q.To, &errs)
	queryTime(r, "after", &q.After, &errs)
	checkRange(q.From, q.To, &errs)
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs})
		return
	}
	ms, err := a.reads.History(r.Context(), q)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := make([]*MeasurementJSON, len(ms))
	for i := range ms {
		out[i] = toJSON(&ms[i])
	}
	next := ""
	if len(ms) == q.Limit {
		next = ms[len(ms)-1].Time.Format(time.RFC3339Nano)
	}
	writeJSON(w, 200, map[string]any{"measurements": out, "next": next})
}

func (a *API) putOverride(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid device id", Fields: []kettle.FieldError{{Field: "id", Message: "must be a UUID"}}})
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req OverrideJSON
	if err := decodeObject(body, &req, "charge", "fill", "flush_ml_per_s", "expires_at"); err != nil {
		a.writeError(w, err)
		return
	}
	now := a.registry.Now()
	var errs []kettle.FieldError
	if req.ExpiresAt == nil {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "required (RFC 3339)"})
	} else if !req.ExpiresAt.After(now) {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "must be in the future"})
	} else if req.ExpiresAt.After(now.Add(366 * 24 * time.Hour)) {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "must be within a year"})
	}
	if req.FlushMLPerS != nil && (*req.FlushMLPerS < 0 || *req.FlushMLPerS > 1000 || *req.FlushMLPerS != *req.FlushMLPerS) {
		errs = append(errs, kettle.FieldError{Field: "flush_ml_per_s", Message: "must be between 0 (off) and 1000"})
	}
	if req.Charge == nil && req.Fill == nil && req.FlushMLPerS == nil {
		errs = append(errs, kettle.FieldError{Field: "charge", Message: "set at least one of charge, fill, flush_ml_per_s"})
	}
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid override", Fields: errs})
		return
	}
	o := kettle.Override{Charge: req.Charge, Fill: req.Fill, FlushMLPerS: req.FlushMLPerS, ExpiresAt: req.ExpiresAt.UTC().Truncate(kettle.TimePrecis), SetAt: now.UTC().Truncate(kettle.TimePrecis)}
	if err := a.registry.SetOverride(r.Context(), id, o); err != nil {
		a.writeError(w, err)
		return
	}
	d, err := a.reads.Device(r.Context(), id)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, a.deviceJSON(d, true))
}

// revokeDevice decommissions a device: its credentials are refused from now
// on, its history stays in the statistics.
func (a *API) revokeDevice(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid device id", Fields: []kettle.FieldError{{Field: "id", Message: "must be a UUID"}}})
		return
	}
	if err := a.registry.Revoke(r.Context(), id); err != nil {
		a.writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// PruneJSON is the body of POST /v1/devices/prune.
type PruneJSON struct {
	OlderThan string `json:"older_than"` // "24h", "7d"
	DryRun    bool   `json:"dry_run"`
}

// pruneDevices removes stale registrations: devices registered more than
// older_than ago that never stored a reading (fleet.Service.Prune).
func (a *API) pruneDevices(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req PruneJSON
	if err := decodeObject(body, &req, "older_than", "dry_run"); err != nil {
		a.writeError(w, err)
		return
	}
	age, err := kettle.ParseAge(req.OlderThan)
	if req.OlderThan == "" {
		err = errors.New("required: an age such as 24h or 7d")
	}
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid prune", Fields: []kettle.FieldError{{Field: "older_than", Message: err.Error()}}})
		return
	}
	// A registry of a million stale devices takes a thousand transactions:
	// longer than the server's write timeout allows an ordinary answer.
	http.NewResponseController(w).SetWriteDeadline(time.Now().Add(pruneWriteTimeout))
	res, err := a.registry.Prune(r.Context(), age, req.DryRun)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]any{
		"removed":            res.Removed,
		"registered_before":  res.Before.Format(time.RFC3339Nano),
		"dry_run":            res.DryRun,
		"took_ms":            float64(res.Took.Microseconds()) / 1000,
		"devices_registered": a.registry.DeviceCount(),
	})
}

// pruneWriteTimeout is how long a prune may run before its answer.
const pruneWriteTimeout = 10 * time.Minute

func (a *API) deleteOverride(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid device id", Fields: []kettle.FieldError{{Field: "id", Message: "must be a UUID"}}})
		return
	}
	if err := a.registry.ClearOverride(r.Context(), id); err != nil {
		a.writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// upload is the memory of one v1 upload, reused: allocating ~150 KB per
// batch of 500 (the body and its readings) cost kettle serve 7% of its CPU
// on batched uploads in zeroing it, and the collector ~10% more.
type upload struct {
	body []byte
	ms   []kettle.Measurement
}

var uploads = sync.Pool{New: func() any { return new(upload) }}

func getUpload() *upload { return uploads.Get().(*upload) }

func putUpload(u *upload) {
	u.body, u.ms = u.body[:0], u.ms[:0]
	uploads.Put(u)
}

func (a *API) v1Measurements(w http.ResponseWriter, r *http.Request) {
	release, ok := a.admitIngest(w, r)
	if !ok {
		return
	}
	defer release()
	id, err := a.device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	up := getUpload()
	defer putUpload(up)
	body, err := readBodyBuf(w, r, up.body)
	if err != nil {
		a.writeError(w, err)
		return
	}
	up.body = body
	ms, err := wire.DecodeV1Into(up.ms, body, id, a.ingest.Window())
	if err != nil {
		a.writeError(w, err)
		return
	}
	up.ms = ms
	// Ingest returns after the batcher copied the readings and committed:
	// nothing keeps ms or body past it, so they go back to the pool.
	stored, dups, err := a.ingest.Ingest(r.Context(), ms)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]int{"stored": stored, "duplicates": dups})
}

func (a *API) v1Command(w http.ResponseWriter, r *http.Request) {
	id, err := a.device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	c, next := a.registry.Command(id)
	etag := commandETag(c)
	w.Header().Set("ETag", etag)
	w.Header().Set("Cache-Control", a.commandCaching())
	if inm := r.Header.Get("If-None-Match"); inm != "" && inm == etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	writeJSON(w, 200, wire.NewCommandJSON(c, next))
}

// commandCaching is a v1 command's Cache-Control: no-cache (revalidate on
// every poll: an override may land at any time), or max-age while the
// server asks kettles to poll less often (Config.PollMaxAge).
func (a *API) commandCaching() string {
	if a.cfg.PollMaxAge == nil {
		return "no-cache"
	}
	d := a.cfg.PollMaxAge()
	if d <= 0 {
		return "no-cache"
	}
	return "max-age=" + strconv.Itoa(max(1, int(d/time.Second)))
}

// commandETag is the ETag of a command: FNV-1a of
// "charge|fill|flush|reason" (as fmt's %t|%t|%g|%s would print it), built
// without fmt — it is computed on every poll.
func commandETag(c kettle.Command) string {
	var buf [128]byte
	b := append(c.AppendActions(buf[:0]), '|')
	b = append(b, c.Reason...)
	h := fnv.New64a()
	h.Write(b)
	e := append(buf[:0], '"')
	e = strconv.AppendUint(e, h.Sum64(), 16)
	return string(append(e, '"'))
}

// StatsJSON is GET /v1/statistics's body.
type StatsJSON struct {
	From              *time.Time `json:"from"`
	To                *time.Time `json:"to"`
	MeasurementCount  int64      `json:"measurement_count"`
	RangeCount        int64      `json:"range_measurement_count"`
	DevicesRegistered int64      `json:"devices_registered"`
	DevicesReporting  int64      `json:"devices_reporting"`
	ReportingWindowS  int        `json:"reporting_window_s"`
	TotalChargeMWh    float64    `json:"total_battery_charge_mwh"`
	TotalWaterML      float64    `json:"total_water_volume_ml"`
	TotalPotentialCmL float64    `json:"total_potential_energy_c_ml"`
	TotalPotentialJ   float64    `json:"total_potential_energy_j"`
	ByHour            []HourJSON `json:"temperature_by_hour"`
}

// HourJSON is statistic 5 for one hour of the day.
type HourJSON struct {
	Hour    int      `json:"hour"`
	Count   int64    `json:"count"`
	Water   MeanJSON `json:"water_temp_c"`
	Ambient MeanJSON `json:"ambient_temp_c"`
}

// MeanJSON is a mean with its population standard deviation.
type MeanJSON struct {
	Mean   float64 `json:"mean"`
	Stddev float64 `json:"stddev"`
}

func (a *API) v1Statistics(w http.ResponseWriter, r *http.Request) {
	s, q, err := a.statistics(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := StatsJSON{
		MeasurementCount: s.MeasurementCount, RangeCount: s.RangeCount,
		DevicesRegistered: s.DevicesRegistered, DevicesReporting: s.DevicesReporting,
		ReportingWindowS: int(ReportingWindow / time.Second),
		TotalChargeMWh:   s.TotalChargeMWh, TotalWaterML: s.TotalWaterML,
		TotalPotentialCmL: s.TotalPotentialCmL, TotalPotentialJ: s.TotalPotentialJ(),
		ByHour: make([]HourJSON, 24),
	}
	// The range aggregated: the stores sum whole hours of rollups, from
	// the hour holding from up to the hour holding to, that one excluded.
	if !q.From.IsZero() {
		f := q.From.Truncate(time.Hour)
		out.From = &f
	}
	if !q.To.IsZero() {
		t := q.To.Truncate(time.Hour)
		out.To = &t
	}
	for i, h := range s.ByHour {
		out.ByHour[i] = HourJSON{Hour: i, Count: h.Water.N, Water: MeanJSON{h.Water.Mean, h.Water.Stddev()}, Ambient: MeanJSON{h.Ambient.Mean, h.Ambient.Stddev()}}
	}
	writeJSON(w, 200, out)
}

func (a *API) readyz(w http.ResponseWriter, r *http.Request) {
	if err := a.health.Ping(r.Context()); err != nil {
		id := w.Header().Get(RequestIDHeader)
		if ok, skipped := a.errLog.Allow(time.Now()); ok {
			a.log.Warn("not ready: the store does not answer", "request_id", id, "err", err, "similar_not_logged_since_last_line", skipped)
		}
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "store": "unavailable", "request_id": id})
		return
	}
	writeJSON(w, 200, map[string]string{"status": "ready"})
}
