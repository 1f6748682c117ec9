package wire_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
	"github.com/kettlefleet/kettlefleet/wire/wiretest"
)

var (
	dev = wiretest.Device
	win = wiretest.Win
)

// decode is a case's decoder.
func decode(c wiretest.Case) ([]kettle.Measurement, error) {
	if c.API == "v0" {
		m, err := wire.DecodeV0([]byte(c.Body), dev, win)
		if err != nil {
			return nil, err
		}
		return []kettle.Measurement{m}, nil
	}
	return wire.DecodeV1([]byte(c.Body), dev, win)
}

// TestCases: every case of the table decodes to its readings, or is refused
// naming its field.
func TestCases(t *testing.T) {
	for i, c := range wiretest.Cases {
		ms, err := decode(c)
		checkDecodeError(t, err)
		switch {
		case c.Want != nil && err != nil:
			t.Errorf("case %d (%s %.60q): %v", i, c.API, c.Body, err)
		case c.Want != nil && !slices.Equal(ms, c.Want):
			t.Errorf("case %d (%s %.60q):\n got %+v\nwant %+v", i, c.API, c.Body, ms, c.Want)
		case c.Want == nil && err == nil:
			t.Errorf("case %d (%s %.60q): accepted as %+v", i, c.API, c.Body, ms)
		case c.Want == nil && c.Field != "" && !namesField(err, c.Field):
			t.Errorf("case %d (%s %.60q): %v does not name %q", i, c.API, c.Body, err, c.Field)
		}
	}
}

func namesField(err error, field string) bool {
	var e *kettle.Error
	return errors.As(err, &e) && slices.ContainsFunc(e.Fields, func(f kettle.FieldError) bool { return f.Field == field })
}

// seed adds the table's bodies of api to a fuzz target's corpus.
func seed(f *testing.F, api string) {
	for _, c := range wiretest.Cases {
		if c.API == api {
			f.Add([]byte(c.Body))
		}
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
	if e.Code != kettle.EInvalid {
		t.Fatalf("code %s for %v, want %s (a 400)", e.Code, err, kettle.EInvalid)
	}
}

func FuzzDecodeV0(f *testing.F) {
	seed(f, "v0")
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := wire.DecodeV0(b, dev, win)
		checkDecodeError(t, err)
		if err == nil {
			if errs := m.Validate(win, &kettle.V0Names, "", nil); len(errs) > 0 {
				t.Fatalf("accepted an invalid reading: %v", errs)
			}
		}
	})
}

func FuzzDecodeV1(f *testing.F) {
	seed(f, "v1")
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := wire.DecodeV1(b, dev, win)
		checkDecodeError(t, err)
		if err == nil && (len(ms) == 0 || len(ms) > kettle.MaxBatch) {
			t.Fatalf("accepted a batch of %d", len(ms))
		}
	})
}

func BenchmarkDecodeV0(b *testing.B) {
	body := []byte(wiretest.V0Good)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := wire.DecodeV0(body, dev, win); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeV1Batch500(b *testing.B) {
	body := []byte("[" + strings.TrimSuffix(strings.Repeat(wiretest.V1Good+",", 500), ",") + "]")
	for _, c := range []struct {
		name   string
		decode func([]byte, kettle.DeviceID, kettle.Window) ([]kettle.Measurement, error)
	}{{"DecodeV1", wire.DecodeV1}, {"general", wire.DecodeV1General}} {
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
	for i, c := range wiretest.Cases {
		if c.API != "v1" {
			continue
		}
		ms, ok := wire.FastV1([]byte(c.Body), dev, win)
		if ok != c.Fast {
			t.Errorf("case %d: fast path took %.60q: %v, want %v", i, c.Body, ok, c.Fast)
		}
		want, err := wire.DecodeV1General([]byte(c.Body), dev, win)
		if ok && (err != nil || !slices.Equal(ms, want)) {
			t.Errorf("case %d %.60q: fast %v, general %v %v", i, c.Body, ms, want, err)
		}
	}
}

// FuzzDecodeV1Fast: whatever the fast path accepts, the general decoder
// accepts as the same readings.
func FuzzDecodeV1Fast(f *testing.F) {
	seed(f, "v1")
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, ok := wire.FastV1(b, dev, win)
		if !ok {
			return
		}
		want, err := wire.DecodeV1General(b, dev, win)
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
		if _, ok := wire.ParseUTC(s); ok {
			accepted++
		}
	}
	if accepted != 5 {
		f.Errorf("the fast parser took %d of the seeds, want 5 (the valid Z times)", accepted)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, ok := wire.ParseUTC(s)
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
