package sqlite_test

import (
	"context"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// TestExpireHalfway: while an expiry is under way (half the devices done,
// in transactions of ~150 readings), readers see the statistics of the rows
// stored at that moment: counts exactly, the by-hour moments to 1e-9
// relative (they are taken out with Moments.Without, rebuilt exactly only at
// the end); then the rest, and nothing before the bound is left.
func TestExpireHalfway(t *testing.T) {
	ctx := context.Background()
	s := open(t, filepath.Join(t.TempDir(), "kettle.db"))
	defer s.Close()
	rng := rand.New(rand.NewPCG(11, 12))
	start := time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC)
	may := time.Date(2024, 5, 1, 0, 0, 0, 0, time.UTC)
	devs := make([]kettle.DeviceID, 64)
	for i := range devs {
		devs[i] = uuid.New()
	}
	for b := range 60 {
		batch := make([]kettle.Measurement, 100)
		for i := range batch {
			batch[i] = kettle.Measurement{Device: devs[rng.IntN(len(devs))],
				Time:      start.Add(time.Duration(rng.Int64N(int64(92 * 24 * time.Hour)))).Truncate(time.Microsecond),
				ChargeMWh: 1, FullMWh: 2, AmbientC: -10 + 40*rng.Float64(), WaterC: 10 + 80*rng.Float64(), LevelML: 100}
		}
		if _, err := s.Write(ctx, batch, start.Add(time.Duration(b)*time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	// (What is still staged is taken by Expire's last transaction; a month
	// old, everything has long been merged.)
	if err := s.Merge(ctx); err != nil {
		t.Fatal(err)
	}
	removed, txs, err := s.ExpireShare(ctx, may, 0.5, 150)
	if err != nil || removed == 0 {
		t.Fatalf("ExpireShare: %d, %v", removed, err)
	}
	// Each transaction stops at the first device that takes it to 150 (a
	// device has ~60 readings before May here, surely fewer than 300).
	if txs < int(removed/(150+300)) || txs < 3 {
		t.Errorf("halfway: %d readings removed in %d transactions; want transactions of about 150", removed, txs)
	}
	check := func(stage string) (early int64) {
		t.Helper()
		// Recompute from the rows left.
		var water, amb [24]kettle.Moments
		var rows int64
		for _, d := range devs {
			h, err := s.History(ctx, kettle.HistoryQuery{Device: d})
			if err != nil {
				t.Fatal(err)
			}
			for _, x := range h {
				rows++
				if x.Time.Before(may) {
					early++
				}
				water[x.Time.Hour()].Add(x.WaterC)
				amb[x.Time.Hour()].Add(x.AmbientC)
			}
		}
		st, err := s.Statistics(ctx, kettle.StatsQuery{})
		if err != nil {
			t.Fatal(err)
		}
		ranged, err := s.Statistics(ctx, kettle.StatsQuery{From: start, To: may})
		if err != nil {
			t.Fatal(err)
		}
		if st.MeasurementCount != rows || ranged.RangeCount != early {
			t.Errorf("%s: %d measurements, %d before May; the rows say %d and %d", stage, st.MeasurementCount, ranged.RangeCount, rows, early)
		}
		near := func(got, want float64) bool { return math.Abs(got-want) <= 1e-9*math.Max(math.Abs(want), 1) }
		for h := range 24 {
			g := st.ByHour[h]
			if g.Water.N != water[h].N || !near(g.Water.Mean, water[h].Mean) || !near(g.Water.Stddev(), water[h].Stddev()) ||
				!near(g.Ambient.Mean, amb[h].Mean) || !near(g.Ambient.Stddev(), amb[h].Stddev()) {
				t.Errorf("%s, hour %d: water %+v ambient %+v; the rows say %+v, %+v", stage, h, g.Water, g.Ambient, water[h], amb[h])
			}
		}
		return early
	}
	if check("halfway") == 0 {
		t.Fatal("no row before May left halfway: the test needs the half not yet expired")
	}
	more, _, err := s.ExpireShare(ctx, may, 1, 150)
	if err != nil || more == 0 {
		t.Fatalf("ExpireShare of the rest: %d, %v", more, err)
	}
	if early := check("after"); early != 0 {
		t.Errorf("%d rows before May left after the expiry", early)
	}
}
