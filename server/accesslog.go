package server

import (
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// statusWriter records the status and bytes written for the access log and
// metrics.
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = 200
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += n
	return n, err
}

// Unwrap lets http.ResponseController reach the connection.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// slowRequest is how long a request takes before the access log keeps it
// whatever the sample.
const slowRequest = time.Second

// accessLog logs a JSON line for every failed (status ≥ 400) or slow
// request and for the sampled fraction of the others: route template (never the
// raw path), method, status, numeric duration_ms, bytes, device (a short hash of the
// case-study cookie: cookieHash), remote.
//
// Failures that clients can cause at any rate are thinned, per status: at
// most failedLines a second of each 4xx and 5xx, and one a second of 503 and
// 429 (an overloaded server refuses thousands a second, and so may a kettle
// over --device-rate); the next line written says how many of its status
// were left out (suppressed_<status>). A line for each would spend the CPU
// the refusal saves (and fill the disk) repeating one fact; /metrics counts
// every request (kettle_http_request_duration_seconds by status,
// kettle_http_requests_shed_total, kettle_device_rate_limited_total).
func accessLog(next http.Handler, log *slog.Logger, sample float64, now func() time.Time) http.Handler {
	if sample <= 0 {
		return next // no wrapper, no allocation per request
	}
	var thin [200]logthin.Limiter // by status − 400
	for i := range thin {
		thin[i].Burst = failedLines
	}
	thin[http.StatusServiceUnavailable-400].Burst = 1
	thin[http.StatusTooManyRequests-400].Burst = 1
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := now()
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		took := now().Sub(start)
		// Every failure and every slow request; a sample of the rest.
		if sw.status < 400 && took < slowRequest && sample < 1 && rand.Float64() >= sample {
			return
		}
		var suppressed int64
		if i := sw.status - 400; i >= 0 && i < len(thin) {
			var keep bool
			if keep, suppressed = thin[i].Allow(start); !keep {
				return
			}
		}
		dev := cookieHash(r.Header.Get("servant-auth-cookie"))
		route := r.Pattern
		if route == "" {
			route = "unmatched"
		}
		attrs := []slog.Attr{
			slog.String("route", route),
			slog.String("method", r.Method),
			slog.Int("status", sw.status),
			slog.Float64("duration_ms", float64(took.Microseconds())/1000),
			slog.Int64("bytes_in", r.ContentLength),
			slog.Int("bytes_out", sw.bytes),
			slog.String("device", dev),
			slog.String("remote", r.RemoteAddr),
			// the id the error body names, and the error's detail line
			slog.String("request_id", sw.Header().Get(httpapi.RequestIDHeader)),
		}
		if suppressed > 0 {
			attrs = append(attrs, slog.Int64("suppressed_"+strconv.Itoa(sw.status), suppressed))
		}
		log.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
	})
}

// failedLines is how many access-log lines a second one failure status
// (other than 503 and 429: one) gets.
const failedLines = 20

// cookieHash is how a v0 kettle's cookie appears in the access log: the
// first 12 hex digits of its SHA-256. The cookie is the kettle's only
// credential, so the log must not hold it; the hash still tells one
// kettle's lines from another's (sha256sum of the id finds them).
func cookieHash(c string) string {
	if c == "" {
		return ""
	}
	h := sha256.Sum256([]byte(c))
	return "sha256:" + hex.EncodeToString(h[:6])
}
