package wire_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

func TestAppend(t *testing.T) {
	m := kettle.Measurement{Time: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC), ChargeMWh: 10, FullMWh: 20, RateMW: -1.5, AmbientC: 21.25, WaterC: 90, LevelML: 500}
	got := string(wire.AppendV1(nil, &m))
	want := `{"time":"2026-01-02T03:04:05.000006Z","battery_charge_mwh":10,"battery_full_mwh":20,"battery_rate_mw":-1.5,"ambient_temp_c":21.25,"water_temp_c":90,"water_level_ml":500}`
	if got != want {
		t.Errorf("v1:\n got %s\nwant %s", got, want)
	}
	if got := string(wire.AppendV1Upload(nil, []kettle.Measurement{m, m})); got != "["+want+","+want+"]" {
		t.Errorf("v1 upload of 2: %s", got)
	}
	got = string(wire.AppendV0(nil, &m))
	if !strings.HasPrefix(got, `{"time":"2026-01-02T03:04:05.000006Z","charge_now":10,"charge_full":20,`) {
		t.Errorf("v0: %s", got)
	}
}

func BenchmarkAppendV1(b *testing.B) {
	m := kettle.Measurement{Time: time.Now(), ChargeMWh: 12345, FullMWh: 200000, RateMW: -138889, AmbientC: 21.37, WaterC: 93.12, LevelML: 1234}
	buf := make([]byte, 0, 512)
	b.ReportAllocs()
	for b.Loop() {
		buf = wire.AppendV1(buf[:0], &m)
	}
}

// TestCommandRoundTrip: what the server sends a kettle, the simulator's
// kettle reads back as the same actions, in both protocols.
func TestCommandRoundTrip(t *testing.T) {
	f := func(c kettle.Command) {
		t.Helper()
		v0, err := wire.ParseCommand(wire.AppendCommandV0(nil, c), "v0")
		if want := (kettle.Command{Charge: c.Charge, Fill: c.Fill, FlushMLPerS: c.FlushMLPerS}); err != nil || v0 != want {
			t.Errorf("v0 %+v: %+v %v", c, v0, err)
		}
		b, _ := json.Marshal(wire.NewCommandJSON(c, 1500*time.Millisecond))
		if v1, err := wire.ParseCommand(b, "v1"); err != nil || v1 != c {
			t.Errorf("v1 %+v: %+v %v", c, v1, err)
		}
	}
	f(kettle.Command{})
	f(kettle.Command{Charge: true, Fill: true, Reason: "battery 5%"})
	f(kettle.Command{FlushMLPerS: 12.5, Reason: "override"})
	if got := string(wire.AppendCommandV0(nil, kettle.Command{Charge: true, FlushMLPerS: 3})); got != `{"charge":"ChargeBattery","fill":"NoFillReservoir","flush":{"tag":"FlushReservoir","contents":3}}`+"\n" {
		t.Errorf("v0 body %s", got)
	}
	if got := wire.PollSeconds(1500 * time.Millisecond); got != 2 {
		t.Errorf("PollSeconds(1.5s) = %d, want 2", got)
	}
}
