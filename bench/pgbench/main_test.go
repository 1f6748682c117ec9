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
