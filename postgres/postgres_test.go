package postgres_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/storetest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The write retries reach /metrics, and the conformance suite's concurrency
// cases check that there were none.
var (
	_ metrics.WriteRetrier      = (*postgres.Store)(nil)
	_ storetest.ConflictRetrier = (*postgres.Store)(nil)
)

// open opens the store at dsn, then gives it to each of tune.
func open(t testing.TB, dsn string, tune ...func(*postgres.Store)) *postgres.Store {
	t.Helper()
	s, err := postgres.Open(context.Background(), dsn, postgres.Options{MaxConns: 8})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	for _, f := range tune {
		f(s)
	}
	return s
}

// copyPath sends every live batch of a store down the COPY path.
func copyPath(s *postgres.Store) { s.SetPlainBatchRows(0) }

// connect opens a plain connection to the test database, closed when the
// test ends: for what the store does not expose (plans, catalog, fault
// injection).
func connect(t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func TestConformance(t *testing.T) { conformance(t) }

func conformance(t *testing.T, tune ...func(*postgres.Store)) {
	storetest.Run(t, func(t *testing.T) (kettle.Store, func(t *testing.T) kettle.Store) {
		dsn := pgtest.Start(t)
		cur := open(t, dsn, tune...)
		t.Cleanup(func() { cur.Close() })
		return cur, func(t *testing.T) kettle.Store {
			cur.Close()
			cur = open(t, dsn, tune...)
			return cur
		}
	})
}

// TestConformanceCopyPath runs the suite again with every live batch, even
// a single reading, written by the optimistic COPY (and its fallback to the
// INSERT … ON CONFLICT on a duplicate) instead of the plain INSERT from arrays.
func TestConformanceCopyPath(t *testing.T) { conformance(t, copyPath) }

func rowAt(rng *rand.Rand, dev kettle.DeviceID, t time.Time) kettle.Measurement {
	return kettle.Measurement{
		Device: dev, Time: t,
		ChargeMWh: rng.Float64() * 40000, FullMWh: 40000, RateMW: rng.Float64()*2000 - 1000,
		AmbientC: 15 + rng.Float64()*10, WaterC: 20 + rng.Float64()*80, LevelML: rng.Float64() * 1500,
	}
}

func devID(i int) kettle.DeviceID { return kettle.DeviceID{0xd0, byte(i >> 8), byte(i)} }

// recompute is the naive answer, straight from the measurements table: what
// the derived tables must equal.
type recompute struct {
	n                        int64
	charge, level, potential float64
	hourN                    [24]int64
	hourWaterMean            [24]float64
	seenMismatches           int64 // last_seen values whose last_seen_counts row is wrong or missing
}

func naive(t *testing.T, dsn string) recompute {
	t.Helper()
	ctx := context.Background()
	conn := connect(t, dsn)
	var r recompute
	err := conn.QueryRow(ctx, `SELECT count(*) FROM measurements`).Scan(&r.n)
	if err != nil {
		t.Fatal(err)
	}
	err = conn.QueryRow(ctx, `SELECT coalesce(sum(charge_mwh),0), coalesce(sum(level_ml),0), coalesce(sum((water_c-ambient_c)*level_ml),0)
		FROM (SELECT DISTINCT ON (device) * FROM measurements ORDER BY device, t DESC) l`).Scan(&r.charge, &r.level, &r.potential)
	if err != nil {
		t.Fatal(err)
	}
	// last_seen_counts must equal the devices' last_seen values, counted.
	// (last_seen_counts plus the changes not yet folded into it)
	err = conn.QueryRow(ctx, `SELECT count(*) FROM (SELECT at, sum(n) AS n FROM
			(SELECT at, n FROM last_seen_counts UNION ALL SELECT u.at, u.n FROM last_seen_moves m, unnest(m.at, m.n) u(at, n)) x GROUP BY at HAVING sum(n) <> 0) c
		FULL JOIN (SELECT last_seen AS at, count(*) AS n FROM devices WHERE last_seen IS NOT NULL GROUP BY 1) d USING (at)
		WHERE c.n IS DISTINCT FROM d.n`).Scan(&r.seenMismatches)
	if err != nil {
		t.Fatal(err)
	}
	rows, _ := conn.Query(ctx, `SELECT extract(hour FROM t AT TIME ZONE 'UTC')::int, count(*), avg(water_c) FROM measurements GROUP BY 1`)
	for rows.Next() {
		var h int
		var n int64
		var mean float64
		if err := rows.Scan(&h, &n, &mean); err != nil {
			t.Fatal(err)
		}
		r.hourN[h], r.hourWaterMean[h] = n, mean
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return r
}

// checkExact compares the statistics with the recompute, then folds
// last_seen_moves into last_seen_counts (as the store's compactor does every
// second) and compares again: the fold changes no answer.
func checkExact(t *testing.T, s *postgres.Store, dsn string) {
	t.Helper()
	before := checkExactOnce(t, s, dsn)
	if err := s.CompactSeen(context.Background()); err != nil {
		t.Fatalf("CompactSeen: %v", err)
	}
	if err := s.CompactRollups(context.Background()); err != nil {
		t.Fatalf("CompactRollups: %v", err)
	}
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var moves, zeros int64
	if err := conn.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM last_seen_moves), (SELECT count(*) FROM last_seen_counts WHERE n <= 0)`).Scan(&moves, &zeros); err != nil {
		t.Fatal(err)
	}
	if moves != 0 || zeros != 0 {
		t.Errorf("after CompactSeen: %d rows left in last_seen_moves, %d last_seen_counts rows ≤ 0; want none", moves, zeros)
	}
	var unfolded int64
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM rollups WHERE shard <> 0 AND hour < date_trunc('hour', now())`).Scan(&unfolded); err != nil {
		t.Fatal(err)
	}
	if unfolded != 0 {
		t.Errorf("after CompactRollups: %d rollup rows of closed hours left outside shard 0; want none", unfolded)
	}
	after := checkExactOnce(t, s, dsn)
	for i := range before {
		if before[i] != after[i] {
			t.Errorf("devices reporting (query %d) %d before folding last_seen_moves, %d after", i, before[i], after[i])
		}
	}
}

// checkExactOnce compares the statistics with the recompute and returns the
// devices reporting ever and in the last minute of the devices' last_seen.
func checkExactOnce(t *testing.T, s *postgres.Store, dsn string) [2]int64 {
	t.Helper()
	want := naive(t, dsn)
	st, err := s.Statistics(context.Background(), kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	var reporting [2]int64
	reporting[0] = st.DevicesReporting
	var newest time.Time
	if err := s.Scan(context.Background(), func(d kettle.DeviceState) error {
		if d.LastSeen.After(newest) {
			newest = d.LastSeen
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !newest.IsZero() {
		st2, err := s.Statistics(context.Background(), kettle.StatsQuery{ReportingSince: newest.Add(-time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		reporting[1] = st2.DevicesReporting
	}
	// A bounded range over all history reads the rollups (folded or not),
	// an open one the hours of day: both must equal the recompute.
	bounded, err := s.Statistics(context.Background(), kettle.StatsQuery{From: time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC), To: time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC)})
	if err != nil {
		t.Fatal(err)
	}
	if bounded.RangeCount != want.n {
		t.Errorf("bounded-range RangeCount = %d, stored rows = %d", bounded.RangeCount, want.n)
	}
	if st.MeasurementCount != want.n {
		t.Errorf("MeasurementCount = %d, stored rows = %d", st.MeasurementCount, want.n)
	}
	f := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-9*math.Max(1, math.Abs(want)) {
			t.Errorf("%s = %v, recomputed %v", what, got, want)
		}
	}
	if want.seenMismatches != 0 {
		t.Errorf("last_seen_counts: %d values differ from a count of devices.last_seen", want.seenMismatches)
	}
	f("TotalChargeMWh", st.TotalChargeMWh, want.charge)
	f("TotalWaterML", st.TotalWaterML, want.level)
	f("TotalPotentialCmL", st.TotalPotentialCmL, want.potential)
	for h := range 24 {
		if st.ByHour[h].Water.N != want.hourN[h] {
			t.Errorf("hour %d: n = %d, recomputed %d", h, st.ByHour[h].Water.N, want.hourN[h])
		}
		f(fmt.Sprintf("hour %d water mean", h), st.ByHour[h].Water.Mean, want.hourWaterMean[h])
		if bounded.ByHour[h].Water.N != want.hourN[h] {
			t.Errorf("bounded range, hour %d: n = %d, recomputed %d", h, bounded.ByHour[h].Water.N, want.hourN[h])
		}
		f(fmt.Sprintf("bounded range, hour %d water mean", h), bounded.ByHour[h].Water.Mean, want.hourWaterMean[h])
	}
	return reporting
}

// TestBackdatedPartition writes into months that have no partition yet,
// years back and just ahead, in one batch.
func TestBackdatedPartition(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	times := []time.Time{
		time.Date(2003, 7, 4, 12, 0, 0, 0, time.UTC),
		time.Date(2019, 12, 31, 23, 59, 59, 999999000, time.UTC),
		time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Now().UTC().Add(23 * time.Hour).Truncate(time.Microsecond),
	}
	var batch []kettle.Measurement
	for _, tm := range times {
		batch = append(batch, rowAt(rng, devID(1), tm))
	}
	dup, err := s.Write(context.Background(), batch, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range dup {
		if d {
			t.Errorf("row %d reported duplicate", i)
		}
	}
	// A second store (another node) sees the partitions and the rows.
	s2 := open(t, dsn)
	defer s2.Close()
	if dup, err := s2.Write(context.Background(), batch[:2], time.Now()); err != nil || !dup[0] || !dup[1] {
		t.Fatalf("rewrite on a second store: dup %v, err %v", dup, err)
	}
	h, err := s2.History(context.Background(), kettle.HistoryQuery{Device: devID(1)})
	if err != nil || len(h) != len(times) {
		t.Fatalf("History: %d rows, err %v; want %d", len(h), err, len(times))
	}
	for i := range h {
		if !h[i].Time.Equal(times[i]) {
			t.Errorf("row %d at %v, want %v", i, h[i].Time, times[i])
		}
	}
	checkExact(t, s2, dsn)
}

// TestConcurrentMigrate opens several stores on one fresh database at once.
func TestConcurrentMigrate(t *testing.T) {
	dsn := pgtest.Start(t)
	const n = 6
	var wg sync.WaitGroup
	errs := make([]error, n)
	stores := make([]*postgres.Store, n)
	for i := range n {
		wg.Go(func() {
			stores[i], errs[i] = postgres.Open(context.Background(), dsn, postgres.Options{MaxConns: 2})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("store %d: %v", i, err)
		}
		defer stores[i].Close()
	}
	if err := stores[0].Register(context.Background(), []kettle.DeviceID{devID(1)}, time.Now()); err != nil {
		t.Fatal(err)
	}
	st, err := stores[n-1].Statistics(context.Background(), kettle.StatsQuery{})
	if err != nil || st.DevicesRegistered != 1 {
		t.Fatalf("statistics after concurrent migration: %+v, %v", st, err)
	}
}

// TestTwoNodesOverlap runs two stores (two server nodes, separate pools) that
// write overlapping batches, out of order, into the same devices and hours,
// and checks the derived figures against a full recompute.
func TestTwoNodesOverlap(t *testing.T) { twoNodesOverlap(t) }

func twoNodesOverlap(t *testing.T, tune ...func(*postgres.Store)) {
	dsn := pgtest.Start(t)
	a, b := open(t, dsn, tune...), open(t, dsn, tune...)
	defer a.Close()
	defer b.Close()
	base := time.Date(2024, 2, 28, 22, 0, 0, 0, time.UTC) // batches straddle a month boundary
	const devices, slots = 20, 300
	row := func(d, slot int) kettle.Measurement {
		return rowAt(rand.New(rand.NewPCG(uint64(d), uint64(slot))), devID(d), base.Add(time.Duration(slot)*time.Minute))
	}
	var wg sync.WaitGroup
	stored := make([]map[[2]int]int, 4)
	errs := make([]error, 4)
	for w := range 4 {
		s := a
		if w%2 == 1 {
			s = b
		}
		stored[w] = map[[2]int]int{}
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range 30 {
				var batch []kettle.Measurement
				var keys [][2]int
				for range 100 {
					d, sl := rng.IntN(devices), rng.IntN(slots)
					batch = append(batch, row(d, sl))
					keys = append(keys, [2]int{d, sl})
				}
				dup, err := s.Write(context.Background(), batch, time.Now())
				if err != nil {
					errs[w] = err
					return
				}
				for i, k := range keys {
					if !dup[i] {
						stored[w][k]++
					}
				}
			}
		})
	}
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", w, err)
		}
	}
	total := map[[2]int]int{}
	for _, m := range stored {
		for k, n := range m {
			total[k] += n
		}
	}
	for k, n := range total {
		if n != 1 {
			t.Errorf("key %v stored %d times", k, n)
		}
	}
	checkExact(t, a, dsn)
	st, _ := b.Statistics(context.Background(), kettle.StatsQuery{})
	if st.MeasurementCount != int64(len(total)) {
		t.Errorf("MeasurementCount %d, acknowledged as new %d", st.MeasurementCount, len(total))
	}
	for d := range devices {
		ds, err := a.Device(context.Background(), devID(d))
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		var newest int = -1
		var capML float64
		for k := range total {
			if k[0] == d {
				n++
				newest = max(newest, k[1])
				capML = max(capML, row(d, k[1]).LevelML)
			}
		}
		if ds.Measurements != n || ds.CapacityML != capML || (n > 0 && !ds.Latest.Time.Equal(row(d, newest).Time)) {
			t.Errorf("device %d: %d measurements, capacity %v, latest %v; want %d, %v, slot %d", d, ds.Measurements, ds.CapacityML, ds.Latest, n, capML, newest)
		}
	}
}

// TestTwoNodesOverlapCopyPath is TestTwoNodesOverlap with every batch on
// the COPY path: overlapping batches make the optimistic COPY fail on
// duplicates and fall back, under concurrency.
func TestTwoNodesOverlapCopyPath(t *testing.T) { twoNodesOverlap(t, copyPath) }

// TestSeedCopy seeds, re-seeds (no duplicates), seeds an overlapping chunk,
// and checks the derived figures.
func TestSeedCopy(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	ctx := context.Background()
	base := time.Date(2023, 5, 1, 0, 0, 0, 0, time.UTC)
	chunk := func(first, devices, from, n int) []kettle.Measurement {
		var rows []kettle.Measurement
		for d := first; d < first+devices; d++ {
			for i := from; i < from+n; i++ {
				rows = append(rows, rowAt(rand.New(rand.NewPCG(uint64(d), uint64(i))), devID(d), base.Add(time.Duration(i)*30*time.Second)))
			}
		}
		return rows
	}
	f := func(rows []kettle.Measurement, want int64) {
		t.Helper()
		n, err := s.SeedCopy(ctx, rows, base)
		if err != nil {
			t.Fatal(err)
		}
		if n != want {
			t.Errorf("SeedCopy stored %d new rows, want %d", n, want)
		}
	}
	f(chunk(0, 10, 0, 500), 5000)
	f(chunk(0, 10, 0, 500), 0)      // re-run
	f(chunk(5, 10, 250, 500), 3750) // devices 5..9 half new, 10..14 all new
	// kettle seed's chunks end in the middle of a device's readings and the
	// next chunk goes on from there: the stored part of the device is
	// outside the next chunk's span for it, so it all goes in
	f(append(chunk(20, 1, 0, 300), chunk(21, 1, 0, 100)...), 400)
	f(append(chunk(21, 1, 100, 200), chunk(22, 1, 0, 300)...), 500)
	f(append(chunk(22, 1, 250, 100), chunk(23, 1, 0, 10)...), 60) // 22: 250..299 stored
	// A live write after seeding: duplicates detected, latest kept.
	before := checkExactOnce(t, s, dsn)
	if err := s.SeedDone(ctx, base, base.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	conn := connect(t, dsn)
	var unfolded, moves int64
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM rollups WHERE shard <> 0), (SELECT count(*) FROM last_seen_moves)`).Scan(&unfolded, &moves); err != nil {
		t.Fatal(err)
	}
	if unfolded != 0 || moves != 0 {
		t.Errorf("after SeedDone: %d rollup rows outside shard 0, %d last_seen_moves; want none", unfolded, moves)
	}
	// The seeded day's partition was vacuumed (its visibility map set) and
	// analyzed (planner statistics), not left to autovacuum.
	var pages, visible, stats int64
	if err := conn.QueryRow(ctx, `SELECT relpages, relallvisible, (SELECT count(*) FROM pg_stats WHERE tablename = 'measurements_y2023m05d01')
		FROM pg_class WHERE relname = 'measurements_y2023m05d01'`).Scan(&pages, &visible, &stats); err != nil {
		t.Fatal(err)
	}
	if pages == 0 || visible != pages || stats == 0 {
		t.Errorf("after SeedDone: measurements_y2023m05d01 has %d of %d pages all-visible and %d pg_stats rows; want all pages and > 0 (VACUUM (ANALYZE))", visible, pages, stats)
	}
	if after := checkExactOnce(t, s, dsn); after != before {
		t.Errorf("SeedDone changed the statistics: %v, then %v", before, after)
	}
	dup, err := s.Write(ctx, chunk(0, 1, 499, 2), time.Now())
	if err != nil || !dup[0] || dup[1] {
		t.Fatalf("Write after seed: dup %v, err %v", dup, err)
	}
	checkExact(t, s, dsn)
	d, err := s.Device(ctx, devID(12))
	if err != nil {
		t.Fatal(err)
	}
	if want := base.Add(749 * 30 * time.Second); !d.LastSeen.Equal(want) || !d.Latest.Time.Equal(want) || d.Measurements != 500 {
		t.Errorf("seeded device: last seen %v, latest %v, %d rows; want %v, 500", d.LastSeen, d.Latest.Time, d.Measurements, want)
	}
	for dev, want := range map[int]int64{20: 300, 21: 300, 22: 350, 23: 10} {
		if d, err := s.Device(ctx, devID(dev)); err != nil || d.Measurements != want {
			t.Errorf("device %d: %d measurements (%v), want %d", dev, d.Measurements, err, want)
		}
	}
	if _, err := s.SeedCopy(ctx, append(chunk(0, 1, 0, 2), chunk(0, 1, 0, 1)...), base); kettle.ErrorCode(err) != kettle.EInvalid {
		t.Errorf("SeedCopy of ungrouped rows: %v, want EInvalid", err)
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, size := range []int{1, 100, 1000, 2000} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			s := open(b, pgtest.Start(b))
			defer s.Close()
			storetest.WriteBenchmark(b, s, size)
		})
	}
}

// BenchmarkWriteResend times the careful path: every batch resends the
// second half of the one before (a kettle that got no answer), so its
// optimistic insert fails and it goes back to the savepoint and inserts
// what is new with INSERT … ON CONFLICT DO NOTHING.
func BenchmarkWriteResend(b *testing.B) {
	for _, size := range []int{10, 1000} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			s := open(b, pgtest.Start(b))
			defer s.Close()
			ctx := context.Background()
			rng := rand.New(rand.NewPCG(1, 1))
			t0 := time.Now().UTC().Truncate(time.Hour).Add(-time.Hour)
			row := func(i int) kettle.Measurement {
				return rowAt(rng, devID(i%100), t0.Add(time.Duration(i/100)*time.Second))
			}
			batch := make([]kettle.Measurement, size)
			for j := range batch {
				batch[j] = row(j)
			}
			if _, err := s.Write(ctx, batch, t0); err != nil {
				b.Fatal(err)
			}
			next := size
			b.ReportAllocs()
			for b.Loop() {
				copy(batch, batch[size/2:])
				for j := size - size/2; j < size; j++ {
					batch[j] = row(next)
					next++
				}
				dup, err := s.Write(ctx, batch, t0)
				if err != nil {
					b.Fatal(err)
				}
				if !dup[0] || dup[size-1] {
					b.Fatalf("duplicates %v … %v, want the first half", dup[0], dup[size-1])
				}
			}
			b.ReportMetric(float64(b.N*size)/b.Elapsed().Seconds(), "rows/s")
		})
	}
}

// BenchmarkStatistics reads the statistics of 20,000 registered devices that
// reported in 10 batches over the last 10 minutes. Its sub-benchmarks
// devices-scan and counts-sum time the two ways to count the devices
// reporting in the last 5 minutes, alone, on the same database: the scan of
// devices that Statistics did before last_seen_counts, and the sum over
// last_seen_counts it does now.
func BenchmarkStatistics(b *testing.B) {
	dsn := pgtest.Start(b)
	s := open(b, dsn)
	defer s.Close()
	ctx := context.Background()
	const devices, batches = 20000, 10
	now := time.Now().UTC().Truncate(time.Microsecond)
	rng := rand.New(rand.NewPCG(3, 4))
	for k := range batches {
		var batch []kettle.Measurement
		for d := k * devices / batches; d < (k+1)*devices/batches; d++ {
			id := kettle.DeviceID{0xbe, byte(d >> 16), byte(d >> 8), byte(d)}
			batch = append(batch, rowAt(rng, id, now.Add(-time.Duration(d)*time.Second)))
		}
		if _, err := s.Write(ctx, batch, now.Add(-time.Duration(batches-k)*time.Minute)); err != nil {
			b.Fatal(err)
		}
	}
	since := now.Add(-5 * time.Minute)
	st, err := s.Statistics(ctx, kettle.StatsQuery{ReportingSince: since})
	if err != nil || st.DevicesRegistered != devices || st.DevicesReporting != devices/2 {
		b.Fatalf("statistics %d registered, %d reporting, %v; want %d, %d", st.DevicesRegistered, st.DevicesReporting, err, devices, devices/2)
	}
	conn := connect(b, dsn)
	if _, err := conn.Exec(ctx, "VACUUM ANALYZE devices, last_seen_counts"); err != nil {
		b.Fatal(err)
	}
	b.Run("Statistics", func(b *testing.B) {
		for b.Loop() {
			if _, err := s.Statistics(ctx, kettle.StatsQuery{ReportingSince: since}); err != nil {
				b.Fatal(err)
			}
		}
	})
	query := func(sql string) func(b *testing.B) {
		return func(b *testing.B) {
			for b.Loop() {
				var n int64
				if err := conn.QueryRow(ctx, sql, since).Scan(&n); err != nil || n != devices/2 {
					b.Fatalf("%d, %v; want %d", n, err, devices/2)
				}
			}
		}
	}
	b.Run("devices-scan", query(`SELECT count(*) FROM devices WHERE last_seen >= $1`))
	b.Run("counts-sum", query(`SELECT coalesce(sum(n), 0)::int8 FROM last_seen_counts WHERE at >= $1`))
}

// BenchmarkStatisticsRange reads the statistics of a bounded range over 29
// days of history (696 hours, one folded rollup row each: the shape of
// bench/pg-seed.sh's 29-day run), and of the open range beside it.
func BenchmarkStatisticsRange(b *testing.B) {
	s := open(b, pgtest.Start(b))
	defer s.Close()
	ctx := context.Background()
	const devices, hours = 20, 29 * 24
	end := time.Now().UTC().Truncate(time.Hour).Add(-2 * time.Hour)
	start := end.Add(-hours * time.Hour)
	rng := rand.New(rand.NewPCG(5, 6))
	var rows []kettle.Measurement
	for d := range devices {
		for h := range hours {
			rows = append(rows, rowAt(rng, devID(d), start.Add(time.Duration(h)*time.Hour+time.Duration(d)*time.Minute)))
		}
	}
	if _, err := s.SeedCopy(ctx, rows, start); err != nil {
		b.Fatal(err)
	}
	if err := s.CompactRollups(ctx); err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		q    kettle.StatsQuery
	}{{"bounded-696h", kettle.StatsQuery{From: start, To: end}}, {"open", kettle.StatsQuery{}}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				st, err := s.Statistics(ctx, c.q)
				if err != nil || st.RangeCount != devices*hours {
					b.Fatalf("RangeCount %d, %v; want %d", st.RangeCount, err, devices*hours)
				}
			}
		})
	}
}

// TestMigrateLastSeenCounts: migrations 3 and 4 backfill last_seen_counts
// from a database written without it (and 9 brings last_seen_moves back to a
// row per batch).
func TestMigrateLastSeenCounts(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 6))
	base := time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC)
	for k := range 3 {
		var batch []kettle.Measurement
		for d := k; d < 10; d++ {
			batch = append(batch, rowAt(rng, devID(d), base.Add(time.Duration(k)*time.Minute)))
		}
		if _, err := s.Write(ctx, batch, base.Add(time.Duration(k)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Register(ctx, []kettle.DeviceID{devID(99)}, base); err != nil {
		t.Fatal(err)
	}
	s.Close()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "DROP TABLE last_seen_counts; DELETE FROM schema_migrations WHERE version IN (3, 4, 9)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	s = open(t, dsn)
	defer s.Close()
	checkExact(t, s, dsn)
	st, err := s.Statistics(ctx, kettle.StatsQuery{ReportingSince: base.Add(time.Second)})
	if err != nil || st.DevicesReporting != 9 || st.DevicesRegistered != 11 {
		t.Fatalf("after migration: %d reporting, %d registered, %v; want 9, 11", st.DevicesReporting, st.DevicesRegistered, err)
	}
	if st, _ := s.Statistics(ctx, kettle.StatsQuery{}); st.DevicesReporting != 10 {
		t.Errorf("reporting ever: %d, want 10", st.DevicesReporting)
	}
}

// TestFoldRollups: concurrent writers of the same past hours fill several
// rollup shards; the compactor folds them into shard 0 (one row per hour)
// without changing a bounded-range statistic beyond float rounding.
func TestFoldRollups(t *testing.T) {
	dsn := pgtest.Start(t)
	s, err := postgres.Open(context.Background(), dsn, postgres.Options{MaxConns: 8, CompactEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	base := time.Now().UTC().Truncate(time.Hour).Add(-5 * time.Hour)
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for w := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			for k := range 20 {
				var batch []kettle.Measurement
				for j := range 50 {
					batch = append(batch, rowAt(rng, devID(w*100+j), base.Add(time.Duration(k*60+j)*time.Minute/4)))
				}
				if _, err := s.Write(context.Background(), batch, time.Now()); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", w, err)
		}
	}
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	counts := func() (rows, hours int) {
		t.Helper()
		if err := conn.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT hour) FROM rollups`).Scan(&rows, &hours); err != nil {
			t.Fatal(err)
		}
		return rows, hours
	}
	q := kettle.StatsQuery{From: base, To: base.Add(6 * time.Hour)}
	before, err := s.Statistics(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	if rows, hours := counts(); rows <= hours {
		t.Fatalf("before folding: %d rollup rows for %d hours; the test wants several shards per hour", rows, hours)
	}
	if err := s.CompactRollups(context.Background()); err != nil {
		t.Fatal(err)
	}
	if rows, hours := counts(); rows != hours {
		t.Errorf("after folding: %d rollup rows for %d hours; want one per hour", rows, hours)
	}
	after, err := s.Statistics(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	if after.RangeCount != before.RangeCount || after.RangeCount != 6*20*50 {
		t.Errorf("RangeCount %d after folding, %d before, %d written", after.RangeCount, before.RangeCount, 6*20*50)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }
	for h := range 24 {
		x, y := after.ByHour[h], before.ByHour[h]
		if x.Water.N != y.Water.N || !near(x.Water.Mean, y.Water.Mean) || !near(x.Water.M2, y.Water.M2) || !near(x.Ambient.Mean, y.Ambient.Mean) || !near(x.Ambient.M2, y.Ambient.M2) {
			t.Errorf("hour %d: %+v after folding, %+v before", h, x, y)
		}
	}
	checkExact(t, s, dsn)
}

// TestMaintenance: the server's checkpoint and WAL counters move with a
// CHECKPOINT and with the writes after it (a page first written after a
// checkpoint goes into the WAL whole), and checkpoint_timeout is read.
func TestMaintenance(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	write := func(n int) {
		t.Helper()
		batch := make([]kettle.Measurement, n)
		at := time.Now().UTC().Truncate(time.Second)
		for i := range batch {
			batch[i] = rowAt(rng, devID(i), at)
		}
		if _, err := s.Write(ctx, batch, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	write(100)
	m0, err := s.Maintenance(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if m0.CheckpointTimeout <= 0 {
		t.Errorf("checkpoint_timeout %v", m0.CheckpointTimeout)
	}
	c := connect(t, dsn)
	if _, err := c.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	write(100)
	// Backends flush their WAL statistics at most once a second.
	var m1 postgres.Maintenance
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if m1, err = s.Maintenance(ctx); err != nil {
			t.Fatal(err)
		}
		if m1.CheckpointsRequested > m0.CheckpointsRequested && m1.WALBytes > m0.WALBytes && m1.WALFullPageImages > m0.WALFullPageImages {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after CHECKPOINT and 100 writes: %+v, before %+v", m1, m0)
		}
	}
	if m1.CheckpointBuffers < m0.CheckpointBuffers {
		t.Errorf("checkpoint buffers went back: %d → %d", m0.CheckpointBuffers, m1.CheckpointBuffers)
	}

	// WAL segment files, as superuser (the test cluster's role): the one
	// being written steps with each switch, and a checkpoint recycles the
	// older files as files ready after it; both checked against pg_wal.
	if !m1.SegmentsKnown {
		t.Fatalf("segments unknown to a superuser: %+v", m1)
	}
	var name string
	for range 3 {
		write(100)
		if err := c.QueryRow(ctx, "SELECT pg_walfile_name(pg_switch_wal())").Scan(&name); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	m2, err := s.Maintenance(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Read with every pool connection taken (all of them waiting for
	// commits, in a saturated server): Maintenance has its own.
	release, err := s.HoldPool(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	m2, err = s.Maintenance(hctx)
	cancel()
	release()
	if err != nil {
		t.Fatalf("Maintenance with the pool exhausted: %v", err)
	}
	var ready int64
	if err := c.QueryRow(ctx, `SELECT count(*) FROM pg_ls_waldir()
		WHERE name ~ '^[0-9A-F]{24}$' AND name > pg_walfile_name(pg_current_wal_insert_lsn())`).Scan(&ready); err != nil {
		t.Fatal(err)
	}
	if m2.Segment < m1.Segment+3 || m2.SegmentsReady != ready || ready == 0 {
		t.Errorf("after 3 WAL switches and a CHECKPOINT: segment %d → %d (want ≥ +3), %d ready (pg_wal: %d after the one being written; want > 0)",
			m1.Segment, m2.Segment, m2.SegmentsReady, ready)
	}

	// A role that may not list pg_wal, with a database of its own: the
	// rest as before, segments unknown, no error.
	role := fmt.Sprintf("kt_plain_%d", time.Now().UnixNano()%1e9)
	pdsn := pgtest.Start(t)
	pc, err := pgx.Connect(ctx, pdsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close(ctx)
	var db string
	if err := pc.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"CREATE ROLE " + role + " LOGIN", "GRANT CREATE ON DATABASE " + db + " TO " + role, "GRANT ALL ON SCHEMA public TO " + role} {
		if _, err := pc.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(ctx, pdsn)
		if err != nil {
			t.Log(err)
			return
		}
		defer c.Close(ctx)
		for _, q := range []string{"DROP OWNED BY " + role, "DROP ROLE " + role} {
			if _, err := c.Exec(ctx, q); err != nil {
				t.Log(err)
			}
		}
	})
	cfg, err := pgx.ParseConfig(pdsn)
	if err != nil {
		t.Fatal(err)
	}
	plainDSN := fmt.Sprintf("host=%s port=%d dbname=%s user=%s sslmode=disable", cfg.Host, cfg.Port, db, role)
	ps, err := postgres.Open(ctx, plainDSN, postgres.Options{MaxConns: 2})
	if err != nil {
		t.Fatalf("open as %s: %v", role, err)
	}
	defer ps.Close()
	m3, err := ps.Maintenance(ctx)
	if err != nil {
		t.Fatalf("Maintenance as %s: %v", role, err)
	}
	if m3.SegmentsKnown || m3.CheckpointTimeout <= 0 || m3.WALBytes < m2.WALBytes {
		t.Errorf("as %s (no pg_ls_waldir): %+v; want the checkpoint and WAL figures, segments unknown", role, m3)
	}
}

// TestPartitionBesideADump: while another session reads measurements in a
// long transaction (as pg_dump does for its whole run: ACCESS SHARE on the
// table and its partitions), a batch for a month without a partition is
// stored at once, and so are batches for months that have one.
func TestPartitionBesideADump(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	now := time.Now().UTC().Truncate(time.Microsecond)
	if _, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, devID(1), now)}, now); err != nil {
		t.Fatal(err)
	}
	dump := connect(t, dsn)
	if _, err := dump.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := dump.QueryRow(ctx, "SELECT count(*) FROM measurements").Scan(&n); err != nil || n != 1 {
		t.Fatalf("the reader sees %d rows, %v", n, err)
	}
	// Ten seconds is far longer than a write takes and far shorter than
	// the reader, which stays until the test ends.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	old := time.Date(2011, 3, 5, 6, 0, 0, 0, time.UTC)
	if _, err := s.Write(wctx, []kettle.Measurement{rowAt(rng, devID(2), old)}, now); err != nil {
		t.Fatalf("a batch for a month without a partition, beside a long reader: %v", err)
	}
	if _, err := s.Write(wctx, []kettle.Measurement{rowAt(rng, devID(3), now.Add(-time.Minute))}, now); err != nil {
		t.Fatalf("a batch for this month, after that: %v", err)
	}
	if err := dump.QueryRow(ctx, "SELECT count(*) FROM measurements").Scan(&n); err != nil || n != 1 {
		t.Errorf("the reader's snapshot now shows %d rows, %v; want the 1 it began with", n, err)
	}
	dump.Exec(ctx, "COMMIT")
	checkExact(t, s, dsn)
}

// BenchmarkPrune: stale registrations removed from a store of 100,000 of
// them beside 25,000 kettles that reported (storetest.PruneBenchmark).
func BenchmarkPrune(b *testing.B) {
	s := open(b, pgtest.Start(b))
	defer s.Close()
	storetest.PruneBenchmark(b, s, 100_000)
}

// TestDayLoad loads days of history whose partitions do not exist yet
// (BeginDay … Copy … Commit): the day becomes a partition of its own,
// frozen and analyzed, and every derived figure equals the recompute; a
// partition that appears during the load (a live kettle's back-dated
// reading) takes the rows that are new; a rolled-back load leaves nothing.
func TestDayLoad(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	ctx := context.Background()
	conn := connect(t, dsn)
	base := time.Date(2023, 5, 1, 0, 0, 0, 0, time.UTC)
	day := func(d, first, devices, from, n int) []kettle.Measurement {
		var rows []kettle.Measurement
		for dev := first; dev < first+devices; dev++ {
			for i := from; i < from+n; i++ {
				rows = append(rows, rowAt(rand.New(rand.NewPCG(uint64(dev), uint64(d*10000+i))), devID(dev), base.AddDate(0, 0, d).Add(time.Duration(i)*time.Minute)))
			}
		}
		return rows
	}
	load := func(d int, during func(), chunks ...[]kettle.Measurement) int64 {
		t.Helper()
		l, err := s.BeginDay(ctx, base.AddDate(0, 0, d), base)
		if err != nil || l == nil {
			t.Fatalf("BeginDay %d: %v, %v", d, l, err)
		}
		for _, c := range chunks {
			if err := l.Copy(ctx, c); err != nil {
				t.Fatal(err)
			}
		}
		if during != nil {
			during()
		}
		n, err := l.Commit(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Device 5's readings split over two COPYs.
	if n := load(0, nil, append(day(0, 0, 5, 0, 1440), day(0, 5, 1, 0, 700)...), append(day(0, 5, 1, 700, 740), day(0, 6, 4, 0, 1440)...)); n != 14400 {
		t.Errorf("day 0: %d rows new, want 14400", n)
	}
	checkExact(t, s, dsn)
	var pages, visible, stats int64
	var index string
	if err := conn.QueryRow(ctx, `SELECT relpages, relallvisible, (SELECT count(*) FROM pg_stats WHERE tablename = 'measurements_y2023m05d01'),
		(SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'measurements_y2023m05d01'::regclass)
		FROM pg_class WHERE oid = 'measurements_y2023m05d01'::regclass AND relispartition`).Scan(&pages, &visible, &stats, &index); err != nil {
		t.Fatal(err)
	}
	if pages == 0 || visible != pages || stats == 0 || index != "measurements_y2023m05d01_pkey" {
		t.Errorf("loaded day: %d of %d pages all-visible, %d pg_stats rows, index %s; want all pages, > 0, measurements_y2023m05d01_pkey", visible, pages, stats, index)
	}
	if l, err := s.BeginDay(ctx, base.Add(5*time.Hour), base); l != nil || err != nil {
		t.Errorf("BeginDay of a day that has a partition: %v, %v; want nil, nil", l, err)
	}
	// Day 1: a live kettle stores one of the day's readings meanwhile, and
	// a device of its own; the partition exists by Commit.
	rows1 := day(1, 0, 3, 0, 100)
	live := func() {
		if _, err := s.Write(ctx, []kettle.Measurement{rows1[150], day(1, 40, 1, 0, 1)[0]}, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	if n := load(1, live, rows1); n != 299 {
		t.Errorf("day 1 with a partition made meanwhile: %d rows new, want 299", n)
	}
	checkExact(t, s, dsn)
	// Two seeders load day 4 at once: the second's table waits for the
	// first's commit (same name), then finds the partition there and adds
	// only what is new.
	l1, err := s.BeginDay(ctx, base.AddDate(0, 0, 4), base)
	if err != nil || l1 == nil {
		t.Fatalf("BeginDay 4: %v, %v", l1, err)
	}
	if err := l1.Copy(ctx, day(4, 0, 4, 0, 200)); err != nil {
		t.Fatal(err)
	}
	second := make(chan int64, 1)
	go func() {
		s2 := open(t, dsn)
		defer s2.Close()
		l2, err := s2.BeginDay(ctx, base.AddDate(0, 0, 4), base)
		if err != nil || l2 == nil {
			t.Errorf("second BeginDay 4: %v, %v", l2, err)
			second <- -1
			return
		}
		if err := l2.Copy(ctx, day(4, 2, 4, 0, 200)); err != nil { // devices 2, 3 stored by the first
			t.Error(err)
		}
		n, err := l2.Commit(ctx)
		if err != nil {
			t.Error(err)
		}
		second <- n
	}()
	deadline := time.Now().Add(30 * time.Second)
	for waiting := false; !waiting; time.Sleep(10 * time.Millisecond) { // until the second waits for the first's table name
		if time.Now().After(deadline) {
			t.Fatal("the second load of day 4 never waited for the first")
		}
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%CREATE TABLE kettle_load_%')`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := l1.Commit(ctx); err != nil || n != 800 {
		t.Errorf("first load of day 4: %d new, %v; want 800", n, err)
	}
	if n := <-second; n != 400 {
		t.Errorf("second load of day 4: %d new, want 400", n)
	}
	checkExact(t, s, dsn)

	// A rolled-back day leaves no table and no figure.
	before := naive(t, dsn)
	l, err := s.BeginDay(ctx, base.AddDate(0, 0, 2), base)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Copy(ctx, day(2, 0, 2, 0, 10)); err != nil {
		t.Fatal(err)
	}
	if err := l.Copy(ctx, day(3, 0, 1, 0, 1)); kettle.ErrorCode(err) != kettle.EInvalid {
		t.Errorf("Copy of a row of another day: %v, want EInvalid", err)
	}
	l.Rollback()
	var tables int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relname LIKE '%y2023m05d03%'`).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if after := naive(t, dsn); tables != 0 || after != before {
		t.Errorf("after a rolled-back day: %d tables of it, statistics %v (were %v)", tables, after, before)
	}
	checkExact(t, s, dsn)
	for dev, want := range map[int]int64{0: 1740, 5: 1640, 9: 1440, 40: 1} {
		if d, err := s.Device(ctx, devID(dev)); err != nil || d.Measurements != want {
			t.Errorf("device %d: %d measurements (%v), want %d", dev, d.Measurements, err, want)
		}
	}
}

// TestMigrateMovesPerBatch: migration 9 turns last_seen_moves into a row per
// batch; the changes left unfolded in the old table (a row per value) are
// folded into last_seen_counts first, so no statistic changes across it.
func TestMigrateMovesPerBatch(t *testing.T) {
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 8))
	base := time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC)
	write := func(s *postgres.Store, k int) {
		t.Helper()
		var batch []kettle.Measurement
		for d := k % 3; d < 10; d += 1 + k%2 {
			batch = append(batch, rowAt(rng, devID(d), base.Add(time.Duration(k)*time.Minute)))
		}
		if _, err := s.Write(ctx, batch, base.Add(time.Duration(k)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	for k := range 4 {
		write(s, k)
	}
	if err := s.CompactSeen(ctx); err != nil {
		t.Fatal(err)
	}
	s.Close()
	// The table as migration 4 left it, holding the latest values' counts
	// as changes not folded yet.
	conn := connect(t, dsn)
	if _, err := conn.Exec(ctx, `DROP TABLE last_seen_moves;
		CREATE TABLE last_seen_moves (at timestamptz NOT NULL, n bigint NOT NULL);
		WITH d AS (DELETE FROM last_seen_counts WHERE at >= (SELECT max(at) FROM last_seen_counts) - interval '1 second' RETURNING at, n)
		INSERT INTO last_seen_moves SELECT at, n FROM d;
		DELETE FROM schema_migrations WHERE version = 9`); err != nil {
		t.Fatal(err)
	}
	s = open(t, dsn)
	defer s.Close()
	checkExact(t, s, dsn)
	write(s, 4)
	checkExact(t, s, dsn)
	st, err := s.Statistics(ctx, kettle.StatsQuery{ReportingSince: base.Add(3 * time.Second)})
	if err != nil || st.DevicesReporting != 10 {
		t.Fatalf("after migration 9: %d devices reporting since the 4th batch, %v; want 10", st.DevicesReporting, err)
	}
}
