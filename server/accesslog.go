package server

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"
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
// raw path), method, status, numeric duration_ms, bytes, device, remote.
func accessLog(next http.Handler, log *slog.Logger, sample float64) http.Handler {
	if sample <= 0 {
		return next // no wrapper, no allocation per request
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		// Every failure and every slow request; a sample of the rest.
		if sw.status < 400 && time.Since(start) < slowRequest && sample < 1 && rand.Float64() >= sample {
			return
		}
		dev := r.Header.Get("servant-auth-cookie")
		route := r.Pattern
		if route == "" {
			route = "unmatched"
		}
		log.LogAttrs(r.Context(), slog.LevelInfo, "request",
			slog.String("route", route),
			slog.String("method", r.Method),
			slog.Int("status", sw.status),
			slog.Float64("duration_ms", float64(time.Since(start).Microseconds())/1000),
			slog.Int64("bytes_in", r.ContentLength),
			slog.Int("bytes_out", sw.bytes),
			slog.String("device", dev),
			slog.String("remote", r.RemoteAddr),
		)
	})
}
