package metrics

import (
	"testing"
	"time"
)

// TestEverySecond: a gauge that walks the device cache is computed at most
// once a second however often it is read.
func TestEverySecond(t *testing.T) {
	calls := 0
	g := everySecond(func() float64 { calls++; return float64(calls) })
	for range 1000 {
		if v := g(); v != 1 {
			t.Fatalf("read within the second: %v, want the first value 1", v)
		}
	}
	time.Sleep(1100 * time.Millisecond)
	if v := g(); v != 2 || calls != 2 {
		t.Errorf("a second later: %v (%d calls), want 2", v, calls)
	}
}
