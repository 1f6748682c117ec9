package fleet

import (
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// TestCacheKeepsReadingsExactly: a reading put into the cache comes back
// equal field for field (the time at microsecond precision, in UTC, as
// normalised readings are), across chunk boundaries.
func TestCacheKeepsReadingsExactly(t *testing.T) {
	c := newCache()
	base := time.Date(2026, 11, 25, 9, 30, 0, 123456000, time.UTC)
	ids := make([]kettle.DeviceID, 3*cacheChunk+5)
	for i := range ids {
		ids[i] = uuid.New()
		m := kettle.Measurement{Device: ids[i], Time: base.Add(time.Duration(i) * time.Microsecond),
			ChargeMWh: float64(i) + 0.25, FullMWh: 1e5, RateMW: -float64(i), AmbientC: 19.5, WaterC: 97.125, LevelML: float64(i % 1700)}
		m.Normalize()
		d := c.add(ids[i])
		if !d.newer(&m) {
			t.Fatalf("device %d: a first reading is not newer than nothing", i)
		}
		d.setLatest(&m)
		if got := d.latest.measurement(ids[i]); got != m {
			t.Fatalf("device %d: cached %+v, put %+v", i, got, m)
		}
		old := m
		old.Time = old.Time.Add(-time.Microsecond)
		if d.newer(&old) || d.newer(&m) {
			t.Fatalf("device %d: an older or equal reading counts as newer", i)
		}
	}
	if c.len() != len(ids) || len(c.chunks) != 4 {
		t.Fatalf("%d devices in %d chunks, want %d in 4", c.len(), len(c.chunks), len(ids))
	}
	for i, id := range ids {
		if got := c.get(id).latest.measurement(id); got.ChargeMWh != float64(i)+0.25 {
			t.Fatalf("device %d: slot holds another device's reading (charge %v)", i, got.ChargeMWh)
		}
		if c.add(id) != c.get(id) {
			t.Fatalf("device %d: add of a cached device gave a new slot", i)
		}
	}
	n := 0
	c.each(func(*device) { n++ })
	if n != len(ids) {
		t.Fatalf("each visited %d slots, %d devices cached", n, len(ids))
	}
	if c.get(uuid.New()) != nil {
		t.Fatal("an unknown device has a slot")
	}
}

// TestCacheRemoveReusesSlots: a removed device is gone from get, len and
// each; its slot comes back empty to the next device added (before any new
// chunk), with no trace of the old device's reading, rate or override.
func TestCacheRemoveReusesSlots(t *testing.T) {
	c := newCache()
	ids := make([]kettle.DeviceID, 2*cacheChunk+3)
	for i := range ids {
		ids[i] = uuid.New()
		d := c.add(ids[i])
		d.lastSeen = int64(i + 1)
		d.tat.Store(99)
		c.setOverride(ids[i], d, &kettle.Override{})
	}
	removed := map[kettle.DeviceID]bool{}
	for i := 0; i < len(ids); i += 3 {
		c.remove(ids[i])
		removed[ids[i]] = true
	}
	c.remove(uuid.New()) // unknown: nothing happens
	left := len(ids) - len(removed)
	count := func() (n int) {
		c.each(func(d *device) {
			if d.lastSeen == 0 {
				t.Fatal("each visited an empty slot")
			}
			n++
		})
		return n
	}
	if c.len() != left || count() != left || len(c.overrides) != left {
		t.Fatalf("after removing %d of %d: len %d, each %d, overrides %d; want %d", len(removed), len(ids), c.len(), count(), len(c.overrides), left)
	}
	for _, id := range ids {
		if (c.get(id) == nil) != removed[id] {
			t.Fatalf("device %s: removed %v, get %v", id, removed[id], c.get(id))
		}
	}
	chunks := len(c.chunks)
	for range removed {
		id := uuid.New()
		d := c.add(id)
		if d.lastSeen != 0 || d.tat.Load() != 0 || d.hasOverride || d.free || c.override(id, d) != nil {
			t.Fatalf("a reused slot is not empty: %+v", d)
		}
		d.lastSeen = 1
	}
	if len(c.chunks) != chunks || c.len() != len(ids) || count() != len(ids) {
		t.Fatalf("after refilling: %d chunks (had %d), len %d, each %d; want %d", len(c.chunks), chunks, c.len(), count(), len(ids))
	}
	c.add(uuid.New()).lastSeen = 1 // past the slots given back: a new one
	if c.len() != len(ids)+1 || count() != len(ids)+1 {
		t.Fatalf("one more: len %d, each %d", c.len(), count())
	}
}

// TestCacheCompact: once fewer than half of the slots hold a device, compact
// packs them into as few chunks as they fill, every device keeping its
// state, rate and override; with more than half in use it does nothing.
func TestCacheCompact(t *testing.T) {
	c := newCache()
	ids := make([]kettle.DeviceID, 10*cacheChunk)
	for i := range ids {
		ids[i] = uuid.New()
		d := c.add(ids[i])
		d.lastSeen, d.capacityML, d.revoked = int64(i+1), float64(i), i%7 == 0
		d.tat.Store(int64(i))
		if i%5 == 0 {
			c.setOverride(ids[i], d, &kettle.Override{ExpiresAt: time.Unix(int64(i), 0)})
		}
	}
	keep := func(i int) bool { return i%9 == 0 }
	for i := range ids {
		if !keep(i) && i >= 4*cacheChunk { // 6 of 10 chunks emptied but for every 9th
			c.remove(ids[i])
		}
	}
	chunks := len(c.chunks)
	c.compact()
	if len(c.chunks) != chunks {
		t.Fatalf("compacted with %d of %d slots in use", c.len(), c.used)
	}
	for i := range ids {
		if !keep(i) && i < 4*cacheChunk {
			c.remove(ids[i])
		}
	}
	left := c.len()
	c.compact()
	if want := (left + cacheChunk - 1) / cacheChunk; len(c.chunks) != want || int(c.used) != left || len(c.free) != 0 {
		t.Fatalf("after compact: %d chunks, %d used, %d free; want %d, %d, 0", len(c.chunks), c.used, len(c.free), want, left)
	}
	for i, id := range ids {
		d := c.get(id)
		if !keep(i) {
			if d != nil {
				t.Fatalf("device %d came back", i)
			}
			continue
		}
		if d == nil || d.lastSeen != int64(i+1) || d.capacityML != float64(i) || d.revoked != (i%7 == 0) || d.tat.Load() != int64(i) {
			t.Fatalf("device %d after compact: %+v", i, d)
		}
		if o := c.override(id, d); (i%5 == 0) != (o != nil) || (o != nil && o.ExpiresAt.Unix() != int64(i)) {
			t.Fatalf("device %d: override %v after compact", i, o)
		}
	}
	n := 0
	c.each(func(*device) { n++ })
	if n != left {
		t.Fatalf("each visits %d, %d cached", n, left)
	}
}
