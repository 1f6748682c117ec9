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
		var c struct {
			Charge      bool    `json:"charge"`
			Fill        bool    `json:"fill"`
			FlushMLPerS float64 `json:"flush_ml_per_s"`
			Reason      string  `json:"reason"`
		}
		err := json.Unmarshal(b, &c)
		return kettle.Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.FlushMLPerS, Reason: c.Reason}, err
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
