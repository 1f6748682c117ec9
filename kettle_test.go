package kettle_test

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

func TestMomentsMergeExact(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	xs := make([]float64, 5000)
	for i := range xs {
		xs[i] = 20 + rng.Float64()*70
	}
	// Two-pass reference.
	mean := 0.0
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	ss := 0.0
	for _, x := range xs {
		ss += (x - mean) * (x - mean)
	}
	std := math.Sqrt(ss / float64(len(xs)))
	// Random partition into chunks, merged in random order.
	var parts []kettle.Moments
	for i := 0; i < len(xs); {
		n := 1 + rng.IntN(300)
		var m kettle.Moments
		for j := i; j < i+n && j < len(xs); j++ {
			m.Add(xs[j])
		}
		parts = append(parts, m)
		i += n
	}
	rng.Shuffle(len(parts), func(i, j int) { parts[i], parts[j] = parts[j], parts[i] })
	var total kettle.Moments
	for _, p := range parts {
		total = total.Merge(p)
	}
	if total.N != int64(len(xs)) || math.Abs(total.Mean-mean)/mean > 1e-12 || math.Abs(total.Stddev()-std)/std > 1e-9 {
		t.Errorf("merged %+v stddev %v, want n=%d mean %v stddev %v", total, total.Stddev(), len(xs), mean, std)
	}
}

func TestDeviceToken(t *testing.T) {
	secret := []byte("s3cret")
	id := uuid.New()
	tok := kettle.DeviceToken(secret, id)
	if got, ok := kettle.VerifyDeviceToken(secret, tok); !ok || got != id {
		t.Fatalf("own token refused")
	}
	bad := []string{
		"", "x", id.String(), id.String() + ".", tok[:len(tok)-1], tok + "A",
		kettle.DeviceToken([]byte("other"), id),
		uuid.NewString() + tok[36:], // another device's id with this MAC
	}
	for _, b := range bad {
		if _, ok := kettle.VerifyDeviceToken(secret, b); ok {
			t.Errorf("token %q accepted", b)
		}
	}
}

func TestValidate(t *testing.T) {
	now := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	ok := kettle.Measurement{Time: now, ChargeMWh: 0, FullMWh: 0, RateMW: -1e9, AmbientC: -50, WaterC: 150, LevelML: 0}
	if errs := ok.Validate(kettle.Window{Now: now}, &kettle.V1Names, "", nil); len(errs) != 0 {
		t.Errorf("edge values refused: %v", errs)
	}
	f := func(mod func(*kettle.Measurement), field string) {
		t.Helper()
		m := ok
		mod(&m)
		errs := m.Validate(kettle.Window{Now: now}, &kettle.V1Names, "", nil)
		if len(errs) != 1 || errs[0].Field != field {
			t.Errorf("got %v, want one error on %s", errs, field)
		}
	}
	f(func(m *kettle.Measurement) { m.ChargeMWh = -1 }, "battery_charge_mwh")
	f(func(m *kettle.Measurement) { m.FullMWh = math.Inf(1) }, "battery_full_mwh")
	f(func(m *kettle.Measurement) { m.RateMW = math.NaN() }, "battery_rate_mw")
	f(func(m *kettle.Measurement) { m.AmbientC = -50.01 }, "ambient_temp_c")
	f(func(m *kettle.Measurement) { m.WaterC = 150.01 }, "water_temp_c")
	f(func(m *kettle.Measurement) { m.LevelML = -1e-9 }, "water_level_ml")
	f(func(m *kettle.Measurement) { m.Time = kettle.MinTime.Add(-time.Nanosecond) }, "time")
	f(func(m *kettle.Measurement) { m.Time = now.Add(24*time.Hour + time.Second) }, "time")
}
