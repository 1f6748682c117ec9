package mqttapi

import (
	"context"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
)

// Ingester takes the readings kettles publish; *fleet.Service is one.
type Ingester interface {
	// Ingest returns once the readings are durable (then the PUBACK goes).
	Ingest(ctx context.Context, rows []kettle.Measurement) (stored, dups int, err error)
	// Window is the device times accepted now.
	Window() kettle.Window
}

// Commands is what the command pusher needs: a device's current command,
// word of every change, and the service clock.
type Commands interface {
	Command(id kettle.DeviceID) (kettle.Command, time.Duration)
	OnChange(fn fleet.ChangeFunc)
	Now() time.Time
}

// Fleet is what the embedded listener needs of the fleet service: the two
// above, the credential check, the per-device pace, and the queue's size.
type Fleet interface {
	Ingester
	Commands
	Revoked(id kettle.DeviceID) bool
	Pace(id kettle.DeviceID) time.Duration
	Config() fleet.Config
}

// Consumed is what the external-broker consumer needs.
type Consumed interface {
	Ingester
	Commands
}
