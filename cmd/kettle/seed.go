package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/seed"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func init() {
	register("seed", "fill the store with realistic history", runSeed)
}

const seedDoc = `
Fills the store with the history of a simulated fleet: ambient temperature
with a daily cycle per device location, water heated before tea times and
cooling toward ambient, reservoirs dispensed at tea times and refilled,
batteries charging and discharging, a few devices offline for a while.

Deterministic for a given --seed: device ids and readings are derived from
it, so re-running the same command adds no duplicates (a later --end adds
only the new part). Devices are registered (their tokens work: kettle token
--device ID), and their latest state and the statistics rollups are updated
in the same transactions, so /v1/statistics and GET /command are right the
moment seeding ends. A device's last-seen time is its last reading's time.

PostgreSQL: day by day, --workers days at once. A day whose partition
does not exist yet (a first seeding) is loaded whole in one transaction,
as bulk loads go fastest: binary COPY with FREEZE into a table of its own
(no index to update row by row; rows written frozen, so no VACUUM has to
visit them), then its primary key built in one sort, ANALYZE, the table
attached as the day's partition, and the devices, rollups and totals
updated from the day's rows before the commit. A day that has a partition
already (today's, made ahead; a re-run; a later --end) goes in chunks of
--chunk-rows readings, each its own transaction: binary COPY straight
into the partition, or INSERT … ON CONFLICT when some of its rows are
already stored. At the end the
rollups' per-connection shards are folded once, the small tables the
statistics read are rewritten, and the partitions filled chunk by chunk
get VACUUM (ANALYZE), as after any bulk load (shown as "finishing" in the
summary). A sparse history, whose day of the whole fleet is fewer than
--chunk-rows readings, goes instead group by group, each chunk a range of
kettles over as many whole days as fill it. An interrupted seeding keeps
what it committed; run it again to finish. Seeding a store that is
serving kettles: --workers 1 leaves them more of the CPU, for the
same seeding rate on a small machine (docs/performance.md).
SQLite: large transactions through the store's Write.`

func runSeed(ctx context.Context, args []string) error {
	fs := newFlagSet("seed", "--db DSN --devices N --days D [flags]", seedDoc)
	db := fs.String("db", "sqlite:kettle-data/kettle.db", "store: sqlite:PATH (embedded) or postgres://user@host:port/db")
	devices := fs.Int("devices", 100, "kettles in the fleet")
	days := fs.Float64("days", 7, "days of history, ending at --end")
	interval := fs.Duration("interval", 30*time.Second, "time between two readings of a kettle")
	endFlag := fs.String("end", "", "end of history (RFC 3339 or YYYY-MM-DD, UTC; empty: the current hour, so re-runs within the hour are identical)")
	seedFlag := fs.Uint64("seed", 42, "random seed: same seed, same fleet and readings")
	workers := fs.Int("workers", 0, "parallel streams (0: 3 for PostgreSQL, 2 for SQLite); PostgreSQL: days loaded at once, and generator goroutines")
	chunk := fs.Int("chunk-rows", 200_000, "readings per COPY (at most; PostgreSQL: a chunk is within one UTC day, a transaction unless its day is loaded whole; SQLite: a transaction, one UTC day or several whole days when a day of a worker's kettles is fewer readings)")
	pool := fs.Int("pg-pool", 0, "PostgreSQL: connections in the pool (0: --workers + 2)")
	quiet := fs.Bool("quiet", false, "no progress line")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	end := time.Now().UTC().Truncate(time.Hour)
	if *endFlag != "" {
		var err error
		if end, err = parseTimeFlag("end", *endFlag); err != nil {
			return err
		}
	}
	if *days <= 0 {
		return fmt.Errorf("--days must be > 0, got %v", *days)
	}
	f := seed.Fleet{
		Seed: *seedFlag, Devices: *devices, Interval: *interval,
		End:   end.UTC(),
		Start: end.UTC().Add(-time.Duration(*days * float64(24*time.Hour))),
	}
	if err := f.Validate(); err != nil {
		return err
	}
	if *chunk < 1 {
		return fmt.Errorf("--chunk-rows must be ≥ 1, got %d", *chunk)
	}

	var sink seedSink
	switch {
	case strings.HasPrefix(*db, "sqlite:"):
		path := strings.TrimPrefix(*db, "sqlite:")
		if path == "" {
			return errors.New("--db sqlite: needs a file path, e.g. sqlite:kettle-data/kettle.db")
		}
		st, err := sqlite.Open(ctx, path)
		if err != nil {
			return err
		}
		sink = sqliteSink{st}
		if *workers <= 0 {
			*workers = 2
		}
	case server.IsPostgresDSN(*db):
		if *workers <= 0 {
			*workers = 3
		}
		if *pool <= 0 {
			*pool = *workers + 2
		}
		// The background compactor would fold the rollups the chunks
		// merge every second, rewriting them as fast as the seeding writes
		// them; SeedDone folds them once at the end instead.
		st, err := postgres.Open(ctx, *db, postgres.Options{MaxConns: int32(*pool), CompactEvery: 24 * time.Hour})
		if err != nil {
			return err
		}
		sink = copySink{st}
	default:
		return fmt.Errorf("--db %q: want sqlite:PATH or postgres://user@host/db", *db)
	}
	defer sink.Close()

	r := &seedRun{fleet: f, sink: sink, workers: *workers, chunkRows: *chunk}
	if !*quiet {
		r.progress = os.Stderr
	}
	return r.run(ctx, os.Stdout)
}

// seedSink is where generated chunks go: rows grouped by device, in
// increasing time.
type seedSink interface {
	kettle.Store
	// put stores rows and returns how many were new.
	put(ctx context.Context, rows []kettle.Measurement, registeredAt time.Time) (int64, error)
	// done runs once after the last put, with the seeded span, and says
	// what it did for the summary ("": nothing).
	done(ctx context.Context, from, to time.Time) (string, error)
}

// dayLoader is a sink that loads a day at a time (PostgreSQL: a day whose
// partition does not exist yet, postgres.DayLoad); a nil dayLoad means
// that day goes chunk by chunk through put.
type dayLoader interface {
	beginDay(ctx context.Context, day, registeredAt time.Time) (dayLoad, error)
}

// dayLoad is one day being loaded: rows of the day grouped by device, in
// increasing time, then Commit, which returns how many were new.
type dayLoad interface {
	Copy(ctx context.Context, rows []kettle.Measurement) error
	Commit(ctx context.Context) (int64, error)
	Rollback()
}

// copySink seeds PostgreSQL with SeedCopy (binary COPY into the partition).
type copySink struct{ *postgres.Store }

func (s copySink) put(ctx context.Context, rows []kettle.Measurement, reg time.Time) (int64, error) {
	return s.SeedCopy(ctx, rows, reg)
}

func (s copySink) beginDay(ctx context.Context, day, reg time.Time) (dayLoad, error) {
	l, err := s.BeginDay(ctx, day, reg)
	if l == nil {
		return nil, err
	}
	return l, err
}

func (s copySink) done(ctx context.Context, from, to time.Time) (string, error) {
	return "rollup shards folded, small tables rewritten, partitions filled chunk by chunk VACUUM (ANALYZE)d", s.SeedDone(ctx, from, to)
}

// sqliteSink seeds SQLite through SeedWrite, one transaction per chunk:
// each device counts as seen at its own newest reading, as with SeedCopy.
type sqliteSink struct{ *sqlite.Store }

func (sqliteSink) done(context.Context, time.Time, time.Time) (string, error) { return "", nil }

func (s sqliteSink) put(ctx context.Context, rows []kettle.Measurement, _ time.Time) (int64, error) {
	dup, err := s.SeedWrite(ctx, rows)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, d := range dup {
		if !d {
			n++
		}
	}
	return n, nil
}

type seedRun struct {
	fleet     seed.Fleet
	sink      seedSink
	workers   int
	chunkRows int
	progress  io.Writer // nil: quiet

	generated, stored atomic.Int64
}

func (r *seedRun) run(ctx context.Context, out io.Writer) error {
	f := r.fleet
	start := time.Now()
	if n, ok := r.sink.(kettle.Nodes); ok {
		defer beatWhileSeeding(ctx, n)()
	}
	ids := make([]kettle.DeviceID, f.Devices)
	for i := range ids {
		ids[i] = seed.DeviceID(f.Seed, i)
	}
	for i := 0; i < len(ids); i += 10_000 {
		if err := r.sink.Register(ctx, ids[i:min(i+10_000, len(ids))], f.Start); err != nil {
			return fmt.Errorf("register devices: %w", err)
		}
	}

	// Day by day when the sink loads days whole and a day of the fleet
	// fills a chunk at least: a day load has a fixed cost (its table, key,
	// ANALYZE, attach, the devices' statements), which a sparse history
	// pays for a few rows a day, where a group's chunks span months
	// (docs/performance.md).
	var err error
	if dl, ok := r.sink.(dayLoader); ok && f.RowsPerDay() >= int64(r.chunkRows) {
		err = r.runDays(ctx, start, dl)
	} else {
		err = r.runGroups(ctx, start)
	}
	if err != nil {
		return err
	}
	finish := time.Now()
	finishing, err := r.sink.done(ctx, f.Start, f.End)
	if err != nil {
		return err
	}
	el := time.Since(start)
	finished := time.Since(finish)
	gen, st := r.generated.Load(), r.stored.Load()
	fmt.Fprintf(out, "seeded %d devices × %s at %s (%s … %s, seed %d)\n", f.Devices, f.End.Sub(f.Start), f.Interval,
		f.Start.Format(time.RFC3339), f.End.Format(time.RFC3339), f.Seed)
	fmt.Fprintf(out, "  %d readings generated, %d stored, %d already there (skipped)\n", gen, st, gen-st)
	fmt.Fprintf(out, "  %s, %.0f rows/s stored (%d streams)\n", el.Round(time.Millisecond), float64(st)/el.Seconds(), r.workers)
	if finishing != "" {
		fmt.Fprintf(out, "  of which %s finishing (%s)\n", finished.Round(time.Millisecond), finishing)
	}
	stats, err := r.sink.Statistics(context.Background(), kettle.StatsQuery{ReportingSince: f.End.Add(-5 * time.Minute)})
	if err != nil {
		return fmt.Errorf("read statistics: %w", err)
	}
	fmt.Fprintf(out, "  store now: %d measurements, %d devices registered, %d reported in the last 5 min of history, Σ charge %.0f mWh, Σ water %.0f mL, potential %.0f J\n",
		stats.MeasurementCount, stats.DevicesRegistered, stats.DevicesReporting, stats.TotalChargeMWh, stats.TotalWaterML, stats.TotalPotentialJ())
	return nil
}

// runGroups seeds group by group: each of the workers takes a group of
// devices (a range of device ids) through all its days.
func (r *seedRun) runGroups(ctx context.Context, start time.Time) error {
	f := r.fleet
	// Work unit: a group of devices (a range of device ids), all its
	// days in order (the physics is continuous); one transaction per chunk
	// of about --chunk-rows readings within one day (or a window of days,
	// seed.Chunks), device by device in
	// id order, so each COPY appends to its partition's index (seed.Chunks).
	// Four groups per worker keep the workers busy to the end.
	groupList := f.Groups(4 * r.workers)
	groups := make(chan []int)
	total := int64(f.Devices) * f.RowsPerDevice()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var errOnce sync.Once
	var firstErr error
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err; cancel() })
	}
	for range r.workers {
		wg.Go(func() {
			var rows []kettle.Measurement
			for g := range groups {
				if err := r.group(ctx, g, &rows); err != nil {
					fail(err)
					return
				}
			}
		})
	}
	stopProgress := r.showProgress(start, total)
	go func() {
		defer close(groups)
		for _, g := range groupList {
			select {
			case groups <- g:
			case <-ctx.Done():
				return
			}
		}
	}()
	wg.Wait()
	stopProgress()
	if firstErr != nil {
		return firstErr
	}
	return ctx.Err()
}

// runDays seeds day by day (seed.Fleet.Days), for a sink that loads a day
// at a time (dayLoader): --workers days at once, each day's chunks into one
// dayLoad or, for a day the sink does not load whole, chunk by chunk
// through put.
func (r *seedRun) runDays(ctx context.Context, start time.Time, dl dayLoader) error {
	stopProgress := r.showProgress(start, int64(r.fleet.Devices)*r.fleet.RowsPerDevice())
	defer stopProgress()
	return r.fleet.Days(ctx, r.workers, r.chunkRows, func(ctx context.Context, day time.Time, feed *seed.DayFeed) error {
		return r.loadDay(ctx, dl, day, feed)
	})
}

// loadDay stores the chunks of day: into one dayLoad if the sink loads the
// day whole, else chunk by chunk.
func (r *seedRun) loadDay(ctx context.Context, dl dayLoader, day time.Time, feed *seed.DayFeed) (err error) {
	l, err := dl.beginDay(ctx, day, r.fleet.Start)
	if err != nil {
		return fmt.Errorf("seed %s: %w", day.Format(time.DateOnly), err)
	}
	if l != nil {
		defer func() {
			if err != nil {
				l.Rollback()
			}
		}()
	}
	for rows, err := range feed.All() {
		if err != nil {
			return err
		}
		var n int64
		if l != nil {
			err = l.Copy(ctx, rows)
		} else {
			n, err = r.sink.put(ctx, rows, r.fleet.Start)
		}
		if err != nil {
			first, last := rows[0], rows[len(rows)-1]
			return fmt.Errorf("seed %s %s … %s %s: %w", first.Device, first.Time.Format(time.RFC3339), last.Device, last.Time.Format(time.RFC3339), err)
		}
		r.generated.Add(int64(len(rows)))
		r.stored.Add(n)
	}
	if l != nil {
		n, err := l.Commit(ctx)
		if err != nil {
			return fmt.Errorf("seed %s: %w", day.Format(time.DateOnly), err)
		}
		r.stored.Add(n)
	}
	return nil
}

// group seeds the devices devs (indices in the fleet), chunk by chunk.
func (r *seedRun) group(ctx context.Context, devs []int, buf *[]kettle.Measurement) error {
	f := r.fleet
	c := f.Chunks(devs)
	for {
		rows, ok := c.Next(*buf, r.chunkRows)
		*buf = rows
		if !ok {
			return nil
		}
		n, err := r.sink.put(ctx, rows, f.Start)
		if err != nil {
			first, last := rows[0], rows[len(rows)-1]
			return fmt.Errorf("seed %s %s … %s %s: %w", first.Device, first.Time.Format(time.RFC3339), last.Device, last.Time.Format(time.RFC3339), err)
		}
		r.generated.Add(int64(len(rows)))
		r.stored.Add(n)
	}
}

// showProgress prints rows, rows/s and ETA every second (on one line when
// the output is a terminal) until the returned function is called.
func (r *seedRun) showProgress(start time.Time, total int64) (stop func()) {
	if r.progress == nil {
		return func() {}
	}
	tty := false
	if f, ok := r.progress.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			tty = true
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		every := 1
		if !tty {
			every = 10
		}
		for n := 1; ; n++ {
			select {
			case <-done:
				if tty {
					fmt.Fprintln(r.progress)
				}
				return
			case <-tick.C:
			}
			if n%every != 0 {
				continue
			}
			gen := r.generated.Load()
			el := time.Since(start).Seconds()
			rate := float64(gen) / el
			eta := "?"
			if rate > 0 && total > gen {
				eta = (time.Duration(float64(total-gen)/rate) * time.Second).Round(time.Second).String()
			}
			line := fmt.Sprintf("seed: %d / ~%d rows (%.1f%%), %d stored, %.0f rows/s, ETA %s", gen, total, 100*float64(gen)/float64(max(total, 1)), r.stored.Load(), rate, eta)
			if tty {
				fmt.Fprintf(r.progress, "\r%-100s", line)
			} else {
				fmt.Fprintln(r.progress, line)
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// beatWhileSeeding says every second that this seeder writes the store
// (kettle.Nodes), so that kettle serve nodes on the same database refresh
// their device caches from it meanwhile and once after; the returned stop
// beats a last time, after the last write.
func beatWhileSeeding(ctx context.Context, n kettle.Nodes) (stop func()) {
	id := uuid.New()
	beat := func() {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = n.Beat(bctx, id, "seed", time.Second) // best effort: a node that misses it refreshes late
	}
	beat()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				beat()
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
		beat()
	}
}
