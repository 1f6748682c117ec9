package seed

import (
	"bytes"
	"slices"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Groups splits the fleet's devices into n groups for n parallel writers
// (fewer if there are fewer devices): device indices sorted by device id,
// cut into contiguous ranges of equal size. A group's devices are simulated
// by one writer from the first reading to the last (the physics is
// continuous), and, with Chunks, the rows of a group come in (device id,
// time) order within each UTC day, so that a store keyed by (device, time)
// and partitioned by day appends each chunk to its index instead of
// inserting into the middle of it.
func (f Fleet) Groups(n int) [][]int {
	n = max(1, min(n, f.Devices))
	ids := make([]kettle.DeviceID, f.Devices)
	order := make([]int, f.Devices)
	for i := range order {
		ids[i] = DeviceID(f.Seed, i)
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return bytes.Compare(ids[a][:], ids[b][:]) })
	groups := make([][]int, 0, n)
	for g := range n {
		lo, hi := g*f.Devices/n, (g+1)*f.Devices/n
		groups = append(groups, order[lo:hi:hi])
	}
	return groups
}

// Chunks generates the rows of a group of devices (from Groups) in chunks:
// one UTC day at a time, the devices in the group's order, each device's
// readings of the day in increasing time. A chunk holds at most maxRows
// readings and never spans two days, so it falls in one day's partition;
// its rows are grouped by device in increasing time, devices in increasing
// id order.
type Chunks struct {
	kettles []*Kettle
	day     time.Time // start of the day being generated
	end     time.Time
	k       int // kettle being generated in day
	m       kettle.Measurement
}

// Chunks returns the chunk generator of the group of device indices devs.
func (f Fleet) Chunks(devs []int) *Chunks {
	c := &Chunks{kettles: make([]*Kettle, len(devs)), end: f.End}
	for i, d := range devs {
		c.kettles[i] = f.Kettle(d)
	}
	s := f.Start.UTC()
	c.day = time.Date(s.Year(), s.Month(), s.Day(), 0, 0, 0, 0, time.UTC)
	return c
}

// Next fills buf[:0] with the next chunk of at most maxRows (≥ 1) readings
// and reports whether there was one.
func (c *Chunks) Next(buf []kettle.Measurement, maxRows int) ([]kettle.Measurement, bool) {
	rows := buf[:0]
	for c.day.Before(c.end) {
		until := c.day.AddDate(0, 0, 1)
		for ; c.k < len(c.kettles); c.k++ {
			k := c.kettles[c.k]
			for {
				if len(rows) >= maxRows {
					return rows, true
				}
				if !k.Next(until, &c.m) {
					break
				}
				rows = append(rows, c.m)
			}
		}
		c.k = 0
		c.day = until
		if len(rows) > 0 {
			return rows, true
		}
	}
	return rows, len(rows) > 0
}
