package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// TestExitWithoutSyncStandby: under synchronous replication with no
// synchronous standby (Patroni's synchronous_mode_strict while the standbys
// are cut off), every commit waits for a standby that is not there. A
// store's connections must still be able to end: a backend whose exit is a
// commit (dropping a temporary table is one) never exits, and holds its
// connection slot and Patroni's stop until a standby returns. A read through
// a new connection must answer too: the nodes' polls are served while
// writes wait.
func TestExitWithoutSyncStandby(t *testing.T) {
	if testing.Short() {
		t.Skip("starts its own cluster")
	}
	// Its own cluster: synchronous_standby_names is the whole server's.
	c, err := pgtest.StartCluster()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	admin := connect(t, c.DSN("postgres"))
	t.Cleanup(func() {
		// Releases any commit still waiting, so the cluster stops.
		admin.Exec(ctx, "ALTER SYSTEM RESET synchronous_standby_names")
		admin.Exec(ctx, "SELECT pg_reload_conf()")
		if err := c.Stop(); err != nil {
			t.Error(err)
		}
	})

	s, err := postgres.Open(ctx, c.DSN("postgres"), postgres.Options{MaxConns: 4, CompactEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	dev := uuid.New()
	now := time.Now().UTC().Truncate(time.Second)
	if _, err := s.Write(ctx, []kettle.Measurement{{Device: dev, Time: now, ChargeMWh: 1, FullMWh: 2, LevelML: 500}}, now); err != nil {
		t.Fatal(err)
	}
	// Every pool connection opened (and its per-connection set-up done)
	// while commits still succeed.
	release, err := s.HoldPool(ctx)
	if err != nil {
		t.Fatal(err)
	}
	release()

	for _, q := range []string{"ALTER SYSTEM SET synchronous_standby_names = 'nobody'", "SELECT pg_reload_conf()"} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	waitSyncRepInEffect(t, c.DSN("postgres"), admin)

	// A read through a fresh connection answers while commits wait.
	s.ResetPool()
	read := make(chan error, 1)
	go func() {
		_, err := s.Device(ctx, dev)
		read <- err
	}()
	answered := false
	untilNoneWaits(t, admin, "a read through a new connection", func() bool {
		select {
		case err := <-read:
			if err != nil {
				t.Fatalf("read through a new connection while commits wait for a standby: %v", err)
			}
			answered = true
		default:
		}
		return answered
	})

	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// Every backend of the store exits.
	untilNoneWaits(t, admin, "Close", func() bool {
		var left int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'kettlefleet'").Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0
	})
}

// untilNoneWaits polls until done, failing the test as soon as one of the
// store's backends waits for the synchronous standby (wait_event SyncRep):
// with none there, it would wait forever.
func untilNoneWaits(t *testing.T, admin *pgx.Conn, what string, done func() bool) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	for !done() {
		var waiting int
		admin.Exec(ctx, "SELECT pg_stat_clear_snapshot()")
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'kettlefleet' AND wait_event = 'SyncRep'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 && !done() {
			t.Fatalf("%s: %d of the store's backends wait for a synchronous standby that does not exist", what, waiting)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not done within a minute", what)
		}
	}
}

// waitSyncRepInEffect returns once a commit waits for the synchronous
// standby (the checkpointer applies synchronous_standby_names after the
// reload), then lets that commit go.
func waitSyncRepInEffect(t *testing.T, dsn string, admin *pgx.Conn) {
	t.Helper()
	ctx := context.Background()
	probe := connect(t, dsn)
	var pid int
	if err := probe.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := probe.Exec(ctx, "CREATE TABLE sync_probe ()")
		done <- err
	}()
	deadline := time.Now().Add(time.Minute)
	for {
		var waiting bool
		if err := admin.QueryRow(ctx, "SELECT coalesce(wait_event = 'SyncRep', false) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the probe's commit returned (%v) with synchronous_standby_names set to a standby that does not exist", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("no commit waited for the synchronous standby within a minute of the reload")
		}
		admin.Exec(ctx, "SELECT pg_stat_clear_snapshot()")
	}
	// Cancelled, the wait ends with a warning; the commit stays local.
	if _, err := admin.Exec(ctx, "SELECT pg_cancel_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
