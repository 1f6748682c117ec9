package fleet

import (
	"fmt"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Validate returns every problem with c, each naming the kettle serve flag
// that sets the field (the CLI has nothing to map), so that serve, demo,
// chaos and the benchmarks refuse the same configurations with the same
// words. Zero fields take their defaults and are valid.
func (c Config) Validate() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case c.QueueRows < 0:
		bad("--ingest-queue %d: want the readings that may wait for a commit, at least %d (0: the default)", c.QueueRows, kettle.MaxBatch)
	case c.QueueRows > 0 && c.QueueRows < kettle.MaxBatch:
		// A full upload could never be queued: every one would be answered
		// 503 forever, and an MQTT QoS 1 publish retried forever.
		bad("--ingest-queue %d is smaller than the largest upload (%d readings)", c.QueueRows, kettle.MaxBatch)
	}
	if c.BatchRows < 0 {
		bad("--batch-rows %d: want the most readings in one transaction, or 0 for the default", c.BatchRows)
	}
	if c.BatchWait < 0 {
		bad("--batch-wait %s: want 0 or more", c.BatchWait)
	}
	if c.Writers < 0 || c.Writers > 64 {
		bad("--writers %d: want 1 to 64 concurrent transactions, or 0 for the default", c.Writers)
	}
	if c.PollInterval < 0 {
		bad("--poll-interval %s: want a positive duration, or 0 for the default", c.PollInterval)
	}
	if c.Refresh < 0 {
		bad("--cache-refresh %s: want 0 or more", c.Refresh)
	}
	if c.Retention < 0 {
		bad("--retention %s: want 0 (keep everything) or more", c.Retention)
	}
	if c.ExpireEvery < 0 {
		bad("--expire-every %s: want a positive duration", c.ExpireEvery)
	}
	if c.PruneUnreported < 0 || (c.PruneUnreported > 0 && c.PruneUnreported < MinPruneAge) {
		bad("--prune-unreported %s: must be at least %s (a kettle registered just now has not reported yet), or 0", c.PruneUnreported, MinPruneAge)
	}
	rate := func(flag string, r float64, what string) {
		if r != 0 && !(r >= 0.001 && r <= 1e6) {
			bad("--%s %g: want %s a second from 0.001 to 1e6, or 0 for no limit", flag, r, what)
		}
	}
	// A burst is needed only with its rate (0 there: the default).
	burst := func(flag string, b, most int, r float64, what string) {
		if b < 0 || b > most || (b == 0 && r > 0) {
			bad("--%s %d: want 1 to %d (%s)", flag, b, most, what)
		}
	}
	rate("device-rate", c.DeviceRate, "requests per kettle")
	burst("device-burst", c.DeviceBurst, 1_000_000, c.DeviceRate, "requests a kettle may make at once")
	rate("login-rate", c.LoginRate, "registrations")
	burst("login-burst", c.LoginBurst, 10_000_000, c.LoginRate, "registrations at once")
	rate("login-rate-per-source", c.LoginSourceRate, "registrations from one address")
	burst("login-burst-per-source", c.LoginSourceBurst, 10_000_000, c.LoginSourceRate, "registrations at once from one address")
	if c.MaxDevices < 0 {
		bad("--max-devices %d: want the most devices to register, or 0 for no bound", c.MaxDevices)
	}
	if c.StoreTimeout < 0 || (c.StoreTimeout > 0 && c.StoreTimeout < 10*time.Millisecond) {
		bad("--store-timeout %s: want at least 10ms (a commit takes milliseconds), or 0 for the default %s", c.StoreTimeout, DefaultStoreTimeout)
	}
	return errs
}
