package postgres_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// TestPrunePlan: after a flood of registrations the table's statistics
// have not seen (autovacuum off on the table: it has not got there yet),
// the planner expects one prunable device and would read and sort the
// whole table for every batch of a prune; a prune run starts by analyzing
// the table, so its batches walk the primary key instead.
func TestPrunePlan(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	conn := connect(t, dsn)
	if _, err := conn.Exec(ctx, "ALTER TABLE devices SET (autovacuum_enabled = false)"); err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	for range 20 {
		ids := make([]kettle.DeviceID, 1000)
		for i := range ids {
			ids[i] = uuid.New()
		}
		if err := s.Register(ctx, ids, t0); err != nil {
			t.Fatal(err)
		}
	}
	before := t0.Add(time.Hour)
	plan := func() string {
		t.Helper()
		rows, err := conn.Query(ctx, "EXPLAIN "+postgres.SQLPrune, uuid.Nil, before, 1000)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}
	// The batch's choice: the bad plan sorts every candidate by id; the
	// good one walks devices_pkey in id order and stops at the limit. The
	// DELETE then finds the batch's rows by their ctid (a Tid Scan: no join
	// with the table, whose hash the planner chose at 125,000 devices).
	if p := plan(); !strings.Contains(p, "Sort Key: devices_1.id") {
		t.Fatalf("precondition: with statistics older than the registrations the batch should read and sort the whole table; it is:\n%s", p)
	}
	got, _, err := s.Prune(ctx, before, uuid.Nil, 1, true)
	if err != nil || len(got) != 1 {
		t.Fatalf("Prune (dry run, 1) = %d devices, %v", len(got), err)
	}
	if p := plan(); strings.Contains(p, "Sort") || strings.Contains(p, "Seq Scan") || !strings.Contains(p, "Index Scan using devices_pkey") || !strings.Contains(p, "Tid Scan on devices") {
		t.Errorf("after a prune run started, its batches should walk the primary key; the plan is:\n%s", p)
	}
}
