package sqlite

import (
	"context"
	"testing"
	"time"
)

// ExpireShare runs Expire's transactions, of about budget readings each,
// for the first share of the devices (1: all of it, and the last
// transaction): with share < 1, the state readers see while an expiry is
// under way.
// It returns the readings removed and the transactions run.
func (s *Store) ExpireShare(ctx context.Context, before time.Time, share float64, budget int64) (int64, int, error) {
	return s.expire(ctx, before.UnixMicro(), share, budget)
}

// SetBackupStepPages sets how many pages a backup copies a step, until the
// test ends.
func SetBackupStepPages(t testing.TB, n int) {
	old := backupStepPages
	backupStepPages = n
	t.Cleanup(func() { backupStepPages = old })
}
