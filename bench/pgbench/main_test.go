package main

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/httpapi"
)

// The hand-made encoding of pgbench ingest decodes to exactly the rows the
// ceiling copies (ingestRow).
func TestBatchEncoder(t *testing.T) {
	base := time.Date(2026, 10, 13, 7, 0, 0, 0, time.UTC)
	const dev, k, batch = 1007, 3, 50
	b := newBatchEncoder(base, batch).encode(nil, dev, k)
	var ms []httpapi.MeasurementJSON // the v1 shape the server reads back
	if err := json.Unmarshal(b, &ms); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	if len(ms) != batch {
		t.Fatalf("%d readings decoded, %d encoded", len(ms), batch)
	}
	for j, m := range ms {
		w := ingestRow(base, ingestID(dev), dev, k, j, batch)
		if !m.Time.Equal(w.Time) || m.Charge != w.ChargeMWh || m.Full != w.FullMWh || m.Rate != w.RateMW ||
			m.Ambient != w.AmbientC || m.Water != w.WaterC || m.Level != w.LevelML {
			t.Errorf("reading %d: decoded %+v, want %+v", j, m, w)
		}
	}
	if w := ingestRow(base, ingestID(dev), dev, k, 1, batch).Time; !w.Equal(base.Add(151*time.Second + 7*time.Microsecond)) {
		t.Errorf("reading 1 at %v", w)
	}
}

// TestBatchEncoderMidnight: a request whose readings cross midnight (the
// encoder steps the clock in the text and formats a new day in full).
func TestBatchEncoderMidnight(t *testing.T) {
	base := time.Date(2026, 12, 31, 23, 52, 0, 0, time.UTC)
	const dev, k, batch = 3, 0, 500
	b := newBatchEncoder(base, batch).encode(nil, dev, k)
	var ms []httpapi.MeasurementJSON
	if err := json.Unmarshal(b, &ms); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	for j, m := range ms {
		if w := ingestTime(base, dev, k, j, batch); !m.Time.Equal(w) {
			t.Fatalf("reading %d at %v, want %v", j, m.Time, w)
		}
	}
}

func TestNextSecond(t *testing.T) {
	// every second of two days, the second of them a leap day's eve
	for tm := time.Date(2028, 2, 28, 0, 0, 0, 123000, time.UTC); tm.Before(time.Date(2028, 3, 1, 0, 0, 1, 0, time.UTC)); tm = tm.Add(time.Second) {
		var ts [27]byte
		appendTimeMicro(ts[:0], tm)
		was := ts
		ok := nextSecond(&ts)
		next := tm.Add(time.Second)
		if next.Day() != tm.Day() {
			if ok || ts != was {
				t.Fatalf("%s: stepped to %s over midnight", was[:], ts[:])
			}
			continue
		}
		if want := string(appendTimeMicro(nil, next)); !ok || string(ts[:]) != want {
			t.Fatalf("%s: stepped to %s (%v), want %s", was[:], ts[:], ok, want)
		}
	}
}

func TestAppendTimeMicro(t *testing.T) {
	for _, tm := range []time.Time{
		time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC),
		time.Date(1999, 12, 31, 23, 59, 59, 999999000, time.UTC),
		time.Date(2026, 10, 13, 7, 0, 0, 0, time.FixedZone("x", 3600)),
	} {
		got := string(appendTimeMicro(nil, tm))
		if want := tm.UTC().Format("2006-01-02T15:04:05.000000Z"); got != want {
			t.Errorf("%v: %s, want %s", tm, got, want)
		}
	}
}

// BenchmarkBatchEncoder: one request of 500 readings, as pgbench ingest
// sends it (go test -run '^$' -bench BatchEncoder ./bench/pgbench).
func BenchmarkBatchEncoder(b *testing.B) {
	e := newBatchEncoder(time.Date(2026, 10, 13, 7, 0, 0, 0, time.UTC), 500)
	var buf []byte
	for i := 0; b.Loop(); i++ {
		buf = e.encode(buf[:0], i%2000, i/2000)
	}
	b.SetBytes(int64(len(buf)))
}
