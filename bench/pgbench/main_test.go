package main

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
)

// The hand-made encoding of pgbench ingest says what encoding/json said.
func TestAppendReadings(t *testing.T) {
	base := time.Date(2026, 10, 13, 7, 0, 0, 0, time.UTC)
	var in []kettle.Measurement
	for j := range 50 {
		in = append(in, ingestRow(base, ingestID(7), 7, 3, j, 50))
	}
	var ms []httpapi.MeasurementJSON // the v1 shape the server reads back
	if err := json.Unmarshal(appendReadings(nil, in), &ms); err != nil {
		t.Fatal(err)
	}
	if len(ms) != len(in) {
		t.Fatalf("%d readings decoded, %d encoded", len(ms), len(in))
	}
	for i, m := range ms {
		w := in[i]
		if !m.Time.Equal(w.Time) || m.Charge != w.ChargeMWh || m.Full != w.FullMWh || m.Rate != w.RateMW ||
			m.Ambient != w.AmbientC || m.Water != w.WaterC || m.Level != w.LevelML {
			t.Errorf("reading %d: decoded %+v, encoded %+v", i, m, w)
		}
	}
}
