package web

import (
	"net/netip"
	"sync"
	"time"
)

// signInThrottle bounds failed sign-ins per source address: the operator
// token is the key to the whole fleet, and without a bound anyone who
// reaches the dashboard may guess at it as fast as the server answers.
// Each source may fail burst times at once, then once every interval
// (GCRA: one "theoretical arrival time" a source). The table holds at most
// max sources; when full, the source whose allowance was restored first is
// forgotten.
type signInThrottle struct {
	interval time.Duration
	burst    int
	max      int

	mu  sync.Mutex
	tat map[netip.Addr]time.Time
}

func newSignInThrottle(interval time.Duration, burst, max int) *signInThrottle {
	return &signInThrottle{interval: interval, burst: burst, max: max, tat: map[netip.Addr]time.Time{}}
}

// wait is how long src must wait before its next attempt (0: now).
func (s *signInThrottle) wait(src netip.Addr, now time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	tat, ok := s.tat[src]
	if !ok || !tat.After(now) {
		return 0
	}
	if d := tat.Sub(now) - time.Duration(s.burst-1)*s.interval; d > 0 {
		return d
	}
	return 0
}

// failed counts a failed sign-in of src.
func (s *signInThrottle) failed(src netip.Addr, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	tat, ok := s.tat[src]
	if !ok || tat.Before(now) {
		tat = now
	}
	if !ok && len(s.tat) >= s.max {
		var oldest netip.Addr
		var oldestT time.Time
		for a, t := range s.tat {
			if oldestT.IsZero() || t.Before(oldestT) {
				oldest, oldestT = a, t
			}
		}
		delete(s.tat, oldest)
	}
	s.tat[src] = tat.Add(s.interval)
}
