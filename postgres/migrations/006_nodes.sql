-- The processes that write this database say here that they are alive
-- (kettle.Nodes: kettle serve nodes every --cache-refresh, kettle seed while
-- it runs). A node refreshes its device cache from the store only while
-- another process has beaten recently: a node alone on its database has
-- written everything its cache holds, and a full scan of devices every few
-- seconds would cost it and the database for nothing. Rows of processes
-- gone for an hour are deleted by the next beat.
CREATE TABLE nodes (
	id         uuid PRIMARY KEY,
	kind       text NOT NULL,
	started_at timestamptz NOT NULL DEFAULT now(),
	seen_at    timestamptz NOT NULL
);
