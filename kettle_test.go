package kettle_test

import (
	"math"
	"math/rand/v2"
	"strings"
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

// TestDeviceTokensRotation: with the new secret and the one being retired,
// a token of either is accepted and says which; a token of neither, or any
// token against an empty secret, is not.
func TestDeviceTokensRotation(t *testing.T) {
	cur, prev := []byte("new-secret"), []byte("old-secret")
	id := uuid.New()
	for _, c := range []struct {
		tok  string
		want int
	}{
		{kettle.DeviceToken(cur, id), 0},
		{kettle.DeviceToken(prev, id), 1},
		{kettle.DeviceToken([]byte("third"), id), -1},
		{kettle.DeviceToken(nil, id), -1},
	} {
		got, i := kettle.VerifyDeviceTokens(c.tok, cur, prev)
		if i != c.want || i >= 0 && got != id {
			t.Errorf("VerifyDeviceTokens(%q) = %v, %d; want %d", c.tok, got, i, c.want)
		}
	}
	if _, i := kettle.VerifyDeviceTokens(kettle.DeviceToken(nil, id), cur, nil); i != -1 {
		t.Errorf("a token of the empty secret accepted with no previous secret set: %d", i)
	}
	if _, ok := kettle.VerifyDeviceToken(nil, kettle.DeviceToken(nil, id)); ok {
		t.Errorf("VerifyDeviceToken with an empty secret accepted a token")
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

func TestValidateRetention(t *testing.T) {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	w := kettle.Window{Now: now, Oldest: now.Add(-90 * 24 * time.Hour)}
	m := kettle.Measurement{Time: w.Oldest, FullMWh: 1, LevelML: 1}
	if errs := m.Validate(w, &kettle.V1Names, "", nil); len(errs) != 0 {
		t.Errorf("a reading at the retention bound refused: %v", errs)
	}
	m.Time = w.Oldest.Add(-time.Microsecond)
	errs := m.Validate(w, &kettle.V1Names, "[2].", nil)
	if len(errs) != 1 || errs[0].Field != "[2].time" || !strings.Contains(errs[0].Message, "2026-08-24T12:00:00Z") || !strings.Contains(errs[0].Message, "90d") {
		t.Errorf("a reading older than the retention: %v; want one error on [2].time naming the bound and 90d", errs)
	}
}

func TestRetentionBounds(t *testing.T) {
	for _, c := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true}, {"90d", 90 * 24 * time.Hour, true}, {"2160h", 90 * 24 * time.Hour, true}, {"36h", 36 * time.Hour, true},
		{"1d", 24 * time.Hour, true}, {"23h", 0, false}, {"0d", 0, true}, {"-1d", 0, false}, {"x", 0, false}, {"1.5d", 0, false}, {"", 0, false}, {"-48h", 0, false},
		{"36600d", 36600 * 24 * time.Hour, true}, {"36601d", 0, false}, {"2147483647d", 0, false}, {"9999999999h", 0, false},
	} {
		got, err := kettle.ParseRetention(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("ParseRetention(%q) = %v, %v; want %v, ok %v", c.in, got, err, c.want, c.ok)
		}
		if err == nil && got > 0 {
			if back, err := kettle.ParseRetention(kettle.FormatRetention(got)); err != nil || back != got {
				t.Errorf("ParseRetention(FormatRetention(%v)) = %v, %v", got, back, err)
			}
		}
	}
	for _, c := range []struct{ now, want string }{
		{"2026-11-26T02:00:00Z", "2026-08-28T00:00:00Z"}, // now − 90d = 2026-08-28T02:00Z
		{"2026-10-30T00:00:00Z", "2026-08-01T00:00:00Z"}, // 2026-08-01 exactly
		{"2026-10-29T23:59:59Z", "2026-07-31T00:00:00Z"},
		{"2026-03-01T05:00:00+09:00", "2025-11-30T00:00:00Z"}, // 2026-02-28T20:00Z − 90d = 2025-11-30T20:00Z: UTC days
	} {
		now, _ := time.Parse(time.RFC3339, c.now)
		got := kettle.ExpireBefore(now, 90*24*time.Hour)
		if got.Format(time.RFC3339) != c.want {
			t.Errorf("ExpireBefore(%s, 90d) = %s, want %s", c.now, got.Format(time.RFC3339), c.want)
		}
		if err := kettle.CheckDayStart(got); err != nil {
			t.Errorf("CheckDayStart(ExpireBefore(…)) = %v", err)
		}
	}
	if err := kettle.CheckDayStart(time.Date(2026, 8, 28, 0, 0, 0, 1000, time.UTC)); kettle.ErrorCode(err) != kettle.EInvalid {
		t.Errorf("CheckDayStart of a µs past midnight: %v", err)
	}
	if err := kettle.CheckDayStart(time.Date(2026, 8, 28, 0, 0, 0, 0, time.FixedZone("CET", 3600))); kettle.ErrorCode(err) != kettle.EInvalid {
		t.Errorf("CheckDayStart of midnight CET (23:00 UTC): %v", err)
	}
}

func TestMomentsWithout(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var a, b kettle.Moments
	for range 3000 {
		a.Add(20 + rng.Float64()*70)
	}
	for range 1000 {
		b.Add(5 + rng.Float64()*30)
	}
	got := a.Merge(b).Without(b)
	if got.N != a.N || math.Abs(got.Mean-a.Mean) > 1e-9*a.Mean || math.Abs(got.M2-a.M2) > 1e-9*a.M2 {
		t.Errorf("Merge then Without: %+v, want %+v", got, a)
	}
	if got := a.Without(a); got != (kettle.Moments{}) {
		t.Errorf("all removed: %+v", got)
	}
	if got := a.Without(kettle.Moments{}); got != a {
		t.Errorf("nothing removed: %+v", got)
	}
}

// FuzzValid: Valid says yes exactly when Validate finds nothing wrong.
func FuzzValid(f *testing.F) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	type seed struct {
		ns                                        int64
		charge, full, rate, ambient, water, level float64
		retention                                 int64
	}
	good := seed{now.UnixNano(), 57, 100, -2.5, 21.5, 88.25, 750, int64(time.Hour)}
	// the good reading, the edges it may touch, and one fault at a time
	for _, change := range []func(*seed){
		func(*seed) {},
		func(s *seed) { s.ns, s.retention = kettle.MinTime.UnixNano(), 0 },
		func(s *seed) { s.ns = now.Add(kettle.MaxAhead).UnixNano() },
		func(s *seed) { s.ns = now.Add(-time.Hour).UnixNano() },
		func(s *seed) {
			s.charge, s.full, s.level, s.ambient, s.water = 0, math.MaxFloat64, 0, kettle.MinTempC, kettle.MaxTempC
		},
		func(s *seed) { s.ns, s.retention = kettle.MinTime.UnixNano()-1, 0 },
		func(s *seed) { s.ns = now.Add(-time.Hour).UnixNano() - 1 },
		func(s *seed) { s.ns = now.Add(kettle.MaxAhead).UnixNano() + 1 },
		func(s *seed) { s.charge = -1 }, func(s *seed) { s.charge = math.Inf(1) }, func(s *seed) { s.charge = math.NaN() },
		func(s *seed) { s.full = -1e-300 }, func(s *seed) { s.full = math.Inf(1) }, func(s *seed) { s.full = math.NaN() },
		func(s *seed) { s.rate = math.Inf(-1) }, func(s *seed) { s.rate = math.Inf(1) }, func(s *seed) { s.rate = math.NaN() },
		func(s *seed) { s.ambient = kettle.MinTempC - 0.1 }, func(s *seed) { s.ambient = kettle.MaxTempC + 0.1 }, func(s *seed) { s.ambient = math.NaN() },
		func(s *seed) { s.water = kettle.MinTempC - 0.1 }, func(s *seed) { s.water = kettle.MaxTempC + 0.1 }, func(s *seed) { s.water = math.NaN() },
		func(s *seed) { s.level = -1 }, func(s *seed) { s.level = math.Inf(1) }, func(s *seed) { s.level = math.NaN() },
	} {
		s := good
		change(&s)
		f.Add(s.ns, s.charge, s.full, s.rate, s.ambient, s.water, s.level, s.retention)
	}
	f.Fuzz(func(t *testing.T, ns int64, charge, full, rate, ambient, water, level float64, retention int64) {
		w := kettle.Window{Now: now}
		if retention > 0 {
			w.Oldest = now.Add(-time.Duration(retention))
		}
		m := kettle.Measurement{Time: time.Unix(0, ns).UTC(), ChargeMWh: charge, FullMWh: full, RateMW: rate,
			AmbientC: ambient, WaterC: water, LevelML: level}
		errs := m.Validate(w, &kettle.V1Names, "", nil)
		if got := m.Valid(w); got != (len(errs) == 0) {
			t.Fatalf("Valid(%+v, %+v) = %v, Validate: %v", m, w, got, errs)
		}
	})
}
