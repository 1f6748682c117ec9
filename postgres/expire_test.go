package postgres_test

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// expireFixture opens a store on a fresh database holding one kettle's
// reading of three months ago and one of an hour ago, and a second
// connection to the database; both are closed at the end of the test.
func expireFixture(t *testing.T, seed uint64) (s *postgres.Store, conn *pgx.Conn, rng *rand.Rand, dev kettle.DeviceID, old time.Time) {
	t.Helper()
	ctx := context.Background()
	dsn := pgtest.Start(t)
	s = open(t, dsn)
	t.Cleanup(func() { s.Close() })
	rng = rand.New(rand.NewPCG(seed, seed+1))
	dev = uuid.New()
	old = time.Now().UTC().AddDate(0, -3, 0)
	if _, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, dev, old), rowAt(rng, dev, time.Now().UTC().Add(-time.Hour))}, time.Now()); err != nil {
		t.Fatal(err)
	}
	conn = connect(t, dsn)
	return s, conn, rng, dev, old
}

// TestExpireWhileAnotherExpires: while another process holds the expiry's
// advisory lock (another node expiring), Expire removes nothing and says
// kettle.ErrExpiring; the retention loop counts that round as done, not
// failed; once the lock is free, Expire removes the old month.
func TestExpireWhileAnotherExpires(t *testing.T) {
	ctx := context.Background()
	s, other, _, _, _ := expireFixture(t, 1)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", postgres.LockExpire); err != nil {
		t.Fatal(err)
	}
	before := kettle.ExpireBefore(time.Now(), 40*24*time.Hour)
	if n, err := s.Expire(ctx, before); n != 0 || !errors.Is(err, kettle.ErrExpiring) {
		t.Errorf("Expire while another process expires: %d, %v; want 0 and ErrExpiring", n, err)
	}
	svc, err := fleet.New(ctx, s, fleet.Config{Retention: 40 * 24 * time.Hour, ExpireEvery: time.Hour}, slog.New(slog.DiscardHandler), nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := svc.Expire(ctx); n != 0 || err != nil {
		t.Errorf("the retention loop while another process expires: %d, %v; want 0, nil", n, err)
	}
	svc.Close() // and its loop, whose first round ran at start
	if st := svc.ExpiryStats(); st.Errors != 0 || st.Runs < 1 || st.LastSuccess.IsZero() {
		t.Errorf("retention loop stats while another process expires: %+v; want rounds done, none failed", st)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", postgres.LockExpire); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Expire(ctx, before); n != 1 || err != nil {
		t.Errorf("Expire once the lock is free: %d, %v; want the old reading", n, err)
	}
}

// TestExpireYieldsToWriter: a writer that stores a reading into the month
// being expired, after Expire counted it, holds the measurements table (and
// its kettle's row) and waits for the partition; Expire, whose next step
// takes the table, sees it waiting and rolls back (the month left for the
// next round) instead of deadlocking with it. The write succeeds; the next Expire
// removes the month, that reading included, and every figure still equals
// the rows.
func TestExpireYieldsToWriter(t *testing.T) {
	ctx := context.Background()
	s, conn, rng, dev, old := expireFixture(t, 3)
	written := make(chan error, 1)
	s.SetExpireCounted(func() {
		go func() {
			_, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, dev, old.Add(time.Minute))}, time.Now())
			written <- err
		}()
		// until the write waits for the partition
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			var waiting bool
			if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
				WHERE c.relname LIKE 'measurements_y%' AND NOT l.granted)`).Scan(&waiting); err != nil {
				t.Error(err)
				return
			}
			if waiting {
				return
			}
		}
		t.Error("the write never waited for the partition")
	})
	before := kettle.ExpireBefore(time.Now(), 40*24*time.Hour)
	n, err := s.Expire(ctx, before)
	if n != 0 || kettle.ErrorCode(err) != kettle.EUnavailable || !strings.Contains(err.Error(), "waits to insert") {
		t.Errorf("Expire with a writer waiting for the month: %d, %v; want 0 and EUnavailable naming the waiting writer", n, err)
	}
	if err := <-written; err != nil {
		t.Fatalf("the write into the month being expired: %v", err)
	}
	s.SetExpireCounted(nil)
	if n, err := s.Expire(ctx, before); n != 2 || err != nil {
		t.Errorf("the next Expire: %d, %v; want the month's 2 readings", n, err)
	}
	var rows int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM measurements").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	st, err := s.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := s.Device(ctx, dev)
	if err != nil {
		t.Fatal(err)
	}
	if rows != 1 || st.MeasurementCount != 1 || d.Measurements != 1 {
		t.Errorf("after: %d rows, statistic 1 = %d, the kettle's count %d; want 1, 1, 1", rows, st.MeasurementCount, d.Measurements)
	}
}

// TestExpireDropsLeftovers: a month a previous Expire detached but did not
// drop (it failed, or the process died, between its commit and the drop)
// is dropped by the next Expire; other tables are left alone.
func TestExpireDropsLeftovers(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	conn := connect(t, dsn)
	for _, q := range []string{
		"CREATE TABLE measurements_y2024m03_expired (LIKE measurements)",
		"CREATE TABLE measurements_y2024m03_keep (x int)",
		"CREATE TABLE measurements_y2024m03d05_expired (LIKE measurements)",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Expire(ctx, time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)); err != nil {
		t.Fatal(err)
	}
	rows, _ := conn.Query(ctx, "SELECT relname FROM pg_class WHERE relname LIKE 'measurements_y2024m03%' ORDER BY 1")
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(left) != 1 || left[0] != "measurements_y2024m03_keep" {
		t.Errorf("tables left: %v (%v); want only measurements_y2024m03_keep", left, err)
	}
}

// TestExpireBesideADump: while a long transaction reads measurements (a
// pg_dump's whole run), Expire leaves the month for the next round at once,
// naming the reader, instead of waiting for the table lock (and making
// every insert queue behind its waits); once the reader is gone the next
// Expire removes the month.
func TestExpireBesideADump(t *testing.T) {
	ctx := context.Background()
	s, conn, _, _, _ := expireFixture(t, 5)
	if _, err := conn.Exec(ctx, "SET application_name = 'pg_dump'"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	var n int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM measurements").Scan(&n); err != nil || n != 2 {
		t.Fatalf("the reader sees %d rows, %v", n, err)
	}
	time.Sleep(time.Second) // older than a lock wait
	before := kettle.ExpireBefore(time.Now(), 40*24*time.Hour)
	got, err := s.Expire(ctx, before)
	if got != 0 || kettle.ErrorCode(err) != kettle.EUnavailable || !strings.Contains(err.Error(), "reads measurements: pg_dump (pid") {
		t.Errorf("Expire beside a long reader: %d, %v; want 0 and EUnavailable naming the reader", got, err)
	}
	if _, err := conn.Exec(ctx, "COMMIT"); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Expire(ctx, before); got != 1 || err != nil {
		t.Errorf("the next Expire: %d, %v; want the old month's reading", got, err)
	}
}
