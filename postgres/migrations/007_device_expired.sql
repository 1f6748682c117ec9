-- Readings of each device that Store.Expire removed: a device's stored
-- count is devices.measurements − device_expired.n. Expire adds here
-- instead of updating devices, so that it never locks a kettle's row (every
-- write batch locks its kettles' rows first): its last step waits only for
-- the writers inside their transaction, not for the fleet's rows.
CREATE TABLE IF NOT EXISTS device_expired (
	id uuid PRIMARY KEY,
	n  bigint NOT NULL CHECK (n >= 0)
);
