package fleet

import (
	"sync/atomic"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// cache is every registered device's state in memory, laid out without
// pointers: an index from id to a slot, slots in fixed chunks of plain
// numbers, and a separate map for the few devices with an override. The
// garbage collector never looks inside pointer-free memory, so a cache of
// hundreds of thousands of kettles costs each collection a few hundred
// chunk pointers to mark instead of several objects a device (a *device
// holding a *Measurement and two time.Times, each with a pointer). On the
// embedded store the live heap grows with the fleet and the collector's
// mark phase with it; its ends were where a 200,000-kettle capacity step
// broke its p99 (docs/performance.md, "The embedded store").
//
// Chunks are never moved: growing the cache allocates one more chunk, not a
// copy of all the slots under the write lock. A revoked device keeps its
// slot; a pruned one (Service.Prune) gives it back, to be reused by the
// next device added. Guarded by Service.mu.
type cache struct {
	index  map[kettle.DeviceID]int32
	chunks []*[cacheChunk]device
	used   int32   // slots ever handed out: chunks hold [0, used)
	free   []int32 // slots given back, reused first
	// marks, during a Refresh, has a bit set for every slot the store's
	// scan showed or that add handed out since it began (see unmarked).
	marks     []uint64
	overrides map[kettle.DeviceID]*kettle.Override // devices with an override (slot's hasOverride); never mutated in place
}

// cacheChunk is the slots a chunk holds (80 KiB of them).
const cacheChunk = 1024

// device is the cached state of one kettle.
type device struct {
	lastSeen   int64   // server time the newest stored reading was committed, unix ns; 0: never
	latest     reading // valid when hasLatest
	capacityML float64
	hasLatest  bool
	revoked    bool
	// hasOverride: the device is in cache.overrides. A poll of a device
	// without one (nearly all) does not hash its id a second time.
	hasOverride bool
	free        bool // given back by remove, not reused yet
	// tat is the theoretical arrival time of the device's next request,
	// unix ns (ratelimit.go); changed under the read lock, hence atomic.
	tat atomic.Int64
}

// reading is a kettle.Measurement without its device (the cache's key) and
// with its time as unix microseconds (the precision readings are stored at).
type reading struct {
	timeUS                                                int64
	chargeMWh, fullMWh, rateMW, ambientC, waterC, levelML float64
}

func newCache() cache {
	return cache{index: make(map[kettle.DeviceID]int32), overrides: make(map[kettle.DeviceID]*kettle.Override)}
}

// get returns the device's slot, nil if it is not in the cache.
func (c *cache) get(id kettle.DeviceID) *device {
	i, ok := c.index[id]
	if !ok {
		return nil
	}
	return &c.chunks[i/cacheChunk][i%cacheChunk]
}

// add returns the device's slot, creating an empty one if needed.
func (c *cache) add(id kettle.DeviceID) *device {
	if d := c.get(id); d != nil {
		return d
	}
	var i int32
	if n := len(c.free); n > 0 {
		i, c.free = c.free[n-1], c.free[:n-1]
		c.chunks[i/cacheChunk][i%cacheChunk].free = false
	} else {
		i = c.used
		c.used++
		if int(i)/cacheChunk == len(c.chunks) {
			c.chunks = append(c.chunks, new([cacheChunk]device))
		}
	}
	c.index[id] = i
	c.mark(i)
	return &c.chunks[i/cacheChunk][i%cacheChunk]
}

// compact moves the devices into as few chunks as they fill and rebuilds
// the index (a Go map never shrinks), when fewer than half of the slots
// handed out hold a device: after a prune of a flood of registrations,
// the memory of the rest goes back to the collector. O(devices), under the
// write lock. Not during a refresh (its marks are by slot).
func (c *cache) compact() {
	if c.marks != nil || int(c.used) <= 2*len(c.index)+cacheChunk {
		return
	}
	n := cache{index: make(map[kettle.DeviceID]int32, len(c.index)), overrides: c.overrides}
	for id, i := range c.index {
		o := &c.chunks[i/cacheChunk][i%cacheChunk]
		d := n.add(id)
		d.lastSeen, d.latest, d.capacityML = o.lastSeen, o.latest, o.capacityML
		d.hasLatest, d.revoked, d.hasOverride = o.hasLatest, o.revoked, o.hasOverride
		d.tat.Store(o.tat.Load())
	}
	*c = n
}

// mark sets slot i's bit in marks, if a refresh is under way and i is in
// its range (slots past it were handed out after it began).
func (c *cache) mark(i int32) {
	if w := int(i) / 64; w < len(c.marks) {
		c.marks[w] |= 1 << (i % 64)
	}
}

// unmarked calls f with every device whose slot is not marked: devices the
// store's scan did not show although they were cached before it began.
func (c *cache) unmarked(f func(id kettle.DeviceID, d *device)) {
	n := 0
	for i := range min(int(c.used), len(c.marks)*64) {
		if c.marks[i/64]&(1<<(i%64)) == 0 && !c.chunks[i/cacheChunk][i%cacheChunk].free {
			n++
		}
	}
	if n == 0 {
		return // the common case: no walk of the index
	}
	for id, i := range c.index {
		if w := int(i) / 64; w < len(c.marks) && c.marks[w]&(1<<(i%64)) == 0 {
			f(id, &c.chunks[i/cacheChunk][i%cacheChunk])
		}
	}
}

// remove drops device id and gives its slot back (emptied, so that each
// skips it until it is reused).
func (c *cache) remove(id kettle.DeviceID) {
	i, ok := c.index[id]
	if !ok {
		return
	}
	d := &c.chunks[i/cacheChunk][i%cacheChunk]
	c.setOverride(id, d, nil)
	d.tat.Store(0)
	*d = device{free: true}
	delete(c.index, id)
	c.free = append(c.free, i)
}

func (c *cache) len() int { return len(c.index) }

// override returns the cached override of device id, whose slot is d; nil
// if none.
func (c *cache) override(id kettle.DeviceID, d *device) *kettle.Override {
	if !d.hasOverride {
		return nil
	}
	return c.overrides[id]
}

// setOverride caches the override of device id, whose slot is d (nil: none).
func (c *cache) setOverride(id kettle.DeviceID, d *device, o *kettle.Override) {
	d.hasOverride = o != nil
	if o == nil {
		delete(c.overrides, id)
	} else {
		c.overrides[id] = o
	}
}

// each calls f with every device's slot.
func (c *cache) each(f func(d *device)) {
	n := int(c.used)
	for k, ch := range c.chunks {
		for i := range ch[:min(cacheChunk, n-k*cacheChunk)] {
			if !ch[i].free {
				f(&ch[i])
			}
		}
	}
}

// newer reports whether m is newer than the cached latest reading.
func (d *device) newer(m *kettle.Measurement) bool {
	return !d.hasLatest || m.Time.UnixMicro() > d.latest.timeUS
}

func (d *device) setLatest(m *kettle.Measurement) {
	d.latest = reading{
		timeUS:    m.Time.UnixMicro(),
		chargeMWh: m.ChargeMWh, fullMWh: m.FullMWh, rateMW: m.RateMW,
		ambientC: m.AmbientC, waterC: m.WaterC, levelML: m.LevelML,
	}
	d.hasLatest = true
}

func (r *reading) measurement(id kettle.DeviceID) kettle.Measurement {
	return kettle.Measurement{
		Device: id, Time: time.UnixMicro(r.timeUS).UTC(),
		ChargeMWh: r.chargeMWh, FullMWh: r.fullMWh, RateMW: r.rateMW,
		AmbientC: r.ambientC, WaterC: r.waterC, LevelML: r.levelML,
	}
}

// unixNano is t in unix nanoseconds, 0 for the zero time.
func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}
