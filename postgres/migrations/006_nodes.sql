-- The processes that write this database say here that they are alive
-- (kettle.Nodes: kettle serve nodes every --cache-refresh, kettle seed while
-- it runs, every second). A node refreshes its device cache from the store
-- only while another process counts as alive (it beat within three of the
-- longer of its interval, every_us, and the node's): a node alone on its
-- database has written everything its cache holds, and a full scan of
-- devices every few seconds would cost it and the database for nothing.
-- Rows of processes gone for a day are deleted by the next beat.
CREATE TABLE nodes (
	id         uuid PRIMARY KEY,
	kind       text NOT NULL,
	every_us   bigint NOT NULL CHECK (every_us > 0),
	started_at timestamptz NOT NULL DEFAULT now(),
	seen_at    timestamptz NOT NULL
);
