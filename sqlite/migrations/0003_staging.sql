-- Staging table: every measurement is stored either in measurements or
-- here, never in both. A write transaction appends its new rows here, keyed
-- by bucket (the first byte of the device id / 4: 64 buckets) then device time, so a
-- batch of readings from many kettles lands on a few pages at the right
-- edge of each bucket instead of one page per kettle in measurements (keyed
-- by device first, for history reads). When this table holds enough rows,
-- merge transactions, one per bucket, move the rows to measurements in
-- (device, t) order, where each kettle's rows then share its pages, update
-- the devices rows of the kettles that reported, and delete them here.
--
-- The devices row of a kettle (measurements, capacity_ml, last_seen,
-- latest_*) covers its rows in measurements; its rows here are folded on
-- top by every read. recv (the server receive time) is what last_seen is
-- rebuilt from.
CREATE TABLE staged (
	b          INTEGER NOT NULL, -- bucket: first byte of device * 64 / 256
	t          INTEGER NOT NULL,
	device     BLOB    NOT NULL,
	charge_mwh REAL    NOT NULL,
	full_mwh   REAL    NOT NULL,
	rate_mw    REAL    NOT NULL,
	ambient_c  REAL    NOT NULL,
	water_c    REAL    NOT NULL,
	level_ml   REAL    NOT NULL,
	recv       INTEGER NOT NULL,
	PRIMARY KEY (b, t, device)
) WITHOUT ROWID;
