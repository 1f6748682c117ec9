package kettle

import (
	"fmt"
	"math"
	"time"
)

// Limits on what can be a reading. Anything inside them is accepted: the
// case-study client sends random but plausible values and must never see a
// 4xx.
const (
	MinTempC = -50.0
	MaxTempC = 150.0
	// MaxQuantity bounds a charge, capacity, rate (either sign) or level:
	// a billion mWh or mL is no kettle, and unbounded values overflowed the
	// fleet's sums (Σ (water − ambient) × level) to ±Inf and NaN, which no
	// store can keep.
	MaxQuantity = 1e9
	MaxBatch    = 1000             // readings in one upload
	MaxBody     = 1 << 20          // bytes in one request body
	MaxAhead    = 24 * time.Hour   // device clock may run this far ahead of ours
	TimePrecis  = time.Microsecond // every store keeps device time to this
)

// MinTime is the earliest device time accepted.
var MinTime = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// FieldNames gives the wire names of the measurement fields in one protocol,
// so validation errors name the field the client actually sent.
type FieldNames struct {
	Time, Charge, Full, Rate, Ambient, Water, Level string
}

// V1Names are the field names of the v1 API and MQTT payloads.
var V1Names = FieldNames{"time", "battery_charge_mwh", "battery_full_mwh", "battery_rate_mw", "ambient_temp_c", "water_temp_c", "water_level_ml"}

// V0Names are the field names of the case-study protocol.
var V0Names = FieldNames{"time", "charge_now", "charge_full", "charge_rate", "ambient_temp", "water_temp", "water_level"}

// Window is the device time a reading must fall in to be accepted: from
// Oldest (the retention window; zero: no bound but MinTime) to Now +
// MaxAhead, where Now is the server clock.
type Window struct {
	Now, Oldest time.Time
}

// Normalize puts m.Time in UTC at store precision.
func (m *Measurement) Normalize() { m.Time = m.Time.UTC().Truncate(TimePrecis) }

// Validate appends to errs one FieldError per bad field, named with names.
// w is the time window (the server clock, the retention bound). prefix is
// prepended to field names (e.g. "[3].") for readings inside a batch.
func (m *Measurement) Validate(w Window, names *FieldNames, prefix string, errs []FieldError) []FieldError {
	bad := func(field, msg string) { errs = append(errs, FieldError{Field: prefix + field, Message: msg}) }
	switch {
	case m.Time.Before(MinTime):
		bad(names.Time, fmt.Sprintf("must be at or after %s, got %s", MinTime.Format(time.RFC3339), m.Time.Format(time.RFC3339Nano)))
	case m.Time.Before(w.Oldest):
		bad(names.Time, fmt.Sprintf("must be at or after %s: the server keeps readings %s (its retention), got %s",
			w.Oldest.UTC().Format(time.RFC3339), FormatRetention(w.Now.Sub(w.Oldest)), m.Time.Format(time.RFC3339Nano)))
	case m.Time.After(w.Now.Add(MaxAhead)):
		bad(names.Time, fmt.Sprintf("must be at most 24h ahead of the server clock (%s), got %s", w.Now.UTC().Format(time.RFC3339), m.Time.Format(time.RFC3339Nano)))
	}
	nonNeg := func(field string, v float64) {
		if !finite(v) {
			bad(field, "must be a finite number")
		} else if v < 0 || v > MaxQuantity {
			bad(field, fmt.Sprintf("must be between 0 and %g, got %v", MaxQuantity, v))
		}
	}
	temp := func(field string, v float64) {
		if !finite(v) {
			bad(field, "must be a finite number")
		} else if v < MinTempC || v > MaxTempC {
			bad(field, fmt.Sprintf("must be between %v and %v °C, got %v", MinTempC, MaxTempC, v))
		}
	}
	nonNeg(names.Charge, m.ChargeMWh)
	nonNeg(names.Full, m.FullMWh)
	if !finite(m.RateMW) {
		bad(names.Rate, "must be a finite number")
	} else if m.RateMW < -MaxQuantity || m.RateMW > MaxQuantity {
		bad(names.Rate, fmt.Sprintf("must be between %g and %g, got %v", -MaxQuantity, MaxQuantity, m.RateMW))
	}
	temp(names.Ambient, m.AmbientC)
	temp(names.Water, m.WaterC)
	nonNeg(names.Level, m.LevelML)
	return errs
}

// Valid reports whether Validate would find nothing wrong with m, without
// building a message: what a decoder that only needs yes or no calls for
// every reading of an upload (FuzzValid holds the two to the same answer).
func (m *Measurement) Valid(w Window) bool {
	// A comparison with NaN is false, and ±Inf is outside every range below.
	return !m.Time.Before(MinTime) && !m.Time.Before(w.Oldest) && !m.Time.After(w.Now.Add(MaxAhead)) &&
		m.ChargeMWh >= 0 && m.ChargeMWh <= MaxQuantity &&
		m.FullMWh >= 0 && m.FullMWh <= MaxQuantity &&
		m.RateMW >= -MaxQuantity && m.RateMW <= MaxQuantity &&
		m.AmbientC >= MinTempC && m.AmbientC <= MaxTempC &&
		m.WaterC >= MinTempC && m.WaterC <= MaxTempC &&
		m.LevelML >= 0 && m.LevelML <= MaxQuantity
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
