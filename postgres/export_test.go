package postgres

import "context"

// SetSmallBatchRows sets the largest batch written by INSERT from arrays
// and returns a function that restores it. Not for parallel tests.
func SetSmallBatchRows(n int) (restore func()) {
	old := smallBatchRows
	smallBatchRows = n
	return func() { smallBatchRows = old }
}

// CompactSeen folds last_seen_moves into last_seen_counts now.
func (s *Store) CompactSeen(ctx context.Context) error { return s.compactSeen(ctx, true) }

// CompactRollups folds closed hours' rollup shards into shard 0 now.
func (s *Store) CompactRollups(ctx context.Context) error { return s.compactRollups(ctx, true) }
