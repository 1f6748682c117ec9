package wire

import (
	"math/rand/v2"
	"strconv"
	"testing"
)

// TestFastNum: the fast path's numbers are strconv.ParseFloat's, bit for bit.
func TestFastNum(t *testing.T) {
	f := func(s string) {
		t.Helper()
		want, err := strconv.ParseFloat(s, 64)
		var got float64
		p := fastParser{b: []byte(s)}
		ok := p.num(&got)
		if ok != (err == nil) || ok && (got != want || p.i != len(s)) {
			t.Errorf("%q: fast %v %v (at %d), strconv %v %v", s, got, ok, p.i, want, err)
		}
	}
	for _, s := range []string{"0", "-0", "57", "-2.5", "88.25", "0.1", "0.3", "123456789012345", "1234567890.12345", "999999999999999",
		"1234567890123456", "0.000000000000001", "9007199254740993", "1e5", "1.5E-3", "-0.0", "1e400", "4.9406564584124654e-324"} {
		f(s)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		n := rng.IntN(15) + 1
		b := make([]byte, 0, 20)
		if rng.IntN(2) == 0 {
			b = append(b, '-')
		}
		b = append(b, byte('1'+rng.IntN(9)))
		for range n - 1 {
			b = append(b, byte('0'+rng.IntN(10)))
		}
		if k := rng.IntN(n); k > 0 { // k fraction digits
			b = append(b[:len(b)-k], append([]byte{'.'}, b[len(b)-k:]...)...)
		}
		f(string(b))
	}
}
