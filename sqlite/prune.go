package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// errDryRun rolls a dry run's transaction back.
var errDryRun = errors.New("dry run")

// Prune removes up to limit never-reported devices; see kettle.Store. The
// devices table says nothing of readings still staged (their devices rows
// are written by the merge), so a candidate is removed only if the writer's
// cache, which folds the staged rows in, agrees that it has none. It runs
// under the writer lock, so no write commits between the check and the
// delete.
func (s *Store) Prune(ctx context.Context, before time.Time, after kettle.DeviceID, limit int, dryRun bool) (removed []kettle.DeviceID, next kettle.DeviceID, err error) {
	if limit <= 0 {
		return nil, uuid.Nil, kettle.Errorf(kettle.EInvalid, "prune: limit must be positive, got %d", limit)
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	err = s.tx(ctx, "prune devices", func(tx *sql.Tx) error {
		removed, next = removed[:0], uuid.Nil
		if err := s.syncCache(context.WithoutCancel(ctx), tx); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `SELECT id FROM devices
			WHERE id > ? AND registered_at < ? AND last_seen IS NULL AND measurements = 0
				AND revoked_at IS NULL AND ov_expires IS NULL
			ORDER BY id LIMIT ?`, after[:], before.UnixMicro(), limit)
		if err != nil {
			return err
		}
		seen := 0
		for rows.Next() {
			var raw sql.RawBytes
			if err := rows.Scan(&raw); err != nil {
				rows.Close()
				return err
			}
			var id kettle.DeviceID
			if len(raw) != len(id) {
				rows.Close()
				return fmt.Errorf("device id of %d bytes, want %d", len(raw), len(id))
			}
			copy(id[:], raw)
			seen++
			if seen == limit {
				next = id
			}
			if st := s.cache.devs[id]; st.n == 0 && !st.hasSeen && !st.hasLatest {
				removed = append(removed, id)
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close()
		if len(removed) == 0 {
			return nil
		}
		del, err := tx.PrepareContext(ctx, `DELETE FROM devices WHERE id = ?`)
		if err != nil {
			return err
		}
		defer del.Close()
		for _, id := range removed {
			if _, err := del.ExecContext(ctx, id[:]); err != nil {
				return err
			}
		}
		if _, err := tx.StmtContext(ctx, s.devCount).ExecContext(ctx, -len(removed)); err != nil {
			return err
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	if errors.Is(err, errDryRun) {
		return removed, next, nil
	}
	if err != nil {
		s.cache.valid = false
		return nil, uuid.Nil, fmt.Errorf("sqlite prune devices: %w", err)
	}
	c := &s.cache
	for _, id := range removed {
		delete(c.devs, id)
	}
	// A Go map keeps its size when entries are deleted: once more were
	// deleted than are left, copy the rest into a map their size (a flood's
	// registrations pruned would otherwise stay in memory as empty room).
	if c.deleted += len(removed); c.deleted > len(c.devs) {
		devs := make(map[kettle.DeviceID]devState, len(c.devs))
		for id, st := range c.devs {
			devs[id] = st
		}
		c.devs, c.deleted = devs, 0
	}
	return removed, next, nil
}
