package sqlite

import (
	"context"
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

// BackupSteps is Backup copying stepPages pages a step.
func BackupSteps(ctx context.Context, path, out string, check bool, progress func(done, total int64), stepPages int) (FileInfo, error) {
	return backup(ctx, path, out, check, progress, stepPages)
}
