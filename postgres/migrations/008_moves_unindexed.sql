-- last_seen_moves holds about a second of writers' changes (the compactor
-- folds it every Options.CompactEvery): the statistic that reads it with
-- "at >= $1" scans a few hundred rows, and the fold deletes them all. Its
-- index on at was one more index entry written (and WAL logged, and
-- vacuumed) for nearly every reading stored: about a twelfth of the WAL a
-- reading cost in bench/sizing.sh's profile (pg_waldump by record type).
DROP INDEX IF EXISTS last_seen_moves_at;
