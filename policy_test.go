package kettle_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

func TestDecide(t *testing.T) {
	noon := time.Date(2026, 11, 22, 12, 5, 0, 0, time.UTC)    // in the 12:00 tea window
	evening := time.Date(2026, 11, 22, 19, 0, 0, 0, time.UTC) // no tea window
	m := func(charge, full, rate, amb, water, level float64) *kettle.Measurement {
		return &kettle.Measurement{ChargeMWh: charge, FullMWh: full, RateMW: rate, AmbientC: amb, WaterC: water, LevelML: level}
	}
	yes, no := true, false
	flush := 3.0
	type want struct {
		charge, fill bool
		flush        float64
		reason       string
	}
	f := func(latest *kettle.Measurement, capML float64, o *kettle.Override, now time.Time, w want) {
		t.Helper()
		c := kettle.Decide(kettle.PolicyInput{Latest: latest, CapacityML: capML, Override: o, Now: now})
		if c.Charge != w.charge || c.Fill != w.fill || c.FlushMLPerS != w.flush || !strings.Contains(c.Reason, w.reason) {
			t.Errorf("Decide(%+v, cap %v, %+v, %s) = %+v, want %+v", latest, capML, o, now.Format("15:04"), c, w)
		}
	}
	// No reading: charge, hold water.
	f(nil, 0, nil, evening, want{true, false, 0, "no reading"})
	// Battery thresholds and hysteresis through the charge rate.
	f(m(10, 100, -5, 20, 50, 900), 1000, nil, evening, want{true, false, 0, "battery 10% < 25%"})
	f(m(50, 100, -5, 20, 50, 950), 1000, nil, evening, want{false, false, 0, "no charge"})
	f(m(50, 100, +5, 20, 50, 950), 1000, nil, evening, want{true, false, 0, "keep charging"})
	f(m(96, 100, +5, 20, 50, 950), 1000, nil, evening, want{false, false, 0, "no charge"})
	f(m(5, 0, 0, 20, 50, 950), 1000, nil, evening, want{true, false, 0, "capacity unknown"})
	// Fill against the capacity learned from history.
	f(m(90, 100, 0, 20, 50, 500), 1000, nil, evening, want{false, true, 0, "fill"})
	f(m(90, 100, 0, 20, 50, 500), 520, nil, evening, want{false, false, 0, "hold"})
	f(m(90, 100, 0, 20, 50, 500), 0, nil, evening, want{false, true, 0, "capacity 1000"})
	// Tea time: hot water above 20 % dispenses instead of filling.
	f(m(90, 100, 0, 20, 95, 500), 1000, nil, noon, want{false, false, 10, "tea time"})
	f(m(90, 100, 0, 20, 60, 500), 1000, nil, noon, want{false, true, 0, "fill"})
	f(m(90, 100, 0, 20, 95, 100), 1000, nil, noon, want{false, true, 0, "fill"})
	f(m(90, 100, 0, 20, 95, 500), 1000, nil, noon.Add(10*time.Minute), want{false, true, 0, "fill"})
	// Overrides win while active, only for the parts they set.
	o := &kettle.Override{Charge: &yes, FlushMLPerS: &flush, ExpiresAt: evening.Add(time.Hour)}
	f(m(90, 100, 0, 20, 50, 950), 1000, o, evening, want{true, false, 3, "override of charge, flush"})
	f(m(90, 100, 0, 20, 50, 950), 1000, o, evening.Add(2*time.Hour), want{false, false, 0, "hold"})
	o2 := &kettle.Override{Fill: &no, ExpiresAt: evening.Add(time.Hour)}
	f(m(10, 100, 0, 20, 50, 100), 1000, o2, evening, want{true, false, 0, "override of fill"})
}

func TestNextChange(t *testing.T) {
	at := func(h, m int) time.Time { return time.Date(2026, 11, 22, h, m, 0, 0, time.UTC) }
	f := func(now time.Time, o *kettle.Override, want time.Duration) {
		t.Helper()
		if got := kettle.NextChange(now, o, 30*time.Second); got != want {
			t.Errorf("NextChange(%s) = %s, want %s", now.Format("15:04:05"), got, want)
		}
	}
	f(at(11, 0), nil, 30*time.Second)
	f(at(11, 59).Add(50*time.Second), nil, 10*time.Second)
	f(at(12, 9).Add(55*time.Second), nil, 5*time.Second)
	f(at(19, 0), &kettle.Override{ExpiresAt: at(19, 0).Add(7 * time.Second)}, 7*time.Second)
	f(at(23, 59).Add(59*time.Second), nil, 30*time.Second)
}
