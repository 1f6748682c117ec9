package storetest

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// The months of the expiry tests: t0 is 2024-03-01, so history runs March to
// May; Expire(april+10 days) removes March and ten days of April, then
// Expire(may) the rest of April.
var (
	april = time.Date(2024, 4, 1, 0, 0, 0, 0, time.UTC)
	may   = time.Date(2024, 5, 1, 0, 0, 0, 0, time.UTC)
	june  = time.Date(2024, 6, 1, 0, 0, 0, 0, time.UTC)
)

// expireRanges are the statistics queries the expiry tests check: open,
// inside the expired months, across the bound, after it.
var expireRanges = []kettle.StatsQuery{
	{},
	{From: t0, To: may},
	{From: april.Add(-36 * time.Hour), To: may.Add(36 * time.Hour)},
	{From: may},
	{To: april.Add(5 * 24 * time.Hour)},
	{From: april.AddDate(0, 0, 9), To: april.AddDate(0, 0, 12)},
}

// threeMonths writes random batches over March–May into s and m: live,
// back-dated, resent and repeated rows, as testExactness; the first three
// devices only in March, so that Expire takes all of their history.
func threeMonths(t *testing.T, s kettle.Store, m *model, rng *rand.Rand, devs []kettle.DeviceID, recv time.Time) time.Time {
	t.Helper()
	span := june.Sub(t0)
	var sent []kettle.Measurement
	for b := range 120 {
		recv = recv.Add(time.Duration(1+rng.IntN(60)) * time.Second)
		batch := make([]kettle.Measurement, 0, 80)
		for len(batch) < 1+rng.IntN(60) {
			d := rng.IntN(len(devs))
			tm := at(time.Duration(rng.Int64N(int64(span)))).Truncate(time.Microsecond)
			if d < 3 {
				tm = at(time.Duration(rng.Int64N(int64(april.Sub(t0)))))
			}
			switch k := rng.IntN(10); {
			case k < 8 || len(sent) == 0:
				batch = append(batch, reading(rng, devs[d], tm))
			case k < 9:
				old := sent[rng.IntN(len(sent))]
				batch = append(batch, reading(rng, old.Device, old.Time))
			default:
				if len(batch) > 0 {
					old := batch[rng.IntN(len(batch))]
					batch = append(batch, reading(rng, old.Device, old.Time))
				}
			}
		}
		want := m.apply(batch, recv)
		if got := write(t, s, batch, recv); !slices.Equal(got, want) {
			t.Fatalf("batch %d: dup flags %v, want %v", b, got, want)
		}
		sent = append(sent, batch...)
	}
	return recv
}

func expire(t *testing.T, s kettle.Store, before time.Time) int64 {
	t.Helper()
	n, err := s.Expire(context.Background(), before)
	if err != nil {
		t.Fatalf("Expire(%s): %v", before.Format(time.RFC3339), err)
	}
	return n
}

// testExpire: Expire removes exactly the rows before its bound and every
// derived figure follows (counts, bounded and all-history by-hour moments),
// while latest states and capacities stay; writes after it (a new month,
// and a row back in an expired month) and a restart keep the store exact;
// a second Expire removes what was written back; a bound inside a month
// removes the days before it and keeps the rest; a bound that is not a UTC
// midnight is refused.
func testExpire(t *testing.T, open Opener) {
	s, reopen := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 3))
	devs := ids(7, 24)
	m := newModel(true)
	recv := threeMonths(t, s, m, rng, devs, june)
	check(t, s, m, expireRanges)

	if n := expire(t, s, t0); n != 0 {
		t.Errorf("Expire(%s) of nothing older removed %d", t0.Format(time.RFC3339), n)
	}
	for _, bad := range []time.Time{may.Add(time.Hour), may.Add(time.Microsecond), time.Date(2024, 5, 1, 0, 0, 0, 0, time.FixedZone("CEST", 2*3600))} {
		if _, err := s.Expire(ctx, bad); kettle.ErrorCode(err) != kettle.EInvalid {
			t.Errorf("Expire(%s): %v, want an EInvalid error", bad.Format(time.RFC3339Nano), err)
		}
	}
	// A bound inside a month: the days before it go, the rest of April stays.
	mid := april.AddDate(0, 0, 10)
	want := m.expire(mid)
	if want == 0 {
		t.Fatalf("the test's history has no rows before %s", mid.Format(time.DateOnly))
	}
	if got := expire(t, s, mid); got != want {
		t.Errorf("Expire(%s) removed %d, want %d", mid.Format(time.DateOnly), got, want)
	}
	check(t, s, m, expireRanges)
	want = m.expire(may)
	if want == 0 || len(m.rows) == 0 {
		t.Fatalf("the test's history has %d rows before May and %d after: both must be some", want, len(m.rows))
	}
	if got := expire(t, s, may); got != want {
		t.Errorf("Expire(May) removed %d, want %d", got, want)
	}
	check(t, s, m, expireRanges)
	if st := stats(t, s, kettle.StatsQuery{From: t0, To: may}); st.RangeCount != 0 {
		t.Errorf("after Expire(May), %d measurements before May in the statistics", st.RangeCount)
	}
	for _, d := range devs[:3] {
		if x := device(t, s, d); x.Measurements != 0 || x.Latest == nil {
			t.Errorf("device %s with all its history expired: %d measurements, latest %v; want 0 and its last reading", d, x.Measurements, x.Latest)
		}
	}

	// Writes after the expiry: a month after the history, and a row back in
	// March (accepted by the store; the API refuses such rows by its
	// retention window), of a device whose March is gone.
	recv = recv.Add(time.Minute)
	more := []kettle.Measurement{
		reading(rng, devs[0], time.Date(2024, 3, 15, 12, 0, 0, 0, time.UTC)),
		reading(rng, devs[5], june.Add(3*time.Hour)),
		reading(rng, devs[6], may.Add(2*time.Hour+time.Second)),
	}
	if got, want := write(t, s, more, recv), m.apply(more, recv); !slices.Equal(got, want) {
		t.Fatalf("after Expire: dup flags %v, want %v", got, want)
	}
	check(t, s, m, expireRanges)
	s = reopen(t)
	check(t, s, m, expireRanges)
	if got, want := expire(t, s, may), m.expire(may); got != want || got != 1 {
		t.Errorf("second Expire(May) removed %d, want %d (the row written back)", got, want)
	}
	check(t, s, m, expireRanges)
	// Everything, as far as June.
	if got, want := expire(t, s, time.Date(2024, 7, 1, 0, 0, 0, 0, time.UTC)), m.expire(june.AddDate(0, 1, 0)); got != want {
		t.Errorf("Expire(July) removed %d, want %d", got, want)
	}
	check(t, s, m, expireRanges)
	if st := stats(t, s, kettle.StatsQuery{}); st.MeasurementCount != 0 {
		t.Errorf("after expiring everything: %d measurements", st.MeasurementCount)
	}
}

// testExpireConcurrent runs Expire while writers store live rows (May) of
// the same devices and one writer stores rows back in March: no write may
// fail, and once a last Expire has run alone the store must equal the
// recompute. (A store may leave a month for its next round when a writer
// wants it: the loop calls Expire again until it succeeds.)
func testExpireConcurrent(t *testing.T, open Opener) {
	s, _ := open(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(8, 4))
	devs := ids(8, 30)
	m := newModel(false)
	recv := threeMonths(t, s, m, rng, devs, june)

	const writers, batches, size = 4, 25, 40
	results := make([][]concurrentWrite, writers)
	errs := make([]error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			wrng := rand.New(rand.NewPCG(uint64(w), 77))
			for b := range batches {
				batch := make([]kettle.Measurement, size)
				for i := range batch {
					// Unique keys per writer and batch: minute slots in May,
					// or (writer 0, every third batch) in March.
					tm := may.Add(time.Duration((w*batches+b)*size+i) * time.Minute)
					if w == 0 && b%3 == 0 {
						tm = time.Date(2024, 3, 20, 0, 0, 0, 0, time.UTC).Add(time.Duration(b*size+i)*time.Second + 17*time.Millisecond)
					}
					batch[i] = reading(wrng, devs[wrng.IntN(len(devs))], tm)
				}
				dup, err := s.Write(ctx, batch, recv)
				if err != nil {
					errs[w] = err
					return
				}
				results[w] = append(results[w], concurrentWrite{batch, dup})
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	// Expire over and over until the writers are done: each round takes
	// the March rows written since the last. (A pause between rounds, as
	// between a server's (hourly): a writer whose month is dropped between
	// its creating the partition and inserting tries again, a few times, not
	// forever.)
	var expired, left int
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
		}
		if _, err := s.Expire(ctx, may); err == nil {
			expired++
		} else if kettle.ErrorCode(err) == kettle.EUnavailable {
			left++
		} else {
			t.Errorf("Expire(May) during writes: %v", err)
			<-done
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Logf("Expire(May) during the writes: %d succeeded, %d left the month for later", expired, left)
	for w, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", w, err)
		}
	}
	if expired == 0 {
		t.Errorf("Expire(May) never succeeded during writes")
	}
	for _, rs := range results {
		for _, r := range rs {
			for i, x := range r.batch {
				if r.dup[i] {
					t.Fatalf("row %v of %s reported a duplicate; its key is unique", x.Time, x.Device)
				}
			}
			m.apply(r.batch, recv)
		}
	}
	expire(t, s, may)
	m.expire(may)
	check(t, s, m, expireRanges)
}
