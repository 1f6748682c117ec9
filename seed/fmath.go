package seed

import "math"

// The generator's output is a function of the seed alone, on every
// machine. Two things would break that on arm64 (and on amd64 built with
// GOAMD64=v3): the compiler may fuse x*y+z into one instruction with one
// rounding, and math.Exp is assembly whose result differs by architecture
// and, on amd64, by whether the CPU has FMA. So every product in this
// package that feeds a sum is converted explicitly, float64(x*y), which the
// Go spec says rounds and so forbids the fusion; and exp and cos below are
// Go's own math.Exp and math.Cos (pure Go, fdlibm's algorithms; Go's
// BSD-style licence) written the same way. What is left is math/rand/v2's
// NormFloat64, whose rare tail (about 1 draw in 2,000) calls math.Log and
// can differ in its last bit on arm64: the noise it feeds decays within a
// few readings and the readings are rounded (0.1 mWh, 0.01 °C), so the
// readings stay the same (TestDeterministicAcrossProcesses, run on arm64
// under qemu-user as its comment says).

// exp is math.Exp without fused operations, for finite x.
func exp(x float64) float64 {
	const (
		ln2Hi     = 6.93147180369123816490e-01
		ln2Lo     = 1.90821492927058770002e-10
		log2e     = 1.44269504088896338700e+00
		overflow  = 7.09782712893383973096e+02
		underflow = -7.45133219101941108420e+02
		nearZero  = 1.0 / (1 << 28)
		p1        = 1.66666666666666657415e-01
		p2        = -2.77777777770155933842e-03
		p3        = 6.61375632143793436117e-05
		p4        = -1.65339022054652515390e-06
		p5        = 4.13813679705723846039e-08
	)
	switch {
	case x > overflow:
		return math.Inf(1)
	case x < underflow:
		return 0
	case -nearZero < x && x < nearZero:
		return 1 + x
	}
	// reduce: x = k·ln2 + r, r computed as hi - lo for extra precision
	var k int
	switch {
	case x < 0:
		k = int(float64(log2e*x) - 0.5)
	case x > 0:
		k = int(float64(log2e*x) + 0.5)
	}
	hi := x - float64(float64(k)*ln2Hi)
	lo := float64(k) * ln2Lo
	r := hi - lo
	t := r * r
	poly := p1 + float64(t*(p2+float64(t*(p3+float64(t*(p4+float64(t*p5)))))))
	c := r - float64(t*poly)
	y := 1 - ((lo - float64(r*c)/(2-c)) - hi)
	return math.Ldexp(y, k)
}

// sinCoef and cosCoef are math.Cos's polynomials, on each half of an octant.
var (
	sinCoef = [6]float64{
		1.58962301576546568060e-10,
		-2.50507477628578072866e-8,
		2.75573136213857245213e-6,
		-1.98412698295895385996e-4,
		8.33333333332211858878e-3,
		-1.66666666666666307295e-1,
	}
	cosCoef = [6]float64{
		-1.13585365213876817300e-11,
		2.08757008419747316778e-9,
		-2.75573141792967388112e-7,
		2.48015872888517045348e-5,
		-1.38888888888730564116e-3,
		4.16666666666665929218e-2,
	}
)

// cos is math.Cos without fused operations, for |x| < 2²⁹ (math.Cos's
// Cody–Waite range; the generator's angles are within ±2π).
func cos(x float64) float64 {
	const (
		pi4A = 7.85398125648498535156e-1 // π/4 in three parts
		pi4B = 3.77489470793079817668e-8
		pi4C = 2.69515142907905952645e-15
	)
	if math.IsNaN(x) || math.Abs(x) >= 1<<29 {
		return math.Cos(x) // out of the generator's range; never reached
	}
	sign := false
	x = math.Abs(x)
	j := uint64(x * (4 / math.Pi)) // the octant
	y := float64(j)
	if j&1 == 1 { // map zeros to origin
		j++
		y++
	}
	j &= 7
	z := ((x - float64(y*pi4A)) - float64(y*pi4B)) - float64(y*pi4C)
	if j > 3 {
		j -= 4
		sign = !sign
	}
	if j > 1 {
		sign = !sign
	}
	zz := z * z
	if j == 1 || j == 2 {
		y = z + float64(float64(z*zz)*horner(&sinCoef, zz))
	} else {
		y = 1.0 - float64(0.5*zz) + float64(float64(zz*zz)*horner(&cosCoef, zz))
	}
	if sign {
		y = -y
	}
	return y
}

// horner is c[0]·z⁵ + … + c[5], each step rounded.
func horner(c *[6]float64, z float64) float64 {
	p := c[0]
	for _, ci := range c[1:] {
		p = float64(p*z) + ci
	}
	return p
}
