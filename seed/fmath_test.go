package seed

import (
	"math"
	"testing"
)

// TestExpCos: the unfused exp and cos agree with math.Exp and math.Cos
// within 2 units of the last place (those may fuse, or be assembly with
// its own polynomial) over [-10, 10], beyond the generator's angles (±2π)
// and its cooling exponents (-interval/τ) at any interval up to hours.
func TestExpCos(t *testing.T) {
	ulps := func(a, b float64) uint64 {
		x, y := math.Float64bits(a), math.Float64bits(b)
		return max(x, y) - min(x, y)
	}
	for i := range 200001 {
		x := -10 + float64(i)*0.0001 // [-10, 10]
		if d := ulps(exp(x), math.Exp(x)); d > 2 {
			t.Fatalf("exp(%v) = %v, math.Exp %v: %d ulps apart", x, exp(x), math.Exp(x), d)
		}
		if d := ulps(cos(x), math.Cos(x)); d > 2 {
			t.Fatalf("cos(%v) = %v, math.Cos %v: %d ulps apart", x, cos(x), math.Cos(x), d)
		}
	}
	if exp(0) != 1 || exp(-800) != 0 || !math.IsInf(exp(800), 1) || cos(0) != 1 {
		t.Errorf("exp(0) %v, exp(-800) %v, exp(800) %v, cos(0) %v", exp(0), exp(-800), exp(800), cos(0))
	}
}
