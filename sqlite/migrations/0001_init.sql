-- kettlefleet schema, version 1.
-- Times are unix microseconds (INTEGER); device ids are 16-byte UUIDs (BLOB),
-- so id order is byte order, as kettle.Store.Devices promises.

-- One row per kettle: its latest state, history summary and override.
-- latest_* is the measurement with the greatest device time (NULL: none).
CREATE TABLE devices (
	id             BLOB    NOT NULL PRIMARY KEY,
	registered_at  INTEGER NOT NULL,
	last_seen      INTEGER,              -- server time of the newest commit that stored a row
	measurements   INTEGER NOT NULL DEFAULT 0,
	capacity_ml    REAL    NOT NULL DEFAULT 0, -- largest level ever stored
	latest_t       INTEGER,
	latest_charge  REAL,
	latest_full    REAL,
	latest_rate    REAL,
	latest_ambient REAL,
	latest_water   REAL,
	latest_level   REAL,
	ov_charge      INTEGER,              -- override; ov_expires NOT NULL means present
	ov_fill        INTEGER,
	ov_flush       REAL,
	ov_expires     INTEGER,
	ov_set         INTEGER
) WITHOUT ROWID;

-- Statistic 2b (devices with last_seen >= a bound) without an index on
-- devices(last_seen): such an index gets one scattered delete per device per
-- batch, about doubling the pages a batch dirties on a large fleet. Instead,
-- how many devices have each last_seen value; a batch moves its devices from
-- their old values to its receivedAt, so this table holds about one row per
-- recent batch and its updates are few and clustered.
CREATE TABLE last_seen (
	at INTEGER NOT NULL PRIMARY KEY, -- unix µs
	n  INTEGER NOT NULL CHECK (n >= 0)
);

-- Every stored measurement once: (device, t) is the idempotency key.
CREATE TABLE measurements (
	device    BLOB    NOT NULL,
	t         INTEGER NOT NULL,
	charge_mwh REAL   NOT NULL,
	full_mwh  REAL    NOT NULL,
	rate_mw   REAL    NOT NULL,
	ambient_c REAL    NOT NULL,
	water_c   REAL    NOT NULL,
	level_ml  REAL    NOT NULL,
	PRIMARY KEY (device, t)
) WITHOUT ROWID;

-- Moments (count, mean, M2) of water and ambient temperature per UTC hour of
-- device time; hour is the unix second of the hour's start. Bounded-range
-- statistics merge these.
CREATE TABLE rollups (
	hour         INTEGER NOT NULL PRIMARY KEY,
	n            INTEGER NOT NULL,
	water_mean   REAL    NOT NULL,
	water_m2     REAL    NOT NULL,
	ambient_mean REAL    NOT NULL,
	ambient_m2   REAL    NOT NULL
);

-- The same moments over all history per hour of day (0..23), so that the
-- open-range statistics read 24 rows whatever the size of history.
CREATE TABLE hours_of_day (
	hod          INTEGER NOT NULL PRIMARY KEY CHECK (hod BETWEEN 0 AND 23),
	n            INTEGER NOT NULL,
	water_mean   REAL    NOT NULL,
	water_m2     REAL    NOT NULL,
	ambient_mean REAL    NOT NULL,
	ambient_m2   REAL    NOT NULL
);

-- Fleet totals over latest states, maintained by deltas in every write
-- transaction. Each float sum carries a Neumaier compensation term (*_c):
-- the total is sum + c, so years of add-new/subtract-old deltas do not drift.
CREATE TABLE totals (
	id                INTEGER NOT NULL PRIMARY KEY CHECK (id = 0),
	measurement_count INTEGER NOT NULL,
	device_count      INTEGER NOT NULL,
	charge            REAL    NOT NULL,
	charge_c          REAL    NOT NULL,
	level             REAL    NOT NULL,
	level_c           REAL    NOT NULL,
	potential         REAL    NOT NULL,
	potential_c       REAL    NOT NULL
);
INSERT INTO totals VALUES (0, 0, 0, 0, 0, 0, 0, 0, 0);
