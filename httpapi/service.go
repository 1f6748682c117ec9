package httpapi

import (
	"context"
	"net/netip"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
)

// The API holds one small service per concern (*fleet.Service is all of
// them); it never reaches the store around them.

// Ingester takes validated readings.
type Ingester interface {
	// Ingest returns once the readings are durable (then the 2xx goes).
	Ingest(ctx context.Context, rows []kettle.Measurement) (stored, dups int, err error)
	// Window is the device times accepted now.
	Window() kettle.Window
}

// Registry is the devices and their commands: credentials checked from
// memory (or the store, for a device another node registered since this
// node's last refresh), registration, revocation, pruning, overrides and the command a
// poll gets.
type Registry interface {
	Register(ctx context.Context, n int) ([]kettle.DeviceID, error)
	// Issued reports whether id is a registered, unrevoked device, from
	// memory or, for one this node has not seen, the store (an
	// EUnavailable error when it cannot say).
	Issued(ctx context.Context, id kettle.DeviceID) (bool, error)
	Revoked(id kettle.DeviceID) bool
	Revoke(ctx context.Context, id kettle.DeviceID) error
	Prune(ctx context.Context, olderThan time.Duration, dryRun bool) (fleet.PruneResult, error)
	DeviceCount() int
	SetOverride(ctx context.Context, id kettle.DeviceID, o kettle.Override) error
	ClearOverride(ctx context.Context, id kettle.DeviceID) error
	Command(id kettle.DeviceID) (kettle.Command, time.Duration)
	PollInterval() time.Duration
	Now() time.Time
}

// Limits are the request rates: per device, and of registrations.
type Limits interface {
	Allow(id kettle.DeviceID) error
	AllowLogin(source netip.Addr) error
}

// Reads are the answers that come from the store: statistics, device
// lists, a device, history. Each is bounded and its failure already
// mapped to a *kettle.Error.
type Reads interface {
	Statistics(ctx context.Context, q kettle.StatsQuery) (kettle.Statistics, error)
	Devices(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error)
	Device(ctx context.Context, id kettle.DeviceID) (kettle.DeviceState, error)
	History(ctx context.Context, q kettle.HistoryQuery) ([]kettle.Measurement, error)
}

// Health is readiness: whether the store answers.
type Health interface {
	Ping(ctx context.Context) error
}

// Fleet is every service the API uses, as New takes them.
type Fleet interface {
	Ingester
	Registry
	Limits
	Reads
	Health
}
