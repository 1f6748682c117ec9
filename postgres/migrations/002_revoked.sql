-- Revoked (decommissioned) devices: their credentials are refused; their
-- history stays in the statistics.
ALTER TABLE devices ADD COLUMN revoked_at timestamptz;
