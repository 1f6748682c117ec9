// Package backoff is the one retry delay of kettlefleet: exponential,
// bounded, and jittered, so that clients refused together do not come back
// together (the ingest retries of MQTT messages, the log writer's store
// retries, the listener's accept retries).
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is one retry loop's delay. The zero value is not useful: set
// Initial and Max. Not safe for concurrent use (one per loop).
type Backoff struct {
	// Initial bounds the first wait; each later bound is twice the one
	// before, up to Max.
	Initial time.Duration
	// Max bounds every wait (unless Next is given a limit).
	Max time.Duration

	bound time.Duration // the next wait's bound (0: Initial)
}

// Next returns the wait before the next attempt: uniform in [b/2, b],
// where the bound b is Initial at first and doubles with each call, up to
// Max. limit > 0 is the ceiling in place of Max, e.g. the Retry-After the
// other side asked for.
func (b *Backoff) Next(limit time.Duration) time.Duration {
	ceiling := b.Max
	if limit > 0 {
		ceiling = limit
	}
	if b.bound <= 0 {
		b.bound = b.Initial
	} else {
		b.bound *= 2
	}
	b.bound = min(b.bound, ceiling)
	return b.bound/2 + rand.N(b.bound/2+1)
}

// Reset starts the next retry loop from Initial again.
func (b *Backoff) Reset() { b.bound = 0 }

// Wait sleeps Next(limit) and reports true, or returns false as soon as
// ctx is done.
func (b *Backoff) Wait(ctx context.Context, limit time.Duration) bool {
	return Sleep(ctx, b.Next(limit))
}

// Sleep waits d and reports true, or returns false as soon as ctx is done.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
