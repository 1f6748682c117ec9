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

// Chunks generates the rows of a group of devices (from Groups) in chunks,
// window by window: a window is one UTC day, or several whole days when a
// day of the group's readings is fewer than a chunk holds (a sparse
// history: 2,000 kettles at 24 h would otherwise make a transaction of a
// few hundred readings a day). In a window the devices come in the group's
// order, each with its readings of the window in increasing time. A chunk
// holds at most maxRows readings and never spans two windows; its rows are
// grouped by device in increasing time, devices in increasing id order, so
// the readings of each day reach that day's partition in (device, time)
// order, and a chunk of a one-day window falls in one day's partition.
type Chunks struct {
	kettles  []*Kettle
	interval time.Duration
	day      time.Time // start of the window being generated
	until    time.Time // its end; zero until the window is chosen
	end      time.Time
	k        int // kettle being generated in the window
	m        kettle.Measurement
	oneDay   bool // windows of one day, however sparse (DayChunks)
}

// maxWindowDays bounds a window (a year).
const maxWindowDays = 366

// Chunks returns the chunk generator of the group of device indices devs.
func (f Fleet) Chunks(devs []int) *Chunks {
	c := &Chunks{kettles: make([]*Kettle, len(devs)), interval: f.Interval, end: f.End}
	for i, d := range devs {
		c.kettles[i] = f.Kettle(d)
	}
	s := f.Start.UTC()
	c.day = time.Date(s.Year(), s.Month(), s.Day(), 0, 0, 0, 0, time.UTC)
	return c
}

// DayChunks is Chunks with every window one UTC day, however few readings
// a day holds: for a store that loads a day at a time.
func (f Fleet) DayChunks(devs []int) *Chunks {
	c := f.Chunks(devs)
	c.oneDay = true
	return c
}

// WindowDays is how many days a window spans for chunks of maxRows: one
// when a day of the group's readings (at the fleet's interval, offline
// spells not counted) fills a chunk, else as many as fill one, at most a
// year.
func (c *Chunks) WindowDays(maxRows int) int {
	if c.oneDay {
		return 1
	}
	perDay := int64(len(c.kettles)) * int64(24*time.Hour/max(c.interval, time.Second))
	if perDay >= int64(maxRows) {
		return 1
	}
	return int(min(int64(maxRows)/max(perDay, 1), maxWindowDays))
}

// Next fills buf[:0] with the next chunk of at most maxRows (≥ 1) readings
// and reports whether there was one.
func (c *Chunks) Next(buf []kettle.Measurement, maxRows int) ([]kettle.Measurement, bool) {
	rows := buf[:0]
	for c.day.Before(c.end) {
		if c.until.IsZero() {
			c.until = c.day.AddDate(0, 0, c.WindowDays(maxRows))
		}
		for ; c.k < len(c.kettles); c.k++ {
			k := c.kettles[c.k]
			for {
				if len(rows) >= maxRows {
					return rows, true
				}
				if !k.Next(c.until, &c.m) {
					break
				}
				rows = append(rows, c.m)
			}
		}
		c.k = 0
		c.day, c.until = c.until, time.Time{}
		if len(rows) > 0 {
			return rows, true
		}
	}
	return rows, len(rows) > 0
}
