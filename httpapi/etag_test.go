package httpapi

import (
	"fmt"
	"hash/fnv"
	"math"
	"testing"

	"github.com/kettlefleet/kettlefleet"
)

// TestCommandETag: the fmt-free ETag is byte for byte the one kettles in the
// field were given before (so their If-None-Match keeps matching).
func TestCommandETag(t *testing.T) {
	f := func(c kettle.Command) {
		t.Helper()
		h := fnv.New64a()
		fmt.Fprintf(h, "%t|%t|%g|%s", c.Charge, c.Fill, c.FlushMLPerS, c.Reason)
		if want, got := fmt.Sprintf(`"%x"`, h.Sum64()), commandETag(c); got != want {
			t.Errorf("commandETag(%+v) = %s, want %s", c, got, want)
		}
	}
	f(kettle.Command{})
	f(kettle.Command{Charge: true, Fill: true, FlushMLPerS: 12.5, Reason: "override"})
	f(kettle.Command{FlushMLPerS: 1e21, Reason: "huge flush"})
	f(kettle.Command{FlushMLPerS: 0.000001, Reason: "tiny"})
	f(kettle.Command{FlushMLPerS: math.Inf(1), Reason: "ünïcode reason, long enough to spill past the stack buffer of 128 bytes, long enough to spill past it"})
}

func BenchmarkCommandETag(b *testing.B) {
	c := kettle.Command{Charge: true, FlushMLPerS: 12.5, Reason: "battery below 20%"}
	b.ReportAllocs()
	for b.Loop() {
		commandETag(c)
	}
}
