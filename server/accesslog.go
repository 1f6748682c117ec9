package server

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
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
//
// 503s and 429s are the exception: at most one line a second each
// (refusalEvery), carrying how many were not logged since (suppressed_503,
// suppressed_429). An overloaded server refuses thousands a second, and so
// may a kettle over --device-rate, and a line for each would spend the CPU
// the refusal saves (and fill the disk) repeating one fact; /metrics counts
// every refusal (kettle_http_requests_shed_total,
// kettle_device_rate_limited_total, the buckets of
// kettle_http_request_duration_seconds).
func accessLog(next http.Handler, log *slog.Logger, sample float64, now func() time.Time) http.Handler {
	if sample <= 0 {
		return next // no wrapper, no allocation per request
	}
	var refused, limited refusals
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
		var thin *refusals
		switch sw.status {
		case http.StatusServiceUnavailable:
			thin = &refused
		case http.StatusTooManyRequests:
			thin = &limited
		}
		if thin != nil {
			var keep bool
			if keep, suppressed = thin.keep(start); !keep {
				return
			}
		}
		dev := r.Header.Get("servant-auth-cookie")
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
		}
		if suppressed > 0 {
			attrs = append(attrs, slog.Int64("suppressed_"+strconv.Itoa(sw.status), suppressed))
		}
		log.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
	})
}

// refusalEvery is how often the access log writes a 503 (or a 429) line.
const refusalEvery = time.Second

// refusals thins the access log's lines of one refusal status to one per
// refusalEvery.
type refusals struct {
	mu         sync.Mutex
	next       time.Time // no line before this
	suppressed int64     // refusals not logged since the last line
}

// keep says whether a refusal answered at now gets a line, and if so how
// many were not logged before it.
func (f *refusals) keep(now time.Time) (bool, int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now.Before(f.next) {
		f.suppressed++
		return false, 0
	}
	n := f.suppressed
	f.next, f.suppressed = now.Add(refusalEvery), 0
	return true, n
}
