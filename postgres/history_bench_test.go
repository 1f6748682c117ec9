package postgres

import (
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// BenchmarkHistoryStarts: what History pays, under the partition cache's
// lock that writers take too, to find its windows among 1,003 day
// partitions (a scan of the cache instead of its sorted starts: ~60 µs).
func BenchmarkHistoryStarts(b *testing.B) {
	s := &Store{parts: map[int]string{}}
	today := dayOf(time.Now())
	for d := today - 1000; d <= today+2; d++ {
		s.parts[d] = dayPartition(d).name
	}
	q := kettle.HistoryQuery{From: dayStart(today - 1), Limit: 100}
	for b.Loop() {
		s.historyStarts(q)
	}
}
