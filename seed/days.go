package seed

import (
	"context"
	"iter"
	"sync"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// Days generates the fleet day by day, for a store that loads a day at a
// time, and calls load once for each UTC day of the history, up to
// workers days at once. The days are handed out in date order; the loads
// run concurrently, so their calls may begin in another order. The fleet is cut into workers groups of
// devices (Groups), each simulated by a generator goroutine from the first
// day to the last (the physics is continuous) in chunks of at most
// chunkRows readings of one day (DayChunks); load reads its day's chunks
// from every generator with DayFeed.Next. Generators run ahead of the
// loads as far as their buffers (dayBuffers chunks each) allow, so several
// days are loaded at once, and memory stays within workers × dayBuffers
// chunks. The first error of a load (or ctx's end) stops everything and is
// returned.
func (f Fleet) Days(ctx context.Context, workers, chunkRows int, load func(ctx context.Context, day time.Time, feed *DayFeed) error) error {
	first := f.Start.UTC().Truncate(24 * time.Hour)
	days := int(f.End.Add(-time.Nanosecond).Sub(first)/(24*time.Hour)) + 1
	groups := f.Groups(workers)
	feeds := make([]chan dayChunk, days)
	for i := range feeds {
		feeds[i] = make(chan dayChunk, len(groups))
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	send := func(c chan dayChunk, m dayChunk) bool {
		select {
		case c <- m:
			return true
		case <-ctx.Done():
			return false
		}
	}
	var wg sync.WaitGroup
	for _, g := range groups {
		wg.Go(func() {
			free := make(chan []kettle.Measurement, dayBuffers)
			for range dayBuffers {
				free <- nil
			}
			c := f.DayChunks(g)
			day := 0 // the first day whose end this generator has not sent
			for {
				var buf []kettle.Measurement
				select {
				case buf = <-free:
				case <-ctx.Done():
					return
				}
				rows, ok := c.Next(buf, chunkRows)
				if !ok {
					break
				}
				d := int(rows[0].Time.Sub(first) / (24 * time.Hour))
				for ; day < d; day++ {
					if !send(feeds[day], dayChunk{}) {
						return
					}
				}
				if !send(feeds[d], dayChunk{rows, free}) {
					return
				}
			}
			for ; day < days; day++ {
				if !send(feeds[day], dayChunk{}) {
					return
				}
			}
		})
	}
	var mu sync.Mutex
	next := 0
	for range workers {
		wg.Go(func() {
			for {
				mu.Lock()
				d := next
				next++
				mu.Unlock()
				if d >= days {
					return
				}
				feed := &DayFeed{ctx: ctx, feed: feeds[d], generators: len(groups)}
				err := load(ctx, first.AddDate(0, 0, d), feed)
				feed.release()
				if err != nil {
					cancel(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return context.Cause(ctx)
}

// dayBuffers is how many chunks each generator of Days has in flight.
const dayBuffers = 3

// dayChunk is a chunk of a day's rows from a generator of Days, and where
// its buffer goes back once stored; nil rows: the generator's end of the
// day.
type dayChunk struct {
	rows []kettle.Measurement
	back chan<- []kettle.Measurement
}

// DayFeed hands a load of Days the chunks of its day.
type DayFeed struct {
	ctx        context.Context
	feed       <-chan dayChunk
	generators int // not ended yet: the day's end when 0
	cur        dayChunk
}

// Next returns the day's next chunk (rows grouped by device in increasing
// time, devices of one generator in id order), or ok false at the day's
// end; err is set when the seeding is stopping. The rows stay valid until
// the next call, which hands their buffer back to the generator.
func (f *DayFeed) Next() (rows []kettle.Measurement, ok bool, err error) {
	f.release()
	for f.generators > 0 {
		select {
		case c := <-f.feed:
			if c.rows == nil {
				f.generators--
				continue
			}
			f.cur = c
			return c.rows, true, nil
		case <-f.ctx.Done():
			return nil, false, context.Cause(f.ctx)
		}
	}
	return nil, false, nil
}

// All ranges over the day's chunks (Next until the day's end), and yields
// the error that stops the seeding, if one does, as its last element.
func (f *DayFeed) All() iter.Seq2[[]kettle.Measurement, error] {
	return func(yield func([]kettle.Measurement, error) bool) {
		for {
			rows, ok, err := f.Next()
			if err != nil {
				yield(nil, err)
				return
			}
			if !ok || !yield(rows, nil) {
				return
			}
		}
	}
}

// release hands the current chunk's buffer back (there is room: a
// generator has dayBuffers buffers and dayBuffers places).
func (f *DayFeed) release() {
	if f.cur.back != nil {
		f.cur.back <- f.cur.rows
	}
	f.cur = dayChunk{}
}
