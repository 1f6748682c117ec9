package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/server"
)

func init() {
	register("expire", "remove old days of readings now (what kettle serve --retention does every --expire-every)", runExpire)
}

const expireDoc = `
Removes every reading whose device time is before a UTC midnight, with
its share of the statistics: the measurement count, each kettle's count,
the hourly rollups and the temperatures by hour of day (a kettle's latest
state, capacity and last-seen time stay). --retention 90d removes the
days wholly older than 90 days, as kettle serve --retention 90d does at
start and every --expire-every; --before 2026-08-28 names the bound.
PostgreSQL drops the days' partitions (their disk space is free at once;
a database made before day partitions keeps its month partitions, each
dropped whole once the bound has passed its end), safely while servers
run on the database. SQLite deletes the rows
(the file keeps its size and reuses the pages; VACUUM shrinks it); run it
there with kettle serve stopped, or use kettle serve --retention instead:
beside a running server the two processes take the file's write lock in
turns, each reloading its caches after the other's commits, and uploads
wait seconds; kettle serve --retention expires in small transactions
between the server's own commits (docs/performance.md).`

func runExpire(ctx context.Context, args []string) error {
	fs := newFlagSet("expire", "--db DSN (--retention D | --before YYYY-MM-DD)", expireDoc)
	db := fs.String("db", "sqlite:kettle-data/kettle.db", "store: sqlite:PATH (embedded) or postgres://user@host:port/db")
	var keep time.Duration
	retentionVar(fs, &keep, "remove the days wholly older than this, e.g. 90d or 2160h")
	beforeFlag := fs.String("before", "", "remove the readings before this UTC midnight (YYYY-MM-DD or RFC 3339)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var before time.Time
	switch {
	case *beforeFlag != "" && keep > 0:
		return fmt.Errorf("--before and --retention: give one")
	case *beforeFlag != "":
		var err error
		if before, err = parseTimeFlag("before", *beforeFlag); err != nil {
			return err
		}
		if err := kettle.CheckDayStart(before); err != nil {
			return fmt.Errorf("--before %q: must be the first instant of a UTC day, e.g. %s", *beforeFlag, before.UTC().Format(time.DateOnly))
		}
	case keep > 0:
		before = kettle.ExpireBefore(time.Now(), keep)
	default:
		return fmt.Errorf("--retention or --before is required (see --help)")
	}
	st, err := server.OpenStore(ctx, *db, server.StoreOptions{PoolSize: 2}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		return err
	}
	defer st.Close()
	start := time.Now()
	n, err := st.Expire(ctx, before)
	if err != nil {
		return fmt.Errorf("expire before %s (%d readings removed first): %w", before.Format(time.DateOnly), n, err)
	}
	stats, err := st.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stdout, "expired %d readings before %s in %s; %d readings left\n",
		n, before.Format(time.DateOnly), time.Since(start).Round(time.Millisecond), stats.MeasurementCount)
	return nil
}
