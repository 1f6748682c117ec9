-- Hot rows, split or gone. Every write transaction updated the one totals
-- row, the rollup and hour-of-day rows of the hours it wrote (for live data:
-- the same current hour) and the last_seen_counts rows its devices moved
-- between, and held them locked until its commit was flushed to disk: the
-- writers (--writers, and other nodes) queued behind each other's WAL flush
-- and committed one at a time, however many there were.
--
-- Now a write connection updates its own shard (0–15, see Store.shard) of
-- totals, rollups and hours_of_day, so concurrent writers touch different
-- rows; readers add the shards up. And writers no longer update
-- last_seen_counts: they append their changes (−1 at a device's old
-- last_seen, +1 at its new one, summed per value) to last_seen_moves, which
-- has no key to conflict on; the store folds them into last_seen_counts in
-- the background (Store.compactSeen), and the statistic adds both tables up.
--
-- Safe to run again (TestMigrateLastSeenCounts re-runs migrations 3 and 4):
-- last_seen_counts is rebuilt from the devices.
LOCK TABLE devices, totals, rollups, hours_of_day, last_seen_counts IN ACCESS EXCLUSIVE MODE;

ALTER TABLE totals DROP CONSTRAINT IF EXISTS totals_id_check;
ALTER TABLE totals ADD CONSTRAINT totals_id_check CHECK (id BETWEEN 0 AND 15);
INSERT INTO totals SELECT g, 0, 0, 0, 0, 0, 0, 0, 0 FROM generate_series(0, 15) g ON CONFLICT DO NOTHING;

ALTER TABLE rollups ADD COLUMN IF NOT EXISTS shard smallint NOT NULL DEFAULT 0 CHECK (shard BETWEEN 0 AND 15);
ALTER TABLE rollups DROP CONSTRAINT rollups_pkey, ADD CONSTRAINT rollups_pkey PRIMARY KEY (hour, shard);
ALTER TABLE hours_of_day ADD COLUMN IF NOT EXISTS shard smallint NOT NULL DEFAULT 0 CHECK (shard BETWEEN 0 AND 15);
ALTER TABLE hours_of_day DROP CONSTRAINT hours_of_day_pkey, ADD CONSTRAINT hours_of_day_pkey PRIMARY KEY (hod, shard);

DROP TABLE IF EXISTS last_seen_moves;
CREATE TABLE last_seen_moves (
	at timestamptz NOT NULL,
	n  bigint NOT NULL
);
CREATE INDEX last_seen_moves_at ON last_seen_moves (at);
DELETE FROM last_seen_counts;
INSERT INTO last_seen_counts (at, n)
	SELECT last_seen, count(*) FROM devices WHERE last_seen IS NOT NULL GROUP BY last_seen;
