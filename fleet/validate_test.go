package fleet_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/fleet"
)

func TestConfigValidate(t *testing.T) {
	f := func(c fleet.Config, want ...string) {
		t.Helper()
		errs := c.Validate()
		if len(errs) != len(want) {
			t.Fatalf("%+v: %d errors %v, want %d naming %v", c, len(errs), errs, len(want), want)
		}
		for i, w := range want {
			if !strings.Contains(errs[i].Error(), w) {
				t.Errorf("error %d %q, want it to say %q", i, errs[i], w)
			}
		}
	}
	f(fleet.Config{})
	f(fleet.Config{QueueRows: 1000, StoreTimeout: time.Second, DeviceRate: 1, DeviceBurst: 1})
	f(fleet.Config{QueueRows: 500}, "--ingest-queue 500 is smaller than the largest upload (1000 readings)")
	f(fleet.Config{QueueRows: -1}, "--ingest-queue -1:")
	f(fleet.Config{StoreTimeout: -time.Second}, "--store-timeout -1s:")
	f(fleet.Config{StoreTimeout: time.Millisecond}, "--store-timeout 1ms:")
	f(fleet.Config{DeviceRate: 1}, "--device-burst 0:")
	f(fleet.Config{DeviceRate: -1, MaxDevices: -1}, "--device-rate -1:", "--max-devices -1:")
	f(fleet.Config{PruneUnreported: time.Minute}, "--prune-unreported 1m0s:")
	f(fleet.Config{Writers: 100, BatchRows: -1}, "--batch-rows -1:", "--writers 100:")
}
