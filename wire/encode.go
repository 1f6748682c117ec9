package wire

import (
	"math"
	"strconv"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// AppendV0 appends m as a case-study POST /measurement body.
func AppendV0(b []byte, m *kettle.Measurement) []byte { return appendReading(b, m, &kettle.V0Names) }

// AppendV1 appends m as one v1 reading (a JSON object).
func AppendV1(b []byte, m *kettle.Measurement) []byte { return appendReading(b, m, &kettle.V1Names) }

// AppendV1Upload appends ms as one v1 upload (POST /v1/measurements or an
// MQTT payload): the object alone for one reading, an array for more.
func AppendV1Upload(b []byte, ms []kettle.Measurement) []byte {
	if len(ms) == 1 {
		return AppendV1(b, &ms[0])
	}
	b = append(b, '[')
	for j := range ms {
		if j > 0 {
			b = append(b, ',')
		}
		b = AppendV1(b, &ms[j])
	}
	return append(b, ']')
}

// appendReading writes the fields in the documented order, which is the
// order the fast v1 path tries first; whole numbers without a fraction or
// exponent, as firmware prints them.
func appendReading(b []byte, m *kettle.Measurement, n *kettle.FieldNames) []byte {
	b = append(b, `{"`...)
	b = append(b, n.Time...)
	b = append(b, `":"`...)
	b = m.Time.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, '"')
	num := func(name string, v float64) {
		b = append(b, `,"`...)
		b = append(b, name...)
		b = append(b, `":`...)
		if v == math.Trunc(v) && math.Abs(v) < 1e15 {
			b = strconv.AppendInt(b, int64(v), 10)
		} else {
			b = strconv.AppendFloat(b, v, 'g', -1, 64)
		}
	}
	num(n.Charge, m.ChargeMWh)
	num(n.Full, m.FullMWh)
	num(n.Rate, m.RateMW)
	num(n.Ambient, m.AmbientC)
	num(n.Water, m.WaterC)
	num(n.Level, m.LevelML)
	return append(b, '}')
}
