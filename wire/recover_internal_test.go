package wire

import (
	"errors"
	"testing"

	"github.com/kettlefleet/kettlefleet"
)

// TestDecoderPanicRefused: a decoder that panics on a body refuses it as
// invalid and counts it, on both the v0 and the v1 path, instead of taking
// the process down.
func TestDecoderPanicRefused(t *testing.T) {
	defer func(d func([]byte, any) error) { decoder = d }(decoder)
	decoder = func([]byte, any) error { panic("decoder bug") }
	before := DecoderPanics.Load()
	var kerr *kettle.Error
	if _, err := DecodeV0([]byte(`{"time":"x"}`), kettle.DeviceID{}, kettle.Window{}); !errors.As(err, &kerr) || kerr.Code != kettle.EInvalid {
		t.Fatalf("v0: %v, want an EInvalid refusal", err)
	}
	// Not the fast path's shape: the general decoder runs.
	if _, err := DecodeV1([]byte(` [ {"time": 1} ] `), kettle.DeviceID{}, kettle.Window{}); !errors.As(err, &kerr) || kerr.Code != kettle.EInvalid {
		t.Fatalf("v1: %v, want an EInvalid refusal", err)
	}
	if n := DecoderPanics.Load() - before; n != 2 {
		t.Fatalf("DecoderPanics grew by %d, want 2", n)
	}
}
