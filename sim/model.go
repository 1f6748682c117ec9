// Package sim is the simulated fleet behind `kettle swarm`: a small physical
// model of a kettle that obeys the commands it receives, an open-model
// scheduler that sends each kettle's readings on its own clock whatever the
// server does, latency measured from the intended send time, and an audit
// that checks every acknowledged reading is stored exactly once.
package sim

import (
	"math"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Physical constants of the model. They are chosen so that a few minutes of
// simulation show every command at work: a full reservoir heats up in about
// ten minutes and drains a good part of the battery, which then asks to charge.
const (
	TargetWaterC  = 95.0    // thermostat set point
	HeaterMW      = 500_000 // heater power, mW (500 W)
	ChargerMW     = 300_000 // charging power, mW
	FillMLPerS    = 5.0     // reservoir fill rate
	CoolingTauSec = 7200.0  // water → ambient time constant
	JoulesPerMWh  = 3.6     // 1 mWh = 3.6 J
	CupML         = 250.0   // one cup, drawn by a person now and then
	CupsPerHour   = 0.5     // mean rate of cups drawn by hand
)

// Rand is the randomness a Model uses: a float in [0, 1). A seeded PCG in the
// swarm, a fixed sequence in tests.
type Rand interface{ Float64() float64 }

// Command is what the server told a kettle to do; the model obeys it until
// the next one.
type Command struct {
	Charge      bool
	Fill        bool
	FlushMLPerS float64
}

// Model is one kettle's physical state. It is pure: Step and Reading depend
// only on the state, the command, the time and the Rand passed in, so a run is
// reproducible from its seed.
type Model struct {
	ChargeMWh  float64 // battery charge
	FullMWh    float64 // battery capacity
	RateMW     float64 // charge (+) or discharge (−) rate over the last step
	LevelML    float64 // water in the reservoir
	MaxML      float64 // what the reservoir physically holds
	WaterC     float64
	AmbientC   float64 // ambient now (recomputed each step)
	BaseC      float64 // mean ambient of this kettle's room
	SwingC     float64 // half the daily ambient swing
	heating    bool    // thermostat state (hysteresis)
	Cmd        Command
	Last       time.Time // time of the last Step
	FlushedML  float64   // water dispensed by flush commands, for tests and curiosity
	ChargedMWh float64   // energy taken from the charger
}

// NewModel returns a kettle in a plausible random state at t.
func NewModel(r Rand, t time.Time) Model {
	m := Model{
		FullMWh: 150_000 + 150_000*r.Float64(),
		MaxML:   1200 + 800*r.Float64(),
		BaseC:   18 + 6*r.Float64(),
		SwingC:  1 + 3*r.Float64(),
		Last:    t,
	}
	m.ChargeMWh = m.FullMWh * (0.1 + 0.9*r.Float64())
	m.LevelML = m.MaxML * r.Float64()
	m.AmbientC = m.Ambient(t)
	m.WaterC = m.AmbientC + (TargetWaterC-m.AmbientC)*r.Float64()
	return m
}

// Ambient is the room temperature at t: a daily cycle peaking at 15:00 UTC.
func (m *Model) Ambient(t time.Time) float64 {
	h := float64(t.UTC().Hour()) + float64(t.UTC().Minute())/60 + float64(t.UTC().Second())/3600
	return m.BaseC + m.SwingC*math.Cos(2*math.Pi*(h-15)/24)
}

// Step advances the model to t under its current command. People draw a cup
// now and then (Poisson, CupsPerHour), so the reservoir keeps needing to fill.
func (m *Model) Step(r Rand, t time.Time) {
	dt := t.Sub(m.Last).Seconds()
	if dt <= 0 {
		return
	}
	m.Last = t
	m.AmbientC = m.Ambient(t)

	// Water flows: fill at ambient temperature, flush and cups out.
	before := m.LevelML
	if m.Cmd.Fill {
		m.LevelML = math.Min(m.MaxML, m.LevelML+FillMLPerS*dt)
	}
	if added := m.LevelML - before; added > 0 {
		m.WaterC = (m.WaterC*before + m.AmbientC*added) / m.LevelML
	}
	if f := m.Cmd.FlushMLPerS; f > 0 {
		out := math.Min(m.LevelML, f*dt)
		m.LevelML -= out
		m.FlushedML += out
	}
	if r.Float64() < 1-math.Exp(-CupsPerHour*dt/3600) {
		m.LevelML = math.Max(0, m.LevelML-CupML)
	}

	// Heat: Newton cooling toward ambient, heater with hysteresis while there
	// is water and battery.
	m.WaterC = m.AmbientC + (m.WaterC-m.AmbientC)*math.Exp(-dt/CoolingTauSec)
	switch {
	case m.WaterC >= TargetWaterC:
		m.heating = false
	case m.WaterC < TargetWaterC-3:
		m.heating = true
	}
	var heatMWh float64
	if m.heating && m.LevelML > 1 && m.ChargeMWh > 0 {
		need := (TargetWaterC - m.WaterC) * m.LevelML * kettle.JoulesPerCmL / JoulesPerMWh
		heatMWh = math.Min(math.Min(HeaterMW*dt/3600, need), m.ChargeMWh)
		m.WaterC += heatMWh * JoulesPerMWh / (m.LevelML * kettle.JoulesPerCmL)
	}
	if m.LevelML <= 1 {
		m.WaterC = m.AmbientC
	}

	// Battery: the heater draws, the charger adds.
	var chargeMWh float64
	if m.Cmd.Charge {
		chargeMWh = math.Min(ChargerMW*dt/3600, m.FullMWh-(m.ChargeMWh-heatMWh))
		chargeMWh = math.Max(0, chargeMWh)
	}
	m.ChargeMWh = math.Min(m.FullMWh, math.Max(0, m.ChargeMWh-heatMWh+chargeMWh))
	m.ChargedMWh += chargeMWh
	m.RateMW = (chargeMWh - heatMWh) * 3600 / dt
}

// Obey steps the model to t under the old command, then switches to c.
func (m *Model) Obey(r Rand, t time.Time, c Command) {
	m.Step(r, t)
	m.Cmd = c
}

// Reading is the measurement the kettle reports now. Values are rounded the
// way a firmware would (whole mWh and mL, 0.01 °C), which also keeps JSON short.
func (m *Model) Reading() kettle.Measurement {
	return kettle.Measurement{
		Time:      m.Last.UTC().Truncate(kettle.TimePrecis),
		ChargeMWh: math.Round(m.ChargeMWh),
		FullMWh:   math.Round(m.FullMWh),
		RateMW:    math.Round(m.RateMW),
		AmbientC:  math.Round(m.AmbientC*100) / 100,
		WaterC:    math.Round(m.WaterC*100) / 100,
		LevelML:   math.Round(m.LevelML),
	}
}
