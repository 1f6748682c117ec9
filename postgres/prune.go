package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	kettle "github.com/kettlefleet/kettlefleet"
)

// sqlPrune deletes the next devices (in id order) that were registered
// before $2 and never stored a reading, and are neither revoked nor under
// an override. SKIP LOCKED passes over a device a writer holds: it is
// storing its first reading (or is registered again by a writer, which
// waits for this commit and then inserts it anew). The rows are locked in
// id order, then the connection's totals shard — the order every writer
// takes them in. The DELETE finds the locked rows by ctid (a Tid Scan);
// joined on id, the planner hashes the whole table for every batch
// (BenchmarkPrune compares them). A row another
// transaction updated since is followed to its new version, whose ctid is
// not in the list: it stays, and is not counted.
const sqlPrune = `DELETE FROM devices WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM devices
	WHERE id > $1 AND registered_at < $2 AND last_seen IS NULL AND measurements = 0
		AND revoked_at IS NULL AND ov_expires_at IS NULL
	ORDER BY id LIMIT $3
	FOR UPDATE SKIP LOCKED
)) RETURNING id`

// Prune removes up to limit never-reported devices; see kettle.Store.
func (s *Store) Prune(ctx context.Context, before time.Time, after kettle.DeviceID, limit int, dryRun bool) (removed []kettle.DeviceID, next kettle.DeviceID, err error) {
	if limit <= 0 {
		return nil, uuid.Nil, kettle.Errorf(kettle.EInvalid, "prune: limit must be positive, got %d", limit)
	}
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, uuid.Nil, unavailable("postgres prune devices", err)
	}
	defer pc.Release()
	if after == uuid.Nil {
		// A run's first batch: fresh statistics first. What a prune removes
		// is typically a flood of registrations newer than the table's
		// statistics (autovacuum analyzes it within minutes, or not at all
		// below 10 % of it); with statistics that count no device without a
		// reading, the planner expects one row, and every batch would read
		// and sort the whole table instead of using the index
		// (TestPrunePlan). ANALYZE samples ~30,000 rows whatever the
		// table's size.
		if _, err := pc.Exec(ctx, "ANALYZE devices"); err != nil {
			return nil, uuid.Nil, unavailable("postgres prune devices: analyze", err)
		}
	}
	shard := s.shard(pc.Conn().PgConn())
	tx, err := pc.Conn().Begin(ctx)
	if err != nil {
		return nil, uuid.Nil, unavailable("postgres prune devices", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) // after Commit: a no-op
	rows, err := tx.Query(ctx, sqlPrune, after, before.UTC(), limit)
	if err != nil {
		return nil, uuid.Nil, unavailable("postgres prune devices", err)
	}
	for rows.Next() {
		var id kettle.DeviceID
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, uuid.Nil, unavailable("postgres prune devices", err)
		}
		removed = append(removed, id)
	}
	if err := rows.Err(); err != nil {
		return nil, uuid.Nil, unavailable("postgres prune devices", err)
	}
	// DELETE … RETURNING answers in no particular order.
	removed = sortedUnique(removed)
	if len(removed) == limit {
		next = removed[len(removed)-1]
	}
	if len(removed) == 0 || dryRun {
		return removed, next, nil
	}
	if _, err := tx.Exec(ctx, sqlAddTotals, 0, -int64(len(removed)), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, shard); err != nil {
		return nil, uuid.Nil, unavailable("postgres prune devices: totals", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, uuid.Nil, unavailable(fmt.Sprintf("postgres prune %d devices: commit", len(removed)), err)
	}
	s.forget(removed)
	return removed, next, nil
}

// forget drops ids from the devices this store knows to exist (allKnown).
func (s *Store) forget(ids []kettle.DeviceID) {
	s.knownMu.Lock()
	defer s.knownMu.Unlock()
	n := len(s.known)
	for _, id := range ids {
		delete(s.known, id)
	}
	// A Go map keeps its size when entries are deleted: once under half of
	// it is left, copy the rest into a map their size.
	if s.knownDeleted += n - len(s.known); s.knownDeleted > len(s.known) {
		known := make(map[kettle.DeviceID]struct{}, len(s.known))
		for id := range s.known {
			known[id] = struct{}{}
		}
		s.known, s.knownDeleted = known, 0
	}
}
