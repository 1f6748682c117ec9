package httpapi_test

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/wire"
)

// TestWriteJSONMatchesEncodingJSON: answers are written with goccy/go-json
// for speed; clients and the OpenAPI document expect what encoding/json
// writes, byte for byte (float forms, HTML-safe escaping, sorted map keys,
// RFC 3339 times, null for nil).
func TestWriteJSONMatchesEncodingJSON(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	b := func(v bool) *bool { return &v }
	tm := func(v time.Time) *time.Time { return &v }
	t0 := time.Date(2026, 11, 22, 11, 59, 30, 123456000, time.UTC)
	floats := []float64{0, math.Copysign(0, -1), 1, -2.5, 0.1 + 0.2, 1e20, 1e21, 1e-6, 1e-7, 123456789.123,
		math.MaxFloat64, math.SmallestNonzeroFloat64, 4186.000000001, 88.25, -273.15}
	rng := rand.New(rand.NewPCG(1, 2))
	for len(floats) < 2000 {
		if v := math.Float64frombits(rng.Uint64()); !math.IsNaN(v) && !math.IsInf(v, 0) {
			floats = append(floats, v)
		}
	}
	var ms []*httpapi.MeasurementJSON
	for i := 0; i+6 <= len(floats); i += 6 {
		ms = append(ms, &httpapi.MeasurementJSON{Time: t0.Add(time.Duration(i) * 1001 * time.Microsecond), Charge: floats[i], Full: floats[i+1],
			Rate: floats[i+2], Ambient: floats[i+3], Water: floats[i+4], Level: floats[i+5]})
	}
	values := map[string]any{
		"history": map[string]any{"measurements": ms, "next": t0.Format(time.RFC3339Nano)},
		"empty":   map[string]any{"measurements": []*httpapi.MeasurementJSON{}, "next": ""},
		"nil":     map[string]any{"measurements": []*httpapi.MeasurementJSON(nil), "latest": (*httpapi.MeasurementJSON)(nil)},
		"device": httpapi.DeviceJSON{RegisteredAt: t0, LastSeen: tm(t0.Add(time.Second)), Latest: ms[0], CapacityML: 950, Measurements: 1 << 40,
			Command:  &wire.CommandJSON{Charge: true, FlushMLPerS: 10, Reason: "battery 5% < 25%: charge & \"fill\"", PollAfterS: 30},
			Override: &httpapi.OverrideJSON{Charge: b(false), FlushMLPerS: f(2.5), ExpiresAt: tm(t0.Add(time.Hour)), SetAt: tm(t0), Active: true}},
		"strings": map[string]any{"z": "<script>&</script>", "a": "é\u2028\u2029\x7f\x01\t\"\\", "m": "\xff\xfe invalid", "": []any{1, "2", nil, true, 3.5}},
		"ints":    map[string]any{"big": int64(math.MaxInt64), "neg": math.MinInt64, "u": uint64(math.MaxUint64)},
	}
	for name, v := range values {
		want, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		httpapi.WriteJSON(rec, 200, v)
		if got := rec.Body.String(); got != string(want)+"\n" {
			i := 0
			for i < len(got) && i < len(want) && got[i] == want[i] {
				i++
			}
			t.Errorf("%s: differs from encoding/json at byte %d:\n got …%.80s\nwant …%.80s", name, i, got[i:], want[i:])
		}
		if rec.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s: Content-Type %q", name, rec.Header().Get("Content-Type"))
		}
	}
}
