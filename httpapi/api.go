// Package httpapi is kettle serve's HTTP adapter: the case-study protocol
// (unchanged, for kettles in the field), the v1 API, health and the OpenAPI
// document. It decodes and validates, then hands readings to the fleet
// service; it never talks to the store on the poll path.
package httpapi

import (
	"errors"
	"log/slog"
	"net/http"
	"time"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
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

func (a *API) readyz(w http.ResponseWriter, r *http.Request) {
	if err := a.health.Ping(r.Context()); err != nil {
		id := w.Header().Get(RequestIDHeader)
		var ke *kettle.Error
		if errors.Is(err, fleet.ErrClockSkew) && errors.As(err, &ke) {
			// Logged by the clock check when the clock went off.
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "clock": ke.Public(), "request_id": id})
			return
		}
		if ok, skipped := a.errLog.Allow(time.Now()); ok {
			a.log.Warn("not ready: the store does not answer", "request_id", id, "err", err, "similar_not_logged_since_last_line", skipped)
		}
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "store": "unavailable", "request_id": id})
		return
	}
	writeJSON(w, 200, map[string]string{"status": "ready"})
}
