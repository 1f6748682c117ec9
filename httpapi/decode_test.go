package httpapi_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
)

var (
	now    = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	dev    = uuid.MustParse("7f9a1c52-3b1e-4c4e-9a51-0d7f6a1b2c3d")
	v0Good = `{"id":3,"time":"2026-11-22T11:59:30.123456Z","charge_now":57,"charge_full":100,"charge_rate":-2.5,"ambient_temp":21.5,"water_temp":88.25,"water_level":750}`
	v1Good = `{"time":"2026-11-22T11:59:30.123456Z","battery_charge_mwh":57,"battery_full_mwh":100,"battery_rate_mw":-2.5,"ambient_temp_c":21.5,"water_temp_c":88.25,"water_level_ml":750}`
)

func TestDecodeV0(t *testing.T) {
	m, err := httpapi.DecodeV0([]byte(v0Good), dev, now)
	if err != nil {
		t.Fatal(err)
	}
	want := kettle.Measurement{Device: dev, Time: time.Date(2026, 11, 22, 11, 59, 30, 123456000, time.UTC), ChargeMWh: 57, FullMWh: 100, RateMW: -2.5, AmbientC: 21.5, WaterC: 88.25, LevelML: 750}
	if m != want {
		t.Errorf("got %+v, want %+v", m, want)
	}
	// Nanoseconds are truncated to the stores' microseconds; offsets become UTC.
	m, err = httpapi.DecodeV0([]byte(strings.Replace(v0Good, "11:59:30.123456Z", "12:59:30.1234569+01:00", 1)), dev, now)
	if err != nil || !m.Time.Equal(want.Time) || m.Time.Location() != time.UTC {
		t.Errorf("offset/nanosecond time: %v %v", m.Time, err)
	}
}

func TestDecodeV1Batch(t *testing.T) {
	ms, err := httpapi.DecodeV1([]byte(" \n["+v1Good+","+v1Good+"]"), dev, now)
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
		m, err := httpapi.DecodeV0(b, dev, now)
		checkDecodeError(t, err)
		if err == nil {
			if errs := m.Validate(now, &kettle.V0Names, "", nil); len(errs) > 0 {
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
		ms, err := httpapi.DecodeV1(b, dev, now)
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
		if _, err := httpapi.DecodeV0(body, dev, now); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeV1Batch500(b *testing.B) {
	body := []byte("[" + strings.TrimSuffix(strings.Repeat(v1Good+",", 500), ",") + "]")
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := httpapi.DecodeV1(body, dev, now); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*500)/b.Elapsed().Seconds(), "readings/s")
}
