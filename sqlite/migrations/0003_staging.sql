-- Staging table: every measurement is stored either in measurements or
-- here, never in both. A write transaction appends its new rows here, keyed
-- by device time first, so a batch of readings from many kettles lands on a
-- few neighbouring pages at the right edge of this B-tree instead of one
-- page per kettle in measurements (keyed by device first, for history
-- reads). When this table holds enough rows, one merge transaction moves
-- them all to measurements in (device, t) order, where each kettle's rows
-- then share its pages, updates the devices rows of the kettles that
-- reported, and empties it.
--
-- The devices row of a kettle (measurements, capacity_ml, last_seen,
-- latest_*) covers its rows in measurements; its rows here are folded on
-- top by every read. recv (the server receive time) is what last_seen is
-- rebuilt from.
CREATE TABLE staged (
	t          INTEGER NOT NULL,
	device     BLOB    NOT NULL,
	charge_mwh REAL    NOT NULL,
	full_mwh   REAL    NOT NULL,
	rate_mw    REAL    NOT NULL,
	ambient_c  REAL    NOT NULL,
	water_c    REAL    NOT NULL,
	level_ml   REAL    NOT NULL,
	recv       INTEGER NOT NULL,
	PRIMARY KEY (t, device)
) WITHOUT ROWID;
