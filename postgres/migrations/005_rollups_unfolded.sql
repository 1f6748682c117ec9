-- The compactor (Store.compactRollups) folds the shards of closed hours'
-- rollups into shard 0, so that a bounded-range statistic reads about one
-- row per hour again (migration 4 made it one per hour and shard). This
-- partial index lets it find the rows left to fold without scanning every
-- hour of history. Writers' updates of their shard's row stay HOT: no column
-- of the index changes.
CREATE INDEX IF NOT EXISTS rollups_unfolded ON rollups (hour) WHERE shard <> 0;
