// Package wiretest is the one table of wire cases: readings as kettles send
// them, good and bad, with what the decoders must make of each. wire's
// decode tests and fuzz seeds and the simulator's round trips all read it,
// so a case added here is checked everywhere at once.
package wiretest

import (
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// The clock, window and device every case is decoded with.
var (
	Now    = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	Win    = kettle.Window{Now: Now}
	Device = uuid.MustParse("7f9a1c52-3b1e-4c4e-9a51-0d7f6a1b2c3d")
)

// V0Good and V1Good are one well-formed reading of each protocol, as the
// firmware prints it; Good is the measurement both decode to.
const (
	V0Good = `{"id":3,"time":"2026-11-22T11:59:30.123456Z","charge_now":57,"charge_full":100,"charge_rate":-2.5,"ambient_temp":21.5,"water_temp":88.25,"water_level":750}`
	V1Good = `{"time":"2026-11-22T11:59:30.123456Z","battery_charge_mwh":57,"battery_full_mwh":100,"battery_rate_mw":-2.5,"ambient_temp_c":21.5,"water_temp_c":88.25,"water_level_ml":750}`
)

// Good is what V0Good and V1Good decode to.
var Good = kettle.Measurement{Device: Device, Time: time.Date(2026, 11, 22, 11, 59, 30, 123456000, time.UTC),
	ChargeMWh: 57, FullMWh: 100, RateMW: -2.5, AmbientC: 21.5, WaterC: 88.25, LevelML: 750}

// Case is one body and what decoding it with Win and Device must give.
type Case struct {
	API  string // "v0" or "v1"
	Body string
	// Want is the readings it decodes to; nil: it is refused (a 4xx
	// *kettle.Error), naming Field when that is set.
	Want  []kettle.Measurement
	Field string
	// Fast: v1's fast path takes it (the general path must agree);
	// false: the fast path leaves it to the general decoder.
	Fast bool
	Note string
}

func with(f func(*kettle.Measurement)) []kettle.Measurement {
	m := Good
	f(&m)
	return []kettle.Measurement{m}
}

func batch(body string, n int) string {
	return "[" + strings.TrimSuffix(strings.Repeat(body+",", n), ",") + "]"
}

func v1(old, new string) string { return strings.Replace(V1Good, old, new, 1) }

// Cases is the table.
var Cases = []Case{
	{API: "v0", Body: V0Good, Want: []kettle.Measurement{Good}, Note: "the firmware's body"},
	{API: "v0", Body: strings.Replace(V0Good, "11:59:30.123456Z", "12:59:30.1234569+01:00", 1), Want: []kettle.Measurement{Good}, Note: "offsets become UTC, nanoseconds are cut to µs"},
	{API: "v0", Body: `{}`, Field: "time"},
	{API: "v0", Body: `[]`, Field: "body"},
	{API: "v0", Body: `null`, Field: "time"},
	{API: "v0", Body: `{"time":1}`, Field: "time"},
	{API: "v0", Body: `{"charge_now":1e400}`, Field: "charge_now"},
	{API: "v0", Body: `{"time":"2026-11-22T11:59:30Z","charge_now":-1}`, Field: "charge_full"},
	{API: "v0", Body: "\xff"},
	{API: "v0", Body: `{"a":[[[[[[]]]]]]}`, Field: "time"},
	{API: "v0", Body: strings.Replace(V0Good, "57", "-57", 1), Field: "charge_now"},

	{API: "v1", Body: V1Good, Want: []kettle.Measurement{Good}, Fast: true},
	{API: "v1", Body: "[" + V1Good + "]", Want: []kettle.Measurement{Good}, Fast: true},
	{API: "v1", Body: " [ " + V1Good + " ,\n\t" + V1Good + " ] \r\n", Want: []kettle.Measurement{Good, Good}, Fast: true},
	{API: "v1", Body: v1("11:59:30.123456Z", "12:59:30.1234569+01:00"), Want: []kettle.Measurement{Good}, Fast: true, Note: "another offset: time.Parse's way"},
	{API: "v1", Body: v1("57", "-0.0e+0"), Want: with(func(m *kettle.Measurement) { m.ChargeMWh = 0 }), Fast: true},
	{API: "v1", Body: v1("57", "5.7E1"), Want: []kettle.Measurement{Good}, Fast: true},
	{API: "v1", Body: v1("57", "1e-400"), Want: with(func(m *kettle.Measurement) { m.ChargeMWh = 0 }), Fast: true},
	{API: "v1", Body: v1("57", "1.5e-3"), Want: with(func(m *kettle.Measurement) { m.ChargeMWh = 1.5e-3 }), Fast: true},
	{API: "v1", Body: v1("57", "4.9406564584124654e-324"), Want: with(func(m *kettle.Measurement) { m.ChargeMWh = 4.9406564584124654e-324 }), Fast: true},
	{API: "v1", Body: v1("57", "2.2250738585072011e-308"), Want: with(func(m *kettle.Measurement) { m.ChargeMWh = 2.2250738585072011e-308 }), Fast: true},
	{API: "v1", Body: v1(`"time"`, `"Time"`), Want: []kettle.Measurement{Good}, Note: "a case-insensitive match: the general path"},
	{API: "v1", Body: v1(`{`, `{"id":1,`), Want: []kettle.Measurement{Good}, Note: "an unknown key is ignored, by the general path"},
	{API: "v1", Body: v1(`2026-11-22T`, `2026-11-22t`), Field: "time", Note: "time.Parse's business"},
	{API: "v1", Body: v1(`Z"`, `\u005a"`), Want: []kettle.Measurement{Good}, Note: "an escape: the general path"},
	{API: "v1", Body: v1(`750`, `750,"water_level_ml":1`), Want: with(func(m *kettle.Measurement) { m.LevelML = 1 }), Note: "a duplicate key: the last one, as encoding/json"},
	{API: "v1", Body: `[]`, Field: "batch"},
	{API: "v1", Body: `[{}]`, Field: "[0].time"},
	{API: "v1", Body: `[1,2]`},
	{API: "v1", Body: `{"time":"x"}`, Field: "time"},
	{API: "v1", Body: `{"water_level_ml":"NaN"}`, Field: "water_level_ml"},
	{API: "v1", Body: `[` + V1Good + `,]`},
	{API: "v1", Body: v1(`,"water_level_ml":750`, ``), Field: "water_level_ml"},
	{API: "v1", Body: v1(`750`, `null`), Field: "water_level_ml"},
	{API: "v1", Body: v1(`57`, `1e400`), Field: "battery_charge_mwh"},
	{API: "v1", Body: v1(`57`, `057`)},
	{API: "v1", Body: v1(`57`, `+57`)},
	{API: "v1", Body: v1(`57`, `0x39`)},
	{API: "v1", Body: v1(`57`, `-57`), Field: "battery_charge_mwh"},
	{API: "v1", Body: V1Good + `x`},
	{API: "v1", Body: batch(V1Good, kettle.MaxBatch+1), Field: "batch"},
	{API: "v1", Body: v1("57", "123456789012345678901234567890"), Field: "battery_charge_mwh"},
}
