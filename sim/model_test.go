package sim

import (
	"math"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// fixedRand returns the same value forever: no cups drawn at 0.99, and a
// mid-range state from NewModel.
type fixedRand float64

func (f fixedRand) Float64() float64 { return float64(f) }

var t0 = time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)

func run(m *Model, c Command, d time.Duration) {
	m.Cmd = c
	end := m.Last.Add(d)
	for t := m.Last; t.Before(end); {
		t = t.Add(30 * time.Second)
		m.Step(fixedRand(0.99), t)
	}
}

func TestModelObeysCommands(t *testing.T) {
	m := NewModel(fixedRand(0.5), t0)
	m.WaterC = TargetWaterC // thermostat satisfied: no heating for a while
	m.heating = false

	charge := m.ChargeMWh
	run(&m, Command{Charge: true}, 5*time.Minute)
	if m.ChargeMWh <= charge {
		t.Errorf("charging: charge %v → %v, want it to rise", charge, m.ChargeMWh)
	}

	level := m.LevelML
	run(&m, Command{Fill: true}, time.Minute)
	if m.LevelML <= level {
		t.Errorf("fill: level %v → %v, want it to rise", level, m.LevelML)
	}
	if m.LevelML > m.MaxML {
		t.Errorf("fill: level %v above the reservoir's %v", m.LevelML, m.MaxML)
	}

	level = m.LevelML
	run(&m, Command{FlushMLPerS: 2}, time.Minute)
	if want := level - 120; math.Abs(m.LevelML-want) > 1e-6 {
		t.Errorf("flush 2 mL/s for 60 s: level %v → %v, want %v", level, m.LevelML, want)
	}

	// Cold water heats up on the battery, draining it.
	m.WaterC, m.heating = 20, true
	charge = m.ChargeMWh
	run(&m, Command{}, 5*time.Minute)
	if m.WaterC <= 20 || m.ChargeMWh >= charge || m.RateMW >= 0 {
		t.Errorf("heating: water %v °C, charge %v → %v, rate %v; want warmer water and a draining battery", m.WaterC, charge, m.ChargeMWh, m.RateMW)
	}

	// An empty battery cannot heat: the water cools toward ambient.
	m.ChargeMWh, m.WaterC = 0, 90
	run(&m, Command{}, time.Hour)
	if m.WaterC >= 90 || m.WaterC < m.AmbientC {
		t.Errorf("no battery: water %v °C after an hour, ambient %v: want it cooling toward ambient", m.WaterC, m.AmbientC)
	}
	if m.ChargeMWh != 0 {
		t.Errorf("no battery, no charger: charge %v, want 0", m.ChargeMWh)
	}
}

func TestModelReadingIsValid(t *testing.T) {
	var r pcg
	r.Seed(1, 2)
	m := NewModel(&r, t0)
	cmds := []Command{{Charge: true}, {Fill: true}, {FlushMLPerS: 10}, {}}
	var errs []kettle.FieldError
	for i := range 2000 { // about 17 simulated hours
		if i%40 == 0 {
			m.Cmd = cmds[i/40%len(cmds)]
		}
		m.Step(&r, t0.Add(time.Duration(i)*30*time.Second))
		rd := m.Reading()
		errs = rd.Validate(kettle.Window{Now: t0.Add(48 * time.Hour)}, &kettle.V1Names, "", errs)
	}
	if len(errs) > 0 {
		t.Fatalf("model produced invalid readings: %v", errs[0])
	}
}

func TestModelDeterministic(t *testing.T) {
	sim := func() Model {
		var r pcg
		r.Seed(7, 7)
		m := NewModel(&r, t0)
		for i := 1; i <= 500; i++ {
			if i%50 == 0 {
				m.Cmd = Command{Charge: i%100 == 0, Fill: i%150 == 0}
			}
			m.Step(&r, t0.Add(time.Duration(i)*30*time.Second))
		}
		return m
	}
	if a, b := sim(), sim(); a != b {
		t.Fatalf("same seed, different states:\n%+v\n%+v", a, b)
	}
}

func TestAmbientDailyCycle(t *testing.T) {
	m := Model{BaseC: 20, SwingC: 3}
	if got := m.Ambient(time.Date(2026, 1, 1, 15, 0, 0, 0, time.UTC)); math.Abs(got-23) > 1e-9 {
		t.Errorf("15:00 UTC: %v, want the peak 23", got)
	}
	if got := m.Ambient(time.Date(2026, 1, 1, 3, 0, 0, 0, time.UTC)); math.Abs(got-17) > 1e-9 {
		t.Errorf("03:00 UTC: %v, want the trough 17", got)
	}
}
