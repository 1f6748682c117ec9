package wire

import (
	"encoding/json"
	"strconv"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// CommandJSON is a command in the v1 API (GET /v1/command) and on MQTT
// (kettles/{id}/command).
type CommandJSON struct {
	Charge      bool    `json:"charge"`
	Fill        bool    `json:"fill"`
	FlushMLPerS float64 `json:"flush_ml_per_s"`
	Reason      string  `json:"reason"`
	PollAfterS  int     `json:"poll_after_s"`
}

// NewCommandJSON is c as the v1 protocol sends it; next is when the
// time-driven part of the policy may change the answer by itself.
func NewCommandJSON(c kettle.Command, next time.Duration) CommandJSON {
	return CommandJSON{c.Charge, c.Fill, c.FlushMLPerS, c.Reason, PollSeconds(next)}
}

// PollSeconds is d in whole seconds, rounded up, at least 1: a kettle
// told 0 would poll in a loop.
func PollSeconds(d time.Duration) int {
	s := int((d + time.Second - 1) / time.Second)
	if s < 1 {
		s = 1
	}
	return s
}

// AppendCommandV0 appends c as the case-study GET /command body (with its
// newline), built by hand: it is written on every poll.
func AppendCommandV0(b []byte, c kettle.Command) []byte {
	b = append(b, `{"charge":"`...)
	if c.Charge {
		b = append(b, `ChargeBattery","fill":"`...)
	} else {
		b = append(b, `NoChargeBattery","fill":"`...)
	}
	if c.Fill {
		b = append(b, `FillReservoir","flush":`...)
	} else {
		b = append(b, `NoFillReservoir","flush":`...)
	}
	if c.FlushMLPerS > 0 {
		b = append(b, `{"tag":"FlushReservoir","contents":`...)
		b = strconv.AppendFloat(b, c.FlushMLPerS, 'g', -1, 64)
		return append(b, "}}\n"...)
	}
	return append(b, `{"tag":"NoFlushReservoir"}}`+"\n"...)
}

// ParseCommand decodes a command body of api "v0" (the case-study tagged
// form) or "v1" into what a kettle acts on (v1 also carries the reason).
func ParseCommand(b []byte, api string) (kettle.Command, error) {
	if api == "v1" {
		if c, ok := parseCommandV1Fast(b); ok {
			return c, nil
		}
		return parseCommandV1(b)
	}
	var c struct {
		Charge string `json:"charge"`
		Fill   string `json:"fill"`
		Flush  struct {
			Tag      string  `json:"tag"`
			Contents float64 `json:"contents"`
		} `json:"flush"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return kettle.Command{}, err
	}
	cmd := kettle.Command{Charge: c.Charge == "ChargeBattery", Fill: c.Fill == "FillReservoir"}
	if c.Flush.Tag == "FlushReservoir" {
		cmd.FlushMLPerS = c.Flush.Contents
	}
	return cmd, nil
}

// parseCommandV1 decodes a v1 command body with encoding/json.
func parseCommandV1(b []byte) (kettle.Command, error) {
	var c struct {
		Charge      bool    `json:"charge"`
		Fill        bool    `json:"fill"`
		FlushMLPerS float64 `json:"flush_ml_per_s"`
		Reason      string  `json:"reason"`
	}
	err := json.Unmarshal(b, &c)
	return kettle.Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.FlushMLPerS, Reason: c.Reason}, err
}

// parseCommandV1Fast decodes a v1 command body in exactly the shape
// CommandJSON marshals to — the fields in order, a reason without escapes,
// no space but a trailing newline — without encoding/json, which is most
// of a simulated kettle's CPU spent on a new command. Anything else is not
// ok, for parseCommandV1 (FuzzParseCommandV1Fast holds the two to the same
// answers).
func parseCommandV1Fast(b []byte) (c kettle.Command, ok bool) {
	lit := func(s string) bool {
		if len(b) < len(s) || string(b[:len(s)]) != s {
			return false
		}
		b = b[len(s):]
		return true
	}
	boolean := func(v *bool) bool {
		switch {
		case lit("true"):
			*v = true
		case lit("false"):
			*v = false
		default:
			return false
		}
		return true
	}
	if !lit(`{"charge":`) || !boolean(&c.Charge) || !lit(`,"fill":`) || !boolean(&c.Fill) || !lit(`,"flush_ml_per_s":`) {
		return c, false
	}
	n := 0
	for n < len(b) && (b[n] >= '0' && b[n] <= '9' || b[n] == '.' || b[n] == '-' || b[n] == '+' || b[n] == 'e' || b[n] == 'E') {
		n++
	}
	if n == 0 || !jsonNumber(b[:n]) {
		return c, false
	}
	f, err := strconv.ParseFloat(string(b[:n]), 64)
	if err != nil {
		return c, false
	}
	c.FlushMLPerS, b = f, b[n:]
	if !lit(`,"reason":"`) {
		return c, false
	}
	n = 0
	for n < len(b) && b[n] != '"' {
		if b[n] == '\\' || b[n] < 0x20 || b[n] >= 0x80 {
			return c, false // escapes, control bytes, UTF-8: encoding/json's
		}
		n++
	}
	if n == len(b) {
		return c, false
	}
	c.Reason, b = string(b[:n]), b[n+1:]
	if !lit(`,"poll_after_s":`) {
		return c, false
	}
	n = 0
	for n < len(b) && b[n] >= '0' && b[n] <= '9' {
		n++
	}
	if n == 0 || n > 9 || (n > 1 && b[0] == '0') {
		return c, false
	}
	b = b[n:]
	return c, lit("}") && (len(b) == 0 || string(b) == "\n")
}

// jsonNumber reports whether b is a number as JSON writes one:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func jsonNumber(b []byte) bool {
	digits := func() int {
		n := 0
		for n < len(b) && b[n] >= '0' && b[n] <= '9' {
			n++
		}
		b = b[n:]
		return n
	}
	if len(b) > 0 && b[0] == '-' {
		b = b[1:]
	}
	if len(b) == 0 {
		return false
	}
	if b[0] == '0' {
		b = b[1:]
	} else if digits() == 0 {
		return false
	}
	if len(b) > 0 && b[0] == '.' {
		b = b[1:]
		if digits() == 0 {
			return false
		}
	}
	if len(b) > 0 && (b[0] == 'e' || b[0] == 'E') {
		b = b[1:]
		if len(b) > 0 && (b[0] == '+' || b[0] == '-') {
			b = b[1:]
		}
		if digits() == 0 {
			return false
		}
	}
	return len(b) == 0
}
