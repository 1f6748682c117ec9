-- kettlefleet schema v1. Everything derived from measurements (devices'
-- latest state, counts and capacity, hourly rollups, fleet totals) is written
-- in the transaction that writes the measurements.

CREATE TABLE devices (
	id            uuid PRIMARY KEY,
	registered_at timestamptz NOT NULL,
	-- server time of the last commit that stored a measurement of the device
	last_seen     timestamptz,
	measurements  bigint NOT NULL DEFAULT 0,
	capacity_ml   float8 NOT NULL DEFAULT 0,
	-- latest reading (greatest device time); NULL until the first one
	latest_t      timestamptz,
	charge_mwh    float8,
	full_mwh      float8,
	rate_mw       float8,
	ambient_c     float8,
	water_c       float8,
	level_ml      float8,
	-- operator override; present when ov_expires_at is not NULL
	ov_charge     boolean,
	ov_fill       boolean,
	ov_flush      float8,
	ov_expires_at timestamptz,
	ov_set_at     timestamptz
) WITH (fillfactor = 70); -- every batch updates its devices: leave room for HOT updates

-- One row per (device, device time), partitioned by month of device time so
-- that inserts touch small, recent indexes however long the history grows.
-- Partitions are created by the store (ahead of time, and on demand for
-- back-dated data): measurements_yYYYYmMM.
CREATE TABLE measurements (
	device     uuid        NOT NULL,
	t          timestamptz NOT NULL,
	charge_mwh float8      NOT NULL,
	full_mwh   float8      NOT NULL,
	rate_mw    float8      NOT NULL,
	ambient_c  float8      NOT NULL,
	water_c    float8      NOT NULL,
	level_ml   float8      NOT NULL,
	PRIMARY KEY (device, t)
) PARTITION BY RANGE (t);

-- Moments (count, mean, M2) of water and ambient temperature per UTC hour of
-- device time (n counts both). Bounded-range statistics merge these
-- (Chan et al., as kettle.Moments.Merge).
CREATE TABLE rollups (
	hour         timestamptz PRIMARY KEY,
	n            bigint NOT NULL,
	water_mean   float8 NOT NULL,
	water_m2     float8 NOT NULL,
	ambient_mean float8 NOT NULL,
	ambient_m2   float8 NOT NULL
);

-- The same moments over all history per UTC hour of day, so that open-range
-- statistics read 24 rows whatever the length of history.
CREATE TABLE hours_of_day (
	hod          smallint PRIMARY KEY CHECK (hod BETWEEN 0 AND 23),
	n            bigint NOT NULL,
	water_mean   float8 NOT NULL,
	water_m2     float8 NOT NULL,
	ambient_mean float8 NOT NULL,
	ambient_m2   float8 NOT NULL
);

-- Fleet totals over the devices' latest states, kept by deltas in every
-- write: one hot row, updated once per batch, last, just before commit. Each
-- float sum carries a Neumaier compensation term (*_c): the total is
-- sum + c, so years of add-new/subtract-old deltas do not drift.
CREATE TABLE totals (
	id            int PRIMARY KEY CHECK (id = 1),
	measurements  bigint NOT NULL,
	devices       bigint NOT NULL,
	charge        float8 NOT NULL,
	charge_c      float8 NOT NULL,
	level         float8 NOT NULL,
	level_c       float8 NOT NULL,
	potential     float8 NOT NULL,
	potential_c   float8 NOT NULL
);
INSERT INTO totals VALUES (1, 0, 0, 0, 0, 0, 0, 0, 0);

-- kettle_add_totals adds counts and the terms of the three sums (in array
-- order, Neumaier-compensated) to the totals row, in one statement so the
-- hot row is locked only from here to commit.
CREATE FUNCTION kettle_add_totals(d_meas bigint, d_dev bigint, p_charge float8[], p_level float8[], p_potential float8[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	r totals%ROWTYPE;
	x float8;
	t float8;
BEGIN
	SELECT * INTO r FROM totals WHERE id = 1 FOR UPDATE;
	FOREACH x IN ARRAY coalesce(p_charge, '{}') LOOP
		t := r.charge + x;
		IF abs(r.charge) >= abs(x) THEN r.charge_c := r.charge_c + ((r.charge - t) + x);
		ELSE r.charge_c := r.charge_c + ((x - t) + r.charge); END IF;
		r.charge := t;
	END LOOP;
	FOREACH x IN ARRAY coalesce(p_level, '{}') LOOP
		t := r.level + x;
		IF abs(r.level) >= abs(x) THEN r.level_c := r.level_c + ((r.level - t) + x);
		ELSE r.level_c := r.level_c + ((x - t) + r.level); END IF;
		r.level := t;
	END LOOP;
	FOREACH x IN ARRAY coalesce(p_potential, '{}') LOOP
		t := r.potential + x;
		IF abs(r.potential) >= abs(x) THEN r.potential_c := r.potential_c + ((r.potential - t) + x);
		ELSE r.potential_c := r.potential_c + ((x - t) + r.potential); END IF;
		r.potential := t;
	END LOOP;
	UPDATE totals SET measurements = r.measurements + d_meas, devices = r.devices + d_dev,
		charge = r.charge, charge_c = r.charge_c, level = r.level, level_c = r.level_c,
		potential = r.potential, potential_c = r.potential_c
	WHERE id = 1;
END $$;
