// Package logthin thins log lines that clients can cause at any rate (a
// refusal, a bad payload, a failed request): a flood of them repeats one
// fact, and a line each would spend the CPU and fill the disk the server
// needs. At most Burst lines a window get through; the first line of a later
// window says how many were left out since.
package logthin

import (
	"sync"
	"time"
)

// Limiter lets at most Burst lines through each Every (Burst 0: 1; Every 0:
// a second) and counts the rest. The zero value is ready to use.
type Limiter struct {
	Burst int
	Every time.Duration

	mu      sync.Mutex
	end     time.Time // of the current window
	lines   int       // let through in it
	skipped int64     // left out since the last line let through
}

// Allow reports whether a line at now gets written and, if so, how many were
// left out before it.
func (l *Limiter) Allow(now time.Time) (ok bool, skipped int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !now.Before(l.end) {
		every := l.Every
		if every <= 0 {
			every = time.Second
		}
		l.end, l.lines = now.Add(every), 0
	}
	if l.lines >= max(l.Burst, 1) {
		l.skipped++
		return false, 0
	}
	l.lines++
	skipped, l.skipped = l.skipped, 0
	return true, skipped
}
