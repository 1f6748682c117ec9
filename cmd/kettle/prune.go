package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/server"
)

func init() {
	register("prune", "remove registrations that never reported (what POST /v1/devices/prune does through a server)", runPrune)
}

const pruneDoc = `
Removes the devices registered more than --older-than ago that never
stored a reading and are neither revoked (a revoked id must stay refused)
nor under an override: what a flood of POST /login leaves behind, and what
--max-devices counts. A kettle removed here that uploads later is
registered again by its upload (v1: its token comes from the operator's
secret); a case-study kettle is answered 401 and must POST /login again —
choose --older-than longer than any kettle of yours takes from its login
to its first reading. --dry-run counts them and removes nothing.

Through a running server, POST /v1/devices/prune {"older_than":"7d"} does
the same and frees the devices' memory at once. This command is for a
store no server runs on, or PostgreSQL: it tells the servers on the
database it is writing, so they reload their device caches from it and
drop what it removed within a few --cache-refresh intervals. Beside a
server on SQLite, use the API instead (that server would keep the removed
devices in memory until its restart).`

func runPrune(ctx context.Context, args []string) error {
	fs := newFlagSet("prune", "--db DSN --older-than AGE [--dry-run]", pruneDoc)
	db := fs.String("db", "sqlite:kettle-data/kettle.db", "store: sqlite:PATH (embedded) or postgres://user@host:port/db")
	var age time.Duration
	pruneAgeVar(fs, &age, "older-than", fmt.Sprintf("registered at least this long ago, e.g. 7d or 36h (at least %s)", fleet.MinPruneAge), false)
	dryRun := fs.Bool("dry-run", false, "count them, remove nothing")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if age < fleet.MinPruneAge {
		return fmt.Errorf("--older-than is required and must be at least %s (a kettle registered just now has not reported yet)", fleet.MinPruneAge)
	}
	st, err := server.OpenStore(ctx, *db, server.StoreOptions{PoolSize: 2}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		return err
	}
	defer st.Close()
	// Say this process writes the database, before and after: each server
	// on it then refreshes its device cache, once more after this last
	// beat, and drops what was removed (fleet.Service.Refresh).
	node := uuid.New()
	beat := func() {
		if n, ok := st.(kettle.Nodes); ok {
			n.Beat(ctx, node, "prune", time.Second)
		}
	}
	beat()
	start := time.Now()
	before := start.Add(-age).UTC().Truncate(kettle.TimePrecis)
	n, err := fleet.PruneStore(ctx, st, before, *dryRun, 0, func([]kettle.DeviceID) { beat() })
	if err != nil {
		return fmt.Errorf("prune devices registered before %s (%d removed first): %w", before.Format(time.RFC3339), n, err)
	}
	beat()
	stats, err := st.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		return err
	}
	verb := "removed"
	if *dryRun {
		verb = "would remove (dry run)"
	}
	fmt.Fprintf(os.Stdout, "%s %d devices registered before %s that never reported, in %s; %d devices registered\n",
		verb, n, before.Format(time.RFC3339), time.Since(start).Round(time.Millisecond), stats.DevicesRegistered)
	return nil
}
