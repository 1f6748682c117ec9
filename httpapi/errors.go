package httpapi

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

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
