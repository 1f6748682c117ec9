package sqlite

import (
	"context"
	"time"
)

// ExpireBuckets runs Expire's per-bucket transactions for buckets [0, n)
// only: the state readers see while an expiry is under way.
func (s *Store) ExpireBuckets(ctx context.Context, before time.Time, n int) (int64, error) {
	var removed int64
	for b := range n {
		k, err := s.expireBucket(ctx, b, before.UnixMicro())
		removed += k
		if err != nil {
			return removed, err
		}
	}
	return removed, nil
}
