package httpapi_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
)

var (
	now    = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	win    = kettle.Window{Now: now}
	dev    = uuid.MustParse("7f9a1c52-3b1e-4c4e-9a51-0d7f6a1b2c3d")
	v0Good = `{"id":3,"time":"2026-11-22T11:59:30.123456Z","charge_now":57,"charge_full":100,"charge_rate":-2.5,"ambient_temp":21.5,"water_temp":88.25,"water_level":750}`
	v1Good = `{"time":"2026-11-22T11:59:30.123456Z","battery_charge_mwh":57,"battery_full_mwh":100,"battery_rate_mw":-2.5,"ambient_temp_c":21.5,"water_temp_c":88.25,"water_level_ml":750}`
)

func TestDecodeV0(t *testing.T) {
	m, err := httpapi.DecodeV0([]byte(v0Good), dev, win)
	if err != nil {
		t.Fatal(err)
	}
	want := kettle.Measurement{Device: dev, Time: time.Date(2026, 11, 22, 11, 59, 30, 123456000, time.UTC), ChargeMWh: 57, FullMWh: 100, RateMW: -2.5, AmbientC: 21.5, WaterC: 88.25, LevelML: 750}
	if m != want {
		t.Errorf("got %+v, want %+v", m, want)
	}
	// Nanoseconds are truncated to the stores' microseconds; offsets become UTC.
	m, err = httpapi.DecodeV0([]byte(strings.Replace(v0Good, "11:59:30.123456Z", "12:59:30.1234569+01:00", 1)), dev, win)
	if err != nil || !m.Time.Equal(want.Time) || m.Time.Location() != time.UTC {
		t.Errorf("offset/nanosecond time: %v %v", m.Time, err)
	}
}

func TestDecodeV1Batch(t *testing.T) {
	ms, err := httpapi.DecodeV1([]byte(" \n["+v1Good+","+v1Good+"]"), dev, win)
	if err != nil || len(ms) != 2 {
		t.Fatalf("%v %v", ms, err)
	}
}

// checkDecodeError: a decoder may only fail with a 4xx *kettle.Error.
func checkDecodeError(t *testing.T, err error) {
	if err == nil {
		return
	}
	var e *kettle.Error
	if !errors.As(err, &e) {
		t.Fatalf("non-domain error %T: %v", err, err)
	}
	if s := httpapi.Status(e.Code); s < 400 || s > 499 {
		t.Fatalf("status %d for %v", s, err)
	}
}

func FuzzDecodeV0(f *testing.F) {
	for _, s := range []string{v0Good, `{}`, `[]`, `null`, `{"time":1}`, `{"charge_now":1e400}`, `{"time":"2026-11-22T11:59:30Z","charge_now":-1}`, "\xff", `{"a":[[[[[[]]]]]]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := httpapi.DecodeV0(b, dev, win)
		checkDecodeError(t, err)
		if err == nil {
			if errs := m.Validate(win, &kettle.V0Names, "", nil); len(errs) > 0 {
				t.Fatalf("accepted an invalid reading: %v", errs)
			}
		}
	})
}

func FuzzDecodeV1(f *testing.F) {
	for _, s := range []string{v1Good, "[" + v1Good + "]", `[]`, `[{}]`, `{"time":"x"}`, `[1,2]`, `{"water_level_ml":"NaN"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := httpapi.DecodeV1(b, dev, win)
		checkDecodeError(t, err)
		if err == nil && (len(ms) == 0 || len(ms) > kettle.MaxBatch) {
			t.Fatalf("accepted a batch of %d", len(ms))
		}
	})
}

func BenchmarkDecodeV0(b *testing.B) {
	body := []byte(v0Good)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := httpapi.DecodeV0(body, dev, win); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeV1Batch500(b *testing.B) {
	body := []byte("[" + strings.TrimSuffix(strings.Repeat(v1Good+",", 500), ",") + "]")
	for _, c := range []struct {
		name   string
		decode func([]byte, kettle.DeviceID, kettle.Window) ([]kettle.Measurement, error)
	}{{"DecodeV1", httpapi.DecodeV1}, {"general", httpapi.DecodeV1General}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := c.decode(body, dev, win); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*500)/b.Elapsed().Seconds(), "readings/s")
		})
	}
}

// TestDecodeV1Fast: the fast path takes the usual bodies, and leaves to the
// general decoder, which names the error or decodes the same readings,
// everything unusual.
func TestDecodeV1Fast(t *testing.T) {
	f := func(body string, wantFast bool) {
		t.Helper()
		ms, ok := httpapi.FastV1([]byte(body), dev, win)
		if ok != wantFast {
			t.Errorf("fast path took %q: %v, want %v", body, ok, wantFast)
		}
		want, err := httpapi.DecodeV1General([]byte(body), dev, win)
		if ok && (err != nil || !slices.Equal(ms, want)) {
			t.Errorf("%q: fast %v, general %v %v", body, ms, want, err)
		}
	}
	f(v1Good, true)
	f(" [ "+v1Good+" ,\n\t"+v1Good+" ] \r\n", true)
	f(strings.Replace(v1Good, "11:59:30.123456Z", "12:59:30.1234569+01:00", 1), true)
	f(strings.Replace(v1Good, "57", "-0.0e+0", 1), true)
	f(strings.Replace(v1Good, "57", "5.7E1", 1), true)
	f(strings.Replace(v1Good, "57", "1e-400", 1), true)
	f(`[]`, false)
	f(`[`+v1Good+`,]`, false)
	f(strings.Replace(v1Good, `"time"`, `"Time"`, 1), false)                                 // case-insensitive match: general path
	f(strings.Replace(v1Good, `{`, `{"id":1,`, 1), false)                                    // unknown key
	f(strings.Replace(v1Good, `,"water_level_ml":750`, ``, 1), false)                        // missing
	f(strings.Replace(v1Good, `750`, `750,"water_level_ml":1`, 1), false)                    // duplicate
	f(strings.Replace(v1Good, `750`, `null`, 1), false)                                      // null
	f(strings.Replace(v1Good, `57`, `1e400`, 1), false)                                      // out of range
	f(strings.Replace(v1Good, `57`, `057`, 1), false)                                        // not JSON
	f(strings.Replace(v1Good, `57`, `+57`, 1), false)                                        // not JSON
	f(strings.Replace(v1Good, `57`, `0x39`, 1), false)                                       // not JSON
	f(strings.Replace(v1Good, `57`, `-57`, 1), false)                                        // invalid reading
	f(strings.Replace(v1Good, `Z"`, `\u005a"`, 1), false)                                    // escape
	f(strings.Replace(v1Good, `2026-11-22T`, `2026-11-22t`, 1), false)                       // time.Parse's business
	f(v1Good+`x`, false)                                                                     // trailing data
	f("["+strings.TrimSuffix(strings.Repeat(v1Good+",", kettle.MaxBatch+1), ",")+"]", false) // too many
}

// FuzzDecodeV1Fast: whatever the fast path accepts, the general decoder
// accepts as the same readings.
func FuzzDecodeV1Fast(f *testing.F) {
	for _, s := range []string{v1Good, "[" + v1Good + "," + v1Good + "]", `[]`, `{"time":"x"}`,
		strings.Replace(v1Good, "57", "1.5e-3", 1), strings.Replace(v1Good, "57", "123456789012345678901234567890", 1),
		strings.Replace(v1Good, "57", "4.9406564584124654e-324", 1), strings.Replace(v1Good, "57", "2.2250738585072011e-308", 1)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, ok := httpapi.FastV1(b, dev, win)
		if !ok {
			return
		}
		want, err := httpapi.DecodeV1General(b, dev, win)
		if err != nil {
			t.Fatalf("fast path accepted %q, general decoder: %v", b, err)
		}
		if !slices.Equal(ms, want) {
			t.Fatalf("%q: fast path %+v, general %+v", b, ms, want)
		}
	})
}

// FuzzParseUTC: whatever the fast time parser accepts, time.Parse returns
// as the identical time.Time; and it accepts what kettles send.
func FuzzParseUTC(f *testing.F) {
	accepted := 0
	for _, s := range []string{"2026-10-13T07:00:05Z", "2026-10-13T07:00:05.000123Z", "2024-02-29T23:59:59.999999999Z",
		"2023-02-29T00:00:00Z", "2026-04-31T00:00:00Z", "2026-13-01T00:00:00Z", "2026-10-13T24:00:00Z", "2026-10-13T07:60:00Z",
		"2026-10-13T07:00:60Z", "2026-10-13T07:00:05.Z", "2026-10-13T07:00:05.1234567890Z", "2026-10-13T07:00:05+02:00",
		"2026-10-13t07:00:05z", "0000-01-01T00:00:00Z", "2000-02-29T12:00:00.5Z", "1900-02-29T12:00:00Z", "2026-1x-13T07:00:05Z"} {
		f.Add(s)
		if _, ok := httpapi.ParseUTC(s); ok {
			accepted++
		}
	}
	if accepted != 5 {
		f.Errorf("the fast parser took %d of the seeds, want 5 (the valid Z times)", accepted)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, ok := httpapi.ParseUTC(s)
		if !ok {
			return
		}
		want, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatalf("%q: fast parser %v, time.Parse: %v", s, got, err)
		}
		if got != want {
			t.Fatalf("%q: fast parser %#v, time.Parse %#v", s, got, want)
		}
	})
}
