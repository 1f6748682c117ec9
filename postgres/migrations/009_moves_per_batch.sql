-- last_seen_moves: one row per write batch, its changes in how many devices
-- have each last_seen value as two arrays (at[i] gains n[i]), instead of a
-- row per value. A batch of k kettles moves them from about k different
-- last_seen values (each was last stored by another batch) to one: a row
-- per value was a heap tuple and its WAL record per reading stored, and
-- another when the compactor deleted it (a sixth of the WAL a reading cost
-- in bench/sizing.sh's WAL profile, by relation); a row per batch is 16
-- bytes per value beside one tuple.
--
-- What is left in the old table is folded into last_seen_counts first, as
-- Store.compactSeen did; writers of an older version fail on the new table
-- until they are upgraded, and retry their batch.
LOCK TABLE last_seen_moves, last_seen_counts IN ACCESS EXCLUSIVE MODE;
INSERT INTO last_seen_counts AS c (at, n)
	SELECT at, sum(n) FROM last_seen_moves GROUP BY at HAVING sum(n) <> 0 ORDER BY at
	ON CONFLICT (at) DO UPDATE SET n = c.n + excluded.n;
DELETE FROM last_seen_counts WHERE n = 0;
DROP TABLE last_seen_moves;
CREATE TABLE last_seen_moves (
	at timestamptz[] NOT NULL,
	n  int8[] NOT NULL CHECK (cardinality(n) = cardinality(at))
);
