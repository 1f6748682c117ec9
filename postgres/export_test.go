package postgres

import "context"

// SetPlainBatchRows sets the largest live batch s writes by INSERT from
// arrays (0: every batch by COPY). Call it before s writes.
func (s *Store) SetPlainBatchRows(n int) { s.plainBatchRows = n }

// CompactSeen folds last_seen_moves into last_seen_counts now.
func (s *Store) CompactSeen(ctx context.Context) error { return s.compactSeen(ctx, true) }

// CompactRollups folds closed hours' rollup shards into shard 0 now.
func (s *Store) CompactRollups(ctx context.Context) error { return s.compactRollups(ctx, true) }

// HoldPool acquires every connection of the store's pool and returns a
// function that releases them.
func (s *Store) HoldPool(ctx context.Context) (release func(), err error) {
	var held []interface{ Release() }
	for range s.pool.Config().MaxConns {
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			for _, h := range held {
				h.Release()
			}
			return nil, err
		}
		held = append(held, c)
	}
	return func() {
		for _, h := range held {
			h.Release()
		}
	}, nil
}

// ResetPool closes every idle connection of s's pool: the next ones are new.
func (s *Store) ResetPool() { s.pool.Reset() }

// LockExpire is the advisory lock key Expire serialises on.
const LockExpire = lockExpire

// SetExpireCounted makes s's Expire call f after it counted a partition's
// readings, holding the partition against inserts (nil: nothing). Call it
// while s does not expire.
func (s *Store) SetExpireCounted(f func()) { s.expireCounted = f }

// WithoutPassword exports withoutPassword.
var WithoutPassword = withoutPassword

// SQLPrune is the statement that picks and deletes a prune's batch.
const SQLPrune = sqlPrune
