package fleet

import (
	"context"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Log is a replicated log that takes validated readings in place of the
// ingest queue (kettle serve --log): Append returns once the log holds them
// durably (an *kettle.Error with EUnavailable and a Retry-After when it
// cannot take them now), and writers elsewhere store them.
type Log interface {
	Append(ctx context.Context, rows []kettle.Measurement, received time.Time) error
}

// ingestLog is Ingest with Config.Log: the readings go to the log, and once
// it acknowledged them into this node's cache, so a kettle that polls the
// node it uploaded to sees its reading at once; other nodes see it when a
// writer stored it and their cache refresh ran (Config.Refresh). Duplicates
// are found by the writers, so every reading counts as stored here.
func (s *Service) ingestLog(ctx context.Context, rows []kettle.Measurement) (stored, dups int, err error) {
	if s.closed.Load() {
		s.reject("shutting_down", len(rows))
		return 0, 0, &kettle.Error{Code: kettle.EUnavailable, Message: "server is shutting down; retry on another node or after restart", RetryAfter: s.cfg.RetryAfter}
	}
	received := s.now()
	if err := s.cfg.Log.Append(ctx, rows, received); err != nil {
		s.reject("log", len(rows))
		return 0, 0, err
	}
	var changed []kettle.DeviceID
	s.mu.Lock()
	for i := 0; i < len(rows); {
		j, newest, maxLevel := i, i, rows[i].LevelML
		for ; j < len(rows) && rows[j].Device == rows[i].Device; j++ {
			if rows[j].Time.After(rows[newest].Time) {
				newest = j
			}
			maxLevel = max(maxLevel, rows[j].LevelML)
		}
		s.apply(&rows[newest], maxLevel, received)
		changed = append(changed, rows[i].Device)
		i = j
	}
	s.mu.Unlock()
	s.changed(changed)
	return len(rows), 0, nil
}
