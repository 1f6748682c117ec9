// Package seed generates realistic kettle history: deterministic, pure (no
// store, no clock), one independent simulation per device, so a fleet can be
// generated in parallel and a re-run produces exactly the same readings.
//
// Physics, per device:
//   - a location (longitude → local solar time) with a daily ambient cycle
//     peaking mid-afternoon local time, plus slow noise;
//   - water cooling toward ambient (Newton, time constant of an insulated
//     kettle), heated at 2 kW to ~96 °C before each tea time;
//   - a reservoir dispensed at 10 mL/s at tea times clustered around the
//     fleet's tea hours (kettle.TeaHours, UTC, with per-device habits and
//     jitter) plus the odd cup, and refilled from the tap when low;
//   - a battery draining for the electronics and charging from 25 % to 95 %
//     of its capacity, never outside [0, capacity];
//   - a few devices offline for a while (no readings; physics goes on), and
//     a few silent at the end.
//
// Reading times sit on a per-device grid anchored at the unix epoch
// (phase + k × interval), so two runs with different ends produce the same
// keys where they overlap and a store's idempotency skips them.
package seed

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
)

// Fleet describes the history to generate.
type Fleet struct {
	Seed     uint64
	Devices  int
	Start    time.Time     // first possible reading (inclusive)
	End      time.Time     // exclusive
	Interval time.Duration // between two readings of a device, ≥ 1s
}

// Validate says what is wrong with f, in flag terms.
func (f Fleet) Validate() error {
	switch {
	case f.Devices <= 0:
		return fmt.Errorf("--devices must be > 0, got %d", f.Devices)
	case f.Interval < time.Second:
		return fmt.Errorf("--interval must be ≥ 1s, got %s", f.Interval)
	case !f.End.After(f.Start):
		return fmt.Errorf("history must end after it starts (%s … %s); raise --days", f.Start.Format(time.RFC3339), f.End.Format(time.RFC3339))
	case f.Start.Before(kettle.MinTime):
		return fmt.Errorf("history must start at or after %s, got %s; lower --days or move --end", kettle.MinTime.Format(time.RFC3339), f.Start.Format(time.RFC3339))
	}
	return nil
}

// RowsPerDevice is about how many readings each device produces (offline
// devices produce fewer).
func (f Fleet) RowsPerDevice() int64 { return int64(f.End.Sub(f.Start) / f.Interval) }

// RowsPerDay is about how many readings a day of the whole fleet holds.
func (f Fleet) RowsPerDay() int64 { return int64(f.Devices) * int64(24*time.Hour/f.Interval) }

// namespace of the device ids' name-based UUIDs.
var namespace = uuid.MustParse("6b657474-6c65-666c-6565-74736565640a")

// DeviceID is device i's id in the fleet of seed: a name-based (SHA-1) UUID
// of both, so a re-run registers the same devices.
func DeviceID(seed uint64, i int) kettle.DeviceID {
	return uuid.NewSHA1(namespace, fmt.Appendf(nil, "kettle-seed/%d/%d", seed, i))
}

// Kettle is one simulated device. Call Next until it returns false.
type Kettle struct {
	ID  kettle.DeviceID
	rng *rand.Rand

	// profile
	lonHours         float64 // local solar time − UTC
	ambBase, ambAmp  float64
	capML            float64
	fullMWh          float64
	drainMW          float64
	chargeMW         float64
	tauS             float64 // cooling time constant
	habit            [len(kettle.TeaHours)]float64
	cupsPerDay       float64
	offFrom, offTo   time.Time
	interval         time.Duration
	dtS              float64
	end              time.Time
	next             time.Time
	simulated        bool // at least one step taken
	nextTea          time.Time
	heatUntilTea     bool
	ambNoise         float64
	water, level     float64
	charge           float64
	charging         bool
	dispenseLeft     float64
	filling, heating bool
}

// Tap-water temperature, heater power, dispense and fill rates.
const (
	tapC       = 12.0
	heaterW    = 2000.0
	boilC      = 96.0
	fillMLPerS = 25.0
	teaLead    = 5 * time.Minute // heat this long before tea
)

// Kettle returns device i's simulation, positioned before its first reading.
func (f Fleet) Kettle(i int) *Kettle {
	id := DeviceID(f.Seed, i)
	rng := rand.New(rand.NewPCG(f.Seed, uint64(i)^0x6b65_7474_6c65_0000))
	k := &Kettle{ID: id, rng: rng, interval: f.Interval, dtS: f.Interval.Seconds(), end: f.End}
	k.lonHours = (float64(rng.Float64()*360) - 180) / 15
	k.ambBase = 17 + float64(rng.Float64()*8)
	k.ambAmp = 1 + float64(rng.Float64()*4)
	k.capML = []float64{1000, 1200, 1500, 1700}[rng.IntN(4)]
	k.fullMWh = []float64{20000, 30000, 40000, 60000}[rng.IntN(4)]
	k.drainMW = 200 + float64(rng.Float64()*600)
	k.chargeMW = 3000 + float64(rng.Float64()*4000)
	k.tauS = (40 + float64(rng.Float64()*60)) * 60
	for j := range k.habit {
		k.habit[j] = 0.3 + float64(rng.Float64()*0.65)
	}
	k.cupsPerDay = rng.Float64() * 2
	span := f.End.Sub(f.Start)
	switch r := rng.Float64(); {
	case r < 0.02: // offline for a while: 2 h … 3 days somewhere in the history
		d := time.Duration(2+float64(rng.Float64()*70)) * time.Hour
		k.offFrom = f.Start.Add(time.Duration(rng.Float64() * float64(span)))
		k.offTo = k.offFrom.Add(d)
	case r < 0.03: // silent for the last 1 … 12 h
		k.offFrom = f.End.Add(-time.Duration(1+float64(rng.Float64()*11)) * time.Hour)
		k.offTo = f.End
	}
	// initial state
	k.level = k.capML * (0.3 + float64(rng.Float64()*0.6))
	k.water = k.ambBase
	k.charge = k.fullMWh * (0.3 + float64(rng.Float64()*0.65))
	// first reading: the first grid point ≥ Start
	phase := time.Duration(rng.Int64N(int64(f.Interval))).Truncate(time.Microsecond)
	since := f.Start.Sub(time.Unix(0, 0).Add(phase))
	steps := since / f.Interval
	if since%f.Interval != 0 && since > 0 {
		steps++
	}
	k.next = time.Unix(0, 0).Add(phase + steps*f.Interval).UTC()
	k.scheduleTea(k.next)
	return k
}

// Next fills m with the device's next reading before until (and before the
// fleet's End) and reports whether there was one; if not, nothing is
// consumed. Readings in an offline period are simulated but skipped.
func (k *Kettle) Next(until time.Time, m *kettle.Measurement) bool {
	for {
		if !k.next.Before(until) || !k.next.Before(k.end) {
			return false
		}
		t := k.next
		k.step(t)
		k.next = t.Add(k.interval)
		if !t.Before(k.offFrom) && t.Before(k.offTo) {
			continue
		}
		*m = kettle.Measurement{
			Device:    k.ID,
			Time:      t,
			ChargeMWh: round(k.charge, 10),
			FullMWh:   k.fullMWh,
			RateMW:    round(k.rate(), 10),
			AmbientC:  round(k.ambient(t), 100),
			WaterC:    round(k.water, 100),
			LevelML:   round(k.level, 10),
		}
		return true
	}
}

func round(x, per float64) float64 { return math.Round(x*per) / per }

func (k *Kettle) ambient(t time.Time) float64 {
	local := float64(t.Unix()%86400)/3600 + k.lonHours
	return k.ambBase + float64(k.ambAmp*cos(2*math.Pi*(local-15)/24)) + k.ambNoise
}

func (k *Kettle) rate() float64 {
	if k.charging {
		return k.chargeMW - k.drainMW
	}
	return -k.drainMW
}

// scheduleTea picks the device's next tea time after t: the next tea hour
// the device keeps (its habit), jittered by a few minutes.
func (k *Kettle) scheduleTea(t time.Time) {
	day := t.UTC().Truncate(24 * time.Hour)
	for d := 0; d < 30; d++ {
		for j, h := range kettle.TeaHours {
			if k.rng.Float64() >= k.habit[j] {
				continue
			}
			at := day.Add(time.Duration(d*24+h)*time.Hour + time.Duration(k.rng.NormFloat64()*8*float64(time.Minute)))
			if at.After(t) {
				k.nextTea = at
				return
			}
		}
	}
	k.nextTea = t.Add(24 * time.Hour)
}

// step advances the physics by one interval, ending at t.
// Every product that feeds a sum is float64(…): see fmath.go.
func (k *Kettle) step(t time.Time) {
	dt := k.dtS
	if !k.simulated {
		k.simulated = true
		k.water = k.ambient(t)
	}
	k.ambNoise = float64(0.98*k.ambNoise) + float64(k.rng.NormFloat64()*0.05)
	amb := k.ambient(t)

	// tea: heat ahead, then dispense a cup or a pot
	if !k.heatUntilTea && t.After(k.nextTea.Add(-teaLead)) {
		k.heatUntilTea = true
		k.heating = true
	}
	if k.heatUntilTea && !t.Before(k.nextTea) {
		k.heatUntilTea = false
		k.dispenseLeft += 200 + float64(k.rng.Float64()*400)
		k.scheduleTea(t)
	}
	if k.rng.Float64() < k.cupsPerDay*dt/86400 {
		k.dispenseLeft += 150 + float64(k.rng.Float64()*150)
		k.heating = true
	}
	if k.dispenseLeft > 0 {
		out := min(k.dispenseLeft, kettle.FlushRateMLPerS*dt, k.level)
		k.level -= out
		k.dispenseLeft -= out
		if k.level <= 0 {
			k.dispenseLeft = 0
		}
	}
	// refill from the tap when low
	if !k.filling && k.dispenseLeft == 0 && k.level < float64(0.25*k.capML) {
		k.filling = true
	}
	if k.filling {
		in := min(fillMLPerS*dt, float64(0.95*k.capML)-k.level)
		if in > 0 {
			k.water = (float64(k.water*k.level) + float64(tapC*in)) / (k.level + in)
			k.level += in
		}
		if k.level >= float64(0.95*k.capML)-1e-9 {
			k.filling = false
		}
	}
	// temperature: cool toward ambient, heat while the heater is on
	k.water = amb + float64((k.water-amb)*exp(-dt/k.tauS))
	if k.heating && k.level > 10 {
		k.water = min(k.water+heaterW*dt/(kettle.JoulesPerCmL*k.level), 100)
		if k.water >= boilC && !k.heatUntilTea {
			k.heating = false
		}
	} else if k.level <= 10 {
		k.heating = false
	}
	// battery
	if k.charge < float64(kettle.ChargeStartFraction*k.fullMWh) {
		k.charging = true
	} else if k.charge >= float64(kettle.ChargeStopFraction*k.fullMWh) {
		k.charging = false
	}
	k.charge = math.Min(math.Max(k.charge+k.rate()*dt/3600, 0), k.fullMWh)
}
