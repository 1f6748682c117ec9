package seed_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/seed"
)

var end = time.Date(2024, 6, 10, 0, 0, 0, 0, time.UTC)

func fleet(devices, days int) seed.Fleet {
	return seed.Fleet{Seed: 42, Devices: devices, Start: end.Add(-time.Duration(days) * 24 * time.Hour), End: end, Interval: 30 * time.Second}
}

func all(f seed.Fleet, i int) []kettle.Measurement {
	k := f.Kettle(i)
	var out []kettle.Measurement
	var m kettle.Measurement
	for k.Next(f.End, &m) {
		out = append(out, m)
	}
	return out
}

func TestDeterministic(t *testing.T) {
	f := fleet(5, 2)
	for i := range f.Devices {
		a, b := all(f, i), all(f, i)
		if len(a) != len(b) || len(a) == 0 {
			t.Fatalf("device %d: %d then %d readings", i, len(a), len(b))
		}
		for j := range a {
			if a[j] != b[j] {
				t.Fatalf("device %d reading %d differs: %+v vs %+v", i, j, a[j], b[j])
			}
		}
	}
	if seed.DeviceID(42, 1) != seed.DeviceID(42, 1) || seed.DeviceID(42, 1) == seed.DeviceID(43, 1) || seed.DeviceID(42, 1) == seed.DeviceID(42, 2) {
		t.Error("device ids must depend on seed and index, and only on them")
	}
}

// TestValidAndOnGrid checks every reading passes the API's validation, lies
// in [Start, End), on the device's grid, in increasing time; and that a
// chunked generation (Next with a bound) gives the same readings.
func TestValidAndOnGrid(t *testing.T) {
	f := fleet(50, 3)
	for i := range f.Devices {
		rows := all(f, i)
		for j, m := range rows {
			if errs := m.Validate(kettle.Window{Now: end}, &kettle.V1Names, "", nil); len(errs) > 0 {
				t.Fatalf("device %d reading %d invalid: %v (%+v)", i, j, errs, m)
			}
			if m.Time.Before(f.Start) || !m.Time.Before(f.End) || m.Time.Nanosecond()%1000 != 0 {
				t.Fatalf("device %d reading %d at %v outside [%v, %v) or below µs", i, j, m.Time, f.Start, f.End)
			}
			if j > 0 && m.Time.Sub(rows[j-1].Time)%f.Interval != 0 || j > 0 && !m.Time.After(rows[j-1].Time) {
				t.Fatalf("device %d reading %d at %v off the grid after %v", i, j, m.Time, rows[j-1].Time)
			}
			if m.ChargeMWh < 0 || m.ChargeMWh > m.FullMWh {
				t.Fatalf("device %d: charge %v outside [0, %v]", i, m.ChargeMWh, m.FullMWh)
			}
		}
		// chunked by day
		k := f.Kettle(i)
		var m kettle.Measurement
		n := 0
		for day := f.Start; day.Before(f.End); day = day.Add(24 * time.Hour) {
			for k.Next(day.Add(24*time.Hour), &m) {
				if m != rows[n] {
					t.Fatalf("device %d: chunked reading %d differs", i, n)
				}
				n++
			}
		}
		if n != len(rows) {
			t.Fatalf("device %d: chunked %d readings, whole %d", i, n, len(rows))
		}
	}
}

// TestRerunOverlaps: a later end keeps the reading times of the overlap, so
// a store skips them as duplicates.
func TestRerunOverlaps(t *testing.T) {
	a := fleet(1, 2)
	b := a
	b.Start, b.End = a.Start.Add(7*time.Hour), a.End.Add(7*time.Hour)
	ta := map[time.Time]bool{}
	for _, m := range all(a, 0) {
		ta[m.Time] = true
	}
	shared := 0
	for _, m := range all(b, 0) {
		if ta[m.Time] {
			shared++
		}
	}
	if want := int((a.End.Sub(b.Start)) / a.Interval); shared < want-1 {
		t.Errorf("runs share %d reading times, want about %d", shared, want)
	}
}

// TestPhysics checks the fleet looks like kettles: ambient cycles over the
// day, water is hot around tea hours, the reservoir is refilled, batteries
// charge and discharge, and a few devices go offline.
func TestPhysics(t *testing.T) {
	f := fleet(200, 4)
	var hot, hotTea, n, nTea int
	var charging, discharging, offline, refills int
	for i := range f.Devices {
		rows := all(f, i)
		if int64(len(rows)) < f.RowsPerDevice()-1 {
			offline++
		}
		minA, maxA := 1e9, -1e9
		for j, m := range rows {
			minA, maxA = min(minA, m.AmbientC), max(maxA, m.AmbientC)
			tea := false
			for _, h := range kettle.TeaHours {
				if m.Time.Hour() == h && m.Time.Minute() < 20 {
					tea = true
				}
			}
			if m.WaterC >= 80 {
				hot++
				if tea {
					hotTea++
				}
			}
			n++
			if tea {
				nTea++
			}
			if m.RateMW > 0 {
				charging++
			} else {
				discharging++
			}
			if j > 0 && m.LevelML > rows[j-1].LevelML+1 && rows[j-1].LevelML < 0.3*1700 {
				refills++
			}
		}
		if maxA-minA < 1 {
			t.Errorf("device %d: ambient range %.1f…%.1f, want a daily cycle", i, minA, maxA)
		}
	}
	if r := float64(hotTea) / float64(nTea) / (float64(hot) / float64(n)); r < 3 {
		t.Errorf("hot water is %.1f× as likely at tea time as overall, want ≥ 3×", r)
	}
	if charging == 0 || discharging == 0 || refills == 0 {
		t.Errorf("charging %d, discharging %d, refills %d: want all > 0", charging, discharging, refills)
	}
	if offline == 0 || offline > f.Devices/10 {
		t.Errorf("%d of %d devices were offline for a while, want a few", offline, f.Devices)
	}
}

func BenchmarkNext(b *testing.B) {
	f := fleet(1, 3650)
	k := f.Kettle(0)
	var m kettle.Measurement
	b.ReportAllocs()
	for b.Loop() {
		if !k.Next(f.End, &m) {
			k = f.Kettle(0)
		}
	}
}

// TestChunks: the groups' chunks hold every reading of the fleet once, as
// the device's own generation does; a chunk has at most maxRows readings,
// grouped by device in increasing time with devices in increasing id order;
// the readings of each day arrive, over a group's chunks, in key order (so
// each day's partition is appended to); a chunk spans one day when a day of
// the group's readings fills one (dense histories: one partition, COPYed
// straight into it), and several otherwise, but never more than the window.
func TestChunks(t *testing.T) {
	f := seed.Fleet{Seed: 7, Devices: 23, Start: time.Date(2024, 5, 30, 13, 0, 0, 0, time.UTC), End: time.Date(2024, 6, 2, 0, 0, 0, 0, time.UTC), Interval: 10 * time.Minute}
	f2 := func(groups, maxRows int) {
		t.Helper()
		want := map[kettle.DeviceID][]kettle.Measurement{}
		for i := range f.Devices {
			want[seed.DeviceID(f.Seed, i)] = all(f, i)
		}
		got := map[kettle.DeviceID][]kettle.Measurement{}
		gs := f.Groups(groups)
		if n := min(groups, f.Devices); len(gs) != n {
			t.Fatalf("Groups(%d): %d groups, want %d", groups, len(gs), n)
		}
		var buf []kettle.Measurement
		for _, g := range gs {
			c := f.Chunks(g)
			window := c.WindowDays(maxRows)
			perDay := len(g) * int(24*time.Hour/f.Interval)
			if perDay >= maxRows && window != 1 || perDay < maxRows && (window*perDay > maxRows || (window+1)*perDay <= maxRows) {
				t.Fatalf("%d kettles at %s (%d readings a day), chunks of %d: a window of %d days", len(g), f.Interval, perDay, maxRows, window)
			}
			last := map[time.Time]kettle.Measurement{} // per day, the last reading of its chunks so far
			for {
				rows, ok := c.Next(buf, maxRows)
				if !ok {
					break
				}
				buf = rows
				if len(rows) == 0 || len(rows) > maxRows {
					t.Fatalf("chunk of %d rows, want 1…%d", len(rows), maxRows)
				}
				lo, hi := rows[0].Time, rows[0].Time
				for _, m := range rows {
					if m.Time.Before(lo) {
						lo = m.Time
					}
					if m.Time.After(hi) {
						hi = m.Time
					}
				}
				if span := int(hi.Truncate(24*time.Hour).Sub(lo.Truncate(24*time.Hour))/(24*time.Hour)) + 1; span > window {
					t.Fatalf("chunk spans %s to %s, over its window of %d days", lo.Format(time.DateOnly), hi.Format(time.DateOnly), window)
				}
				for i := range rows {
					m := rows[i]
					day := m.Time.Truncate(24 * time.Hour)
					if i > 0 {
						p := rows[i-1]
						if c := bytes.Compare(p.Device[:], m.Device[:]); c > 0 || c == 0 && !m.Time.After(p.Time) {
							t.Fatalf("row %s %s after %s %s in a chunk: not grouped by device in key order", m.Device, m.Time, p.Device, p.Time)
						}
					}
					if p, ok := last[day]; ok {
						if c := bytes.Compare(p.Device[:], m.Device[:]); c > 0 || c == 0 && !m.Time.After(p.Time) {
							t.Fatalf("day %s: row %s %s after %s %s: not in key order", day.Format(time.DateOnly), m.Device, m.Time, p.Device, p.Time)
						}
					}
					last[day] = m
					got[m.Device] = append(got[m.Device], m)
				}
			}
		}
		for id, w := range want {
			g := got[id]
			slices.SortFunc(g, func(a, b kettle.Measurement) int { return a.Time.Compare(b.Time) })
			if !slices.Equal(g, w) {
				t.Fatalf("groups %d, chunks of %d: device %s has %d readings, want %d (or they differ)", groups, maxRows, id, len(g), len(w))
			}
		}
	}
	f2(1, 1_000_000)
	f2(3, 100)
	f2(4, 1)
	f2(100, 77)
	f2(2, 5000) // windows of two days
}

// pinnedReadings is the SHA-256 of fleet(5, 2)'s readings (fingerprint):
// the generator's output is a function of the seed alone, the same in every
// process and on every run. Changing the generator on purpose changes it:
// set the new value printed by the failure.
const pinnedReadings = "925fdb89a38b92ee91670d29bfcabe7954c93379502bb15da8a0a1567209b874"

// fingerprint hashes every reading of f, in order, to the bit.
func fingerprint(f seed.Fleet) (string, int) {
	h := sha256.New()
	n := 0
	var buf []byte
	for i := range f.Devices {
		for _, m := range all(f, i) {
			buf = append(buf[:0], m.Device[:]...)
			buf = binary.BigEndian.AppendUint64(buf, uint64(m.Time.UnixMicro()))
			for _, v := range []float64{m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML} {
				buf = binary.BigEndian.AppendUint64(buf, math.Float64bits(v))
			}
			h.Write(buf)
			n++
		}
	}
	return hex.EncodeToString(h.Sum(nil)), n
}

// TestDeterministicAcrossProcesses: the readings of seed 42 match a value
// pinned in this file, so anything that varies between processes (a map's
// order, a random salt at start, the clock) fails here, not only a change
// within one run as TestDeterministic would see. Device ids are pinned too.
// The value is the same on arm64 (fmath.go), where it runs as
//
//	GOARCH=arm64 CGO_ENABLED=0 go test -c -o /tmp/seed.test ./seed/
//	cd seed && qemu-aarch64-static /tmp/seed.test -test.run Deterministic
//
// (apt-get install qemu-user-static).
func TestDeterministicAcrossProcesses(t *testing.T) {
	got, n := fingerprint(fleet(5, 2))
	if got != pinnedReadings {
		t.Errorf("seed 42, 5 kettles, 2 days: %d readings hash to %s, pinned %s (set the new value if the generator changed on purpose)", n, got, pinnedReadings)
	}
	if id := seed.DeviceID(42, 1).String(); id != "3885156d-32a9-57b1-a687-0dda1deeea22" {
		t.Errorf("DeviceID(42, 1) = %s, pinned 3885156d-32a9-57b1-a687-0dda1deeea22", id)
	}
}
