package postgres_test

import (
	"context"
	"maps"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// partitionsLike lists the partitions of measurements whose name matches
// the LIKE pattern, with their rows, in name order.
func partitionsLike(t *testing.T, conn *pgx.Conn, pattern string) map[string]int64 {
	t.Helper()
	rows, _ := conn.Query(context.Background(), `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'measurements'::regclass AND c.relname LIKE $1`, pattern)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, n := range names {
		var c int64
		if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{n}.Sanitize()).Scan(&c); err != nil {
			t.Fatal(err)
		}
		got[n] = c
	}
	return got
}

func sortedKeys(m map[string]int64) []string { return slices.Sorted(maps.Keys(m)) }

// TestMonthPartitionFromBefore: a database made before day partitions holds
// month partitions. Its month keeps taking the readings of its days (no
// day partition is made inside it, by a store that knew of it at Open or
// by one that did not), batches COPYed straight into it included; days
// outside it get day partitions; Expire keeps the month while any of it is
// inside the retention and drops it whole once the bound passes its end,
// with the day partitions before the bound; every figure stays exact.
func TestMonthPartitionFromBefore(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	conn := connect(t, dsn)
	s := open(t, dsn) // opened before the month exists: it learns of it when it needs March
	defer s.Close()
	for _, q := range []string{
		"CREATE TABLE measurements_y2024m03 (LIKE measurements INCLUDING DEFAULTS)",
		"ALTER TABLE measurements ATTACH PARTITION measurements_y2024m03 FOR VALUES FROM ('2024-03-01T00:00:00Z') TO ('2024-04-01T00:00:00Z')",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	day := func(d, h int) time.Time { return time.Date(2024, 3, d, h, 0, 0, 0, time.UTC) }
	batch := []kettle.Measurement{
		rowAt(rng, devID(1), day(3, 12)),
		rowAt(rng, devID(2), day(31, 23).Add(59*time.Minute)),
		rowAt(rng, devID(1), day(32, 0)), // 1 April
		rowAt(rng, devID(2), day(33, 12)),
		rowAt(rng, devID(3), day(34, 6)),
	}
	if _, err := s.Write(ctx, batch, time.Now()); err != nil {
		t.Fatal(err)
	}
	// A batch in one day of March by COPY (every batch, here), straight
	// into the month's partition; a second store, which knew of the month
	// at Open, the same.
	s.SetPlainBatchRows(0)
	s2 := open(t, dsn, copyPath)
	defer s2.Close()
	for i, st := range []*postgres.Store{s, s2} {
		var copied []kettle.Measurement
		for j := range 50 {
			copied = append(copied, rowAt(rng, devID(10+i), day(5, 8).Add(time.Duration(j)*time.Second)))
		}
		if _, err := st.Write(ctx, copied, time.Now()); err != nil {
			t.Fatalf("store %d: COPY into March: %v", i+1, err)
		}
	}
	got := partitionsLike(t, conn, "measurements_y2024%")
	want := map[string]int64{"measurements_y2024m03": 102, "measurements_y2024m04d01": 1, "measurements_y2024m04d02": 1, "measurements_y2024m04d03": 1}
	if !maps.Equal(got, want) {
		t.Fatalf("partitions and their rows: %v, want %v", got, want)
	}
	checkExact(t, s, dsn)

	// The bound inside March: the month stays, whole.
	if n, err := s.Expire(ctx, day(15, 0)); err != nil || n != 0 {
		t.Fatalf("Expire(15 March) = %d, %v; want 0 removed (March is partly inside the retention)", n, err)
	}
	// The bound on 2 April: March and 1 April go.
	if n, err := s2.Expire(ctx, day(33, 0)); err != nil || n != 103 {
		t.Fatalf("Expire(2 April) = %d, %v; want 103 removed", n, err)
	}
	got = partitionsLike(t, conn, "measurements_y2024%")
	if k := sortedKeys(got); !slices.Equal(k, []string{"measurements_y2024m04d02", "measurements_y2024m04d03"}) {
		t.Errorf("partitions after Expire(2 April): %v", k)
	}
	checkCounts(t, s, dsn)
	// A reading back in March (another tool; the API refuses it by the
	// retention) gets a day partition now, on the store whose cache named
	// the dropped month.
	if _, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, devID(1), day(20, 1))}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got := partitionsLike(t, conn, "measurements_y2024m03%"); !maps.Equal(got, map[string]int64{"measurements_y2024m03d20": 1}) {
		t.Errorf("March after a write back: %v", got)
	}
	checkCounts(t, s2, dsn)
}

// checkCounts compares the statistics' counts (the fleet's, a bounded
// range's, each hour of day's) with the rows stored: what Expire must keep
// equal. (The latest states stay after an expiry, so checkExact's
// recompute of the totals from the rows left does not apply; the
// conformance suite checks those against its model.)
func checkCounts(t *testing.T, s *postgres.Store, dsn string) {
	t.Helper()
	want := naive(t, dsn)
	ctx := context.Background()
	st, err := s.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	bounded, err := s.Statistics(ctx, kettle.StatsQuery{From: time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC), To: time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC)})
	if err != nil {
		t.Fatal(err)
	}
	if st.MeasurementCount != want.n || bounded.RangeCount != want.n {
		t.Errorf("MeasurementCount %d, bounded RangeCount %d; stored rows %d", st.MeasurementCount, bounded.RangeCount, want.n)
	}
	for h := range 24 {
		if st.ByHour[h].Water.N != want.hourN[h] || bounded.ByHour[h].Water.N != want.hourN[h] {
			t.Errorf("hour %d: n %d, bounded %d; stored %d", h, st.ByHour[h].Water.N, bounded.ByHour[h].Water.N, want.hourN[h])
		}
	}
}

// TestPartitionsAhead: Open makes today's partition and the next
// PartitionsAhead days'; as the clock passes midnight the store's
// background loop makes the next day's, before any writer needs it.
func TestPartitionsAhead(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	conn := connect(t, dsn)
	var now atomic.Int64
	now.Store(time.Date(2031, 1, 30, 18, 0, 0, 0, time.UTC).UnixNano())
	s, err := postgres.Open(ctx, dsn, postgres.Options{MaxConns: 4, PartitionsAhead: 2, CompactEvery: 10 * time.Millisecond,
		Now: func() time.Time { return time.Unix(0, now.Load()).UTC() }})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	want := []string{"measurements_y2031m01d30", "measurements_y2031m01d31", "measurements_y2031m02d01"}
	if k := sortedKeys(partitionsLike(t, conn, "measurements_y2031%")); !slices.Equal(k, want) {
		t.Fatalf("partitions at Open: %v, want %v", k, want)
	}
	now.Store(time.Date(2031, 1, 31, 0, 0, 1, 0, time.UTC).UnixNano())
	want = append(want, "measurements_y2031m02d02")
	deadline := time.Now().Add(10 * time.Second)
	for {
		k := sortedKeys(partitionsLike(t, conn, "measurements_y2031%"))
		if slices.Equal(k, want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("partitions 10 s after midnight: %v, want %v", k, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
