package main

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/server"
)

func init() {
	register("token", "print a device's v1 bearer token (offline provisioning)", runToken)
}

func runToken(ctx context.Context, args []string) error {
	fs := newFlagSet("token", "--device UUID [flags]", `
Prints the v1 bearer token of a device, derived from the server's secret, so
fleets and simulators can be provisioned offline. Reads the same secret as
kettle serve: --secret, or the file "secret" in --data-dir.`)
	device := fs.String("device", "", "device UUID (required)")
	dataDir := fs.String("data-dir", "kettle-data", "kettle serve's data directory (where the generated secret is kept)")
	secret := fs.String("secret", "", "the secret, when not kept in --data-dir")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	id, err := uuid.Parse(*device)
	if err != nil {
		return fmt.Errorf("--device %q: must be a UUID", *device)
	}
	sec := *secret
	if sec == "" {
		if sec, err = server.ReadSecret(*dataDir, "secret"); err != nil {
			return err
		}
	}
	fmt.Println(kettle.DeviceToken([]byte(sec), id))
	return nil
}
