package postgres_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// storeAndConn opens a store on a new database (closed when the test ends)
// and a plain connection beside it, for what the store does not expose.
func storeAndConn(t *testing.T) (*postgres.Store, *pgx.Conn) {
	t.Helper()
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	t.Cleanup(func() { s.Close() })
	return s, connect(t, dsn)
}

// newDevices returns n new device ids.
func newDevices(n int) []kettle.DeviceID {
	devs := make([]kettle.DeviceID, n)
	for i := range devs {
		devs[i] = uuid.New()
	}
	return devs
}

// TestWriteMakesNoMultiXact: a live batch locks its devices, inserts
// behind a savepoint, then updates the devices; the updates must be the
// transaction's own, not the savepoint's, or each row's lock and update are
// two transaction ids that PostgreSQL records as a MultiXact (WAL, and a
// member lookup in every later visibility check of the row).
func TestWriteMakesNoMultiXact(t *testing.T) {
	s, conn := storeAndConn(t)
	ctx := context.Background()
	next := func() uint64 {
		t.Helper()
		var n uint64
		if _, err := conn.Exec(ctx, "CHECKPOINT"); err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRow(ctx, "SELECT next_multixact_id::text::int8 FROM pg_control_checkpoint()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	rng := rand.New(rand.NewPCG(1, 2))
	devs := newDevices(5)
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	write := func(k int) {
		t.Helper()
		for _, d := range devs {
			if _, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, d, base.Add(time.Duration(k)*time.Second))}, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
	}
	write(0) // registers them
	before := next()
	for k := 1; k <= 10; k++ {
		write(k)
	}
	if after := next(); after != before {
		t.Errorf("50 single readings of 5 registered devices made %d MultiXacts, want none", after-before)
	}
}

// TestAnalyzeOnGrowth: once the store registered a tenth more devices (at
// least 256), it analyzes devices, so that its connections' cached plans
// made while the table was nearly empty (a sequential scan of devices for
// every batch) are made again.
func TestAnalyzeOnGrowth(t *testing.T) {
	s, conn := storeAndConn(t)
	ctx := context.Background()
	analyzed := func() (n int64) {
		t.Helper()
		if err := conn.QueryRow(ctx, "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'devices'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	ids := newDevices(300)
	if err := s.Register(ctx, ids[:100], time.Now()); err != nil {
		t.Fatal(err)
	}
	if n := analyzed(); n != 0 {
		t.Fatalf("devices analyzed %d times after 100 registrations, want none yet", n)
	}
	if err := s.Register(ctx, ids[100:], time.Now()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); analyzed() == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("300 registrations, and devices not analyzed within 30 s")
		}
	}
}

// TestWALPerBatch: where a write's WAL goes, by relation (as bench/sizing.sh
// WAL_PROFILE=DIR reports it). last_seen_moves takes one row per batch,
// however many last_seen values the batch moves its devices from (a row per
// value was a heap tuple per reading, and its deletion another); and the
// merges into rollups and hours_of_day and the fold into last_seen_counts
// log no row lock (an upsert logs one before each row it updates).
func TestWALPerBatch(t *testing.T) {
	s, conn := storeAndConn(t)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "CREATE EXTENSION pg_walinspect"); err != nil {
		t.Fatal(err)
	}
	lsn := func() (l string) {
		t.Helper()
		if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&l); err != nil {
			t.Fatal(err)
		}
		return l
	}
	rng := rand.New(rand.NewPCG(3, 4))
	devs := newDevices(8)
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	batches, k := 0, 0
	write := func(ds []kettle.DeviceID) {
		t.Helper()
		k++
		var batch []kettle.Measurement
		for _, d := range ds {
			batch = append(batch, rowAt(rng, d, base.Add(time.Duration(k)*time.Second)))
		}
		if _, err := s.Write(ctx, batch, time.Now()); err != nil {
			t.Fatal(err)
		}
		batches++
	}
	write(devs) // registers them
	if err := s.CompactSeen(ctx); err != nil {
		t.Fatal(err)
	}
	from, batches := lsn(), 0
	for range 3 {
		// Each device alone (each gets a last_seen of its own), then all
		// together: that batch moves 8 devices from 8 values to one.
		for _, d := range devs {
			write([]kettle.DeviceID{d})
		}
		write(devs)
	}
	if err := s.CompactSeen(ctx); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `SELECT c.relname, r.record_type, count(*) FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) r
		JOIN pg_class c ON substring(r.block_ref FROM 'blkref #0: rel \d+/\d+/(\d+)')::oid = pg_relation_filenode(c.oid)
		WHERE r.resource_manager = 'Heap' AND c.relname IN ('last_seen_moves', 'last_seen_counts', 'rollups', 'hours_of_day')
		GROUP BY 1, 2`, from, lsn())
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for rows.Next() {
		var rel, typ string
		var n int
		if err := rows.Scan(&rel, &typ, &n); err != nil {
			t.Fatal(err)
		}
		got[rel+" "+typ] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n := got["last_seen_moves INSERT"] + got["last_seen_moves INSERT+INIT"]; n != batches {
		t.Errorf("%d batches inserted %d rows into last_seen_moves, want one each (WAL records: %v)", batches, n, got)
	}
	for _, rel := range []string{"last_seen_counts", "rollups", "hours_of_day"} {
		if n := got[rel+" LOCK"]; n != 0 {
			t.Errorf("%d batches logged %d row locks on %s, want none (WAL records: %v)", batches, n, rel, got)
		}
	}
}
