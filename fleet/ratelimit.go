package fleet

import (
	"fmt"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Each device's requests are held to Config.DeviceRate a second with bursts
// of Config.DeviceBurst (--device-rate, --device-burst), so that one kettle
// whose firmware retries in a tight loop, or one stolen credential, cannot
// take the fleet's share of the server: a kettle sends two requests in 30 s.
//
// The limit is the generic cell rate algorithm: each cached device holds one
// number, the theoretical arrival time of its next request (TAT, unix ns). A
// request at now conforms when TAT − now ≤ τ = (burst − 1) × T, T = 1/rate,
// and then moves TAT to max(TAT, now) + T. One atomic int64 in the slot,
// swapped with compare-and-swap under the cache's read lock, keeps the
// cache free of pointers (see cache) — a token-bucket object per kettle
// (golang.org/x/time/rate's Limiter holds a time.Time, a pointer) would put
// hundreds of thousands of objects back in front of the collector.
//
// A device not in the cache (a v1 token whose first reading is not yet
// stored) is not limited until it is: its credential is still checked.

// rateOn reports whether per-device limits are configured.
func (s *Service) rateOn() bool { return s.rateT > 0 }

// Allow takes one request of device id against its rate. Over it, nothing is
// taken and Allow returns an *kettle.Error with code ETooMany and how long
// until a request would conform (HTTP: 429 + Retry-After).
func (s *Service) Allow(id kettle.DeviceID) error {
	if !s.rateOn() {
		return nil
	}
	wait := s.take(id, false)
	if wait <= 0 {
		return nil
	}
	s.rateRefused.Add(1)
	s.logOverRate(id, "refused")
	return &kettle.Error{Code: kettle.ETooMany, RetryAfter: wait,
		Message: fmt.Sprintf("device %s sends faster than this server allows a kettle (--device-rate %g a second, --device-burst %d); retry after Retry-After seconds", id, s.cfg.DeviceRate, s.cfg.DeviceBurst)}
}

// Pace takes one request of device id and returns how long to wait before
// serving it so that the device keeps to its rate (0: at once). It never
// refuses: a protocol with flow control (MQTT: the connection is not read
// while its publish waits) slows the kettle down instead of losing or
// refusing what it sends. Reservations queue: n connections of one device
// each waiting share its one rate.
func (s *Service) Pace(id kettle.DeviceID) time.Duration {
	if !s.rateOn() {
		return 0
	}
	wait := s.take(id, true)
	if wait <= 0 {
		return 0
	}
	s.ratePaced.Add(1)
	s.logOverRate(id, "paced")
	return wait
}

// take applies one request of device id to its TAT and returns how long
// the request is early (≤ 0: it conforms, and was taken). An early request
// is taken only when reserve is set (Pace), its slot then being the next
// free one.
func (s *Service) take(id kettle.DeviceID, reserve bool) time.Duration {
	now := s.now().UnixNano()
	s.mu.RLock()
	defer s.mu.RUnlock()
	d := s.cache.get(id)
	if d == nil {
		return 0
	}
	for {
		old := d.tat.Load()
		tat := max(old, now)
		wait := tat - s.rateTau - now
		if wait > 0 && !reserve {
			return time.Duration(wait)
		}
		if d.tat.CompareAndSwap(old, tat+s.rateT) {
			return time.Duration(wait)
		}
	}
}

// RateLimited reports the requests refused (Allow) and held back (Pace)
// for being over a device's rate since start.
func (s *Service) RateLimited() (refused, paced int64) {
	return s.rateRefused.Load(), s.ratePaced.Load()
}

// logOverRate names a kettle over its rate in the log, at most once a
// second over all kettles (a runaway kettle is refused many times a
// second), with how many requests over the rate were not logged since.
func (s *Service) logOverRate(id kettle.DeviceID, what string) {
	s.rateLogMu.Lock()
	now := time.Now()
	if now.Before(s.rateLogNext) {
		s.rateLogSkipped++
		s.rateLogMu.Unlock()
		return
	}
	skipped := s.rateLogSkipped
	s.rateLogNext, s.rateLogSkipped = now.Add(time.Second), 0
	s.rateLogMu.Unlock()
	s.log.Warn("kettle over --device-rate", "device", id, "request", what, "rate", s.cfg.DeviceRate, "burst", s.cfg.DeviceBurst, "over_rate_not_logged_since_last_line", skipped)
}
