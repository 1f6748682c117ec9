-- "Devices reporting since a bound" without an index on devices(last_seen)
-- (such an index would stop the HOT updates every batch makes to its
-- devices' rows) and without scanning devices: how many devices have each
-- last_seen value (NULL is not counted). Every write moves its devices from
-- their old last_seen values to the new one in the same transaction
-- (decrementing the old buckets, incrementing the new, deleting buckets that
-- reach 0), so this table holds about one row per recent batch and the
-- statistic sums a handful of rows. As sqlite's last_seen table.
CREATE TABLE last_seen_counts (
	at timestamptz PRIMARY KEY,
	n  bigint NOT NULL
) WITH (fillfactor = 50); -- n is updated by every batch: room for HOT updates

-- Writers of this version only start after the migration; the share lock
-- makes the backfill consistent with any other writer still running.
LOCK TABLE devices IN SHARE MODE;
INSERT INTO last_seen_counts (at, n)
	SELECT last_seen, count(*) FROM devices WHERE last_seen IS NOT NULL GROUP BY last_seen;
