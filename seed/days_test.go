package seed_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/seed"
)

// TestDays: Fleet.Days hands each day's loader exactly the readings of
// that day, every reading once, the same readings as the groups' Chunks;
// several days are loaded at once; a loader's error stops the run and is
// returned.
func TestDays(t *testing.T) {
	f := seed.Fleet{Seed: 3, Devices: 40, Interval: 7 * time.Minute,
		Start: time.Date(2026, 3, 1, 17, 0, 0, 0, time.UTC), End: time.Date(2026, 3, 6, 5, 0, 0, 0, time.UTC)}
	want := map[kettle.DeviceID][]time.Time{}
	c := f.Chunks(f.Groups(1)[0])
	var wantN int
	for {
		rows, ok := c.Next(nil, 1000)
		if !ok {
			break
		}
		for _, m := range rows {
			want[m.Device] = append(want[m.Device], m.Time)
			wantN++
		}
	}

	var mu sync.Mutex
	got := map[kettle.DeviceID][]time.Time{}
	var days []time.Time
	var gotN, inFlight, maxInFlight int
	err := f.Days(context.Background(), 3, 500, func(ctx context.Context, day time.Time, feed *seed.DayFeed) error {
		mu.Lock()
		days = append(days, day)
		inFlight++
		maxInFlight = max(maxInFlight, inFlight)
		mu.Unlock()
		defer func() { mu.Lock(); inFlight--; mu.Unlock() }()
		for rows, err := range feed.All() {
			if err != nil {
				return err
			}
			if len(rows) > 500 {
				t.Errorf("day %s: a chunk of %d rows, want ≤ 500", day, len(rows))
			}
			time.Sleep(time.Millisecond) // let the others overlap
			mu.Lock()
			for i, m := range rows {
				if m.Time.Before(day) || !m.Time.Before(day.AddDate(0, 0, 1)) {
					t.Errorf("day %s: reading at %s", day.Format(time.DateOnly), m.Time)
				}
				if i > 0 && m.Device == rows[i-1].Device && !m.Time.After(rows[i-1].Time) {
					t.Errorf("day %s: device %s not in increasing time", day.Format(time.DateOnly), m.Device)
				}
				got[m.Device] = append(got[m.Device], m.Time)
				gotN++
			}
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Days hands the days out in date order, but the loads run at once: a
	// load handed a later day may reach its first line before one handed
	// an earlier day, so the calls are compared as a set.
	slices.SortFunc(days, time.Time.Compare)
	for i, d := range days {
		if want := time.Date(2026, 3, 1+i, 0, 0, 0, 0, time.UTC); len(days) != 6 || !d.Equal(want) {
			t.Errorf("days loaded: %v; want each of the 6 days from 2026-03-01 once", days)
			break
		}
	}
	if len(days) != 6 {
		t.Errorf("%d days loaded (%v), want the 6 from 2026-03-01", len(days), days)
	}
	if gotN != wantN || len(got) != len(want) {
		t.Fatalf("%d readings of %d devices, want %d of %d", gotN, len(got), wantN, len(want))
	}
	for id, ts := range want {
		g := got[id]
		slices.SortFunc(g, time.Time.Compare)
		for i := range ts {
			if i >= len(g) || !g[i].Equal(ts[i]) {
				t.Fatalf("device %s: readings differ from Chunks' at %d", id, i)
			}
		}
	}
	if maxInFlight < 2 {
		t.Errorf("at most %d days loaded at once, want several", maxInFlight)
	}

	boom := errors.New("boom")
	err = f.Days(context.Background(), 2, 100, func(ctx context.Context, day time.Time, feed *seed.DayFeed) error {
		if day.Day() == 3 {
			return boom
		}
		for {
			if _, ok, err := feed.Next(); err != nil || !ok {
				return err
			}
		}
	})
	if !errors.Is(err, boom) {
		t.Errorf("Days with a failing loader: %v, want boom", err)
	}
}
