package kettle

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Command is what a kettle should do until its next poll.
type Command struct {
	Charge      bool
	Fill        bool
	FlushMLPerS float64 // 0 = do not flush
	Reason      string
}

// AppendActions appends "charge|fill|flush" (as fmt's %t|%t|%g would print
// them) to b: what a kettle acts on, without the reason's prose. The HTTP
// ETag and the MQTT push decision hash it.
func (c Command) AppendActions(b []byte) []byte {
	b = strconv.AppendBool(b, c.Charge)
	b = append(b, '|')
	b = strconv.AppendBool(b, c.Fill)
	b = append(b, '|')
	return strconv.AppendFloat(b, c.FlushMLPerS, 'g', -1, 64)
}

// The policy's constants. See Decide.
const (
	ChargeStartFraction = 0.25  // start charging below this fraction of full
	ChargeStopFraction  = 0.95  // a charging kettle keeps charging up to this
	FillStopFraction    = 0.90  // fill while the level is below this fraction of capacity
	FlushMinFraction    = 0.20  // dispense only while above this fraction of capacity
	FlushMinWaterC      = 80.0  // dispense only hot water
	FlushRateMLPerS     = 10.0  // dispensing rate at tea time
	DefaultCapacityML   = 1000. // capacity of a device with no history
	TeaWindow           = 10 * time.Minute
)

// TeaHours are the UTC hours at whose start the fleet dispenses tea.
var TeaHours = [...]int{7, 12, 16}

// PolicyInput is everything Decide looks at.
type PolicyInput struct {
	Latest     *Measurement // newest reading; nil if none
	CapacityML float64      // largest level ever stored for the device (history)
	Override   *Override    // may be nil or expired
	Now        time.Time
}

// Decide is the command policy, a pure function of the device's latest
// reading, its history (the reservoir capacity it has shown), an operator
// override and the time:
//
//   - charge: a kettle whose battery is below 25 % of full charges; one that is
//     already charging (rate > 0) continues up to 95 %; an unknown or zero
//     capacity charges.
//   - flush: during a tea window (the first 10 minutes of 07:00, 12:00 and
//     16:00 UTC) a kettle with hot water (≥ 80 °C) above 20 % of its capacity
//     dispenses at 10 mL/s.
//   - fill: a kettle that is not dispensing fills while its level is below
//     90 % of its capacity (the largest level it has ever reported, or 1000 mL
//     if it never reported one).
//   - an active override replaces whichever of charge, fill and flush it sets.
//
// A kettle that has never reported charges and holds its water.
func Decide(in PolicyInput) Command {
	var c Command
	var why []string
	if m := in.Latest; m == nil {
		c.Charge = true
		why = append(why, "no reading yet: charge, hold water")
	} else {
		frac := 0.0
		if m.FullMWh > 0 {
			frac = m.ChargeMWh / m.FullMWh
		}
		switch {
		case m.FullMWh <= 0:
			c.Charge = true
			why = append(why, "battery capacity unknown: charge")
		case frac < ChargeStartFraction:
			c.Charge = true
			why = append(why, fmt.Sprintf("battery %.0f%% < %.0f%%: charge", frac*100, ChargeStartFraction*100))
		case m.RateMW > 0 && frac < ChargeStopFraction:
			c.Charge = true
			why = append(why, fmt.Sprintf("charging, battery %.0f%% < %.0f%%: keep charging", frac*100, ChargeStopFraction*100))
		default:
			why = append(why, fmt.Sprintf("battery %.0f%%: no charge", frac*100))
		}
		capML := in.CapacityML
		if capML <= 0 {
			capML = DefaultCapacityML
		}
		if teaTime(in.Now) && m.WaterC >= FlushMinWaterC && m.LevelML > FlushMinFraction*capML {
			c.FlushMLPerS = FlushRateMLPerS
			why = append(why, fmt.Sprintf("tea time, water %.0f °C: dispense %g mL/s", m.WaterC, FlushRateMLPerS))
		} else if m.LevelML < FillStopFraction*capML {
			c.Fill = true
			why = append(why, fmt.Sprintf("level %.0f mL < %.0f%% of capacity %.0f mL: fill", m.LevelML, FillStopFraction*100, capML))
		} else {
			why = append(why, fmt.Sprintf("level %.0f mL of %.0f mL: hold", m.LevelML, capML))
		}
	}
	if o := in.Override; o.ActiveAt(in.Now) {
		var set []string
		if o.Charge != nil {
			c.Charge = *o.Charge
			set = append(set, "charge")
		}
		if o.Fill != nil {
			c.Fill = *o.Fill
			set = append(set, "fill")
		}
		if o.FlushMLPerS != nil {
			c.FlushMLPerS = *o.FlushMLPerS
			set = append(set, "flush")
		}
		if len(set) > 0 {
			why = append(why, fmt.Sprintf("override of %s until %s", strings.Join(set, ", "), o.ExpiresAt.UTC().Format(time.RFC3339)))
		}
	}
	c.Reason = strings.Join(why, "; ")
	return c
}

func teaTime(now time.Time) bool {
	now = now.UTC()
	for _, h := range TeaHours {
		start := time.Date(now.Year(), now.Month(), now.Day(), h, 0, 0, 0, time.UTC)
		if !now.Before(start) && now.Before(start.Add(TeaWindow)) {
			return true
		}
	}
	return false
}

// NextChange is a hint for poll_after_s: how long until the time-dependent
// part of the policy (a tea window, an override expiry) can change the answer
// by itself, capped at max.
func NextChange(now time.Time, o *Override, max time.Duration) time.Duration {
	best := max
	now = now.UTC()
	for day := 0; day < 2; day++ {
		for _, h := range TeaHours {
			start := time.Date(now.Year(), now.Month(), now.Day()+day, h, 0, 0, 0, time.UTC)
			for _, t := range []time.Time{start, start.Add(TeaWindow)} {
				if d := t.Sub(now); d > 0 && d < best {
					best = d
				}
			}
		}
	}
	if o.ActiveAt(now) {
		if d := o.ExpiresAt.Sub(now); d > 0 && d < best {
			best = d
		}
	}
	return best
}
