package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/seed"
	"github.com/kettlefleet/kettlefleet/server"
)

// expire measures Store.Expire on a seeded database while --writers
// goroutines store batches of live readings of the seeded kettles (as kettle
// serve's batchers do): how long the expiry takes, what it removed, and the
// writers' commit latency before it and while it ran (its last step locks
// the measurements table: writers wait for it). Afterwards it checks the
// statistics' measurement count against
// count(*) of the table and the devices' counts against their rows.
func expire(args []string) error {
	fs := flag.NewFlagSet("expire", flag.ExitOnError)
	dsn := fs.String("dsn", "", "a seeded kettle store: PostgreSQL DSN, or sqlite:PATH")
	devices := fs.Int("devices", 2000, "kettles kettle seed registered (--devices)")
	seedN := fs.Uint64("seed", 42, "kettle seed's --seed (the kettles' ids)")
	beforeS := fs.String("before", "", "expire the readings before this UTC midnight, RFC 3339 (default: the start of this month)")
	writers := fs.Int("writers", 2, "concurrent writers of live readings")
	batch := fs.Int("batch", 200, "readings per write")
	warm := fs.Duration("warmup", 10*time.Second, "writing before the expiry")
	after := fs.Duration("after", 3*time.Second, "writing after it")
	fs.Parse(args)
	now := time.Now().UTC()
	before := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	if *beforeS != "" {
		t, err := time.Parse(time.RFC3339, *beforeS)
		if err != nil {
			return fmt.Errorf("--before: %w", err)
		}
		before = t
	}
	ctx := context.Background()
	st, err := server.OpenStore(ctx, *dsn, server.StoreOptions{PoolSize: *writers + 2}, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	defer st.Close()
	pg := !strings.HasPrefix(*dsn, "sqlite:")
	var sizeBefore, rowsBefore int64
	if pg {
		if sizeBefore, rowsBefore, err = tableSize(ctx, *dsn); err != nil {
			return err
		}
	}

	lw := startLiveWriters(ctx, st, *writers, *batch, *seedN, *devices)
	time.Sleep(*warm)
	t1 := time.Now()
	removed, eerr := st.Expire(ctx, before)
	t2 := time.Now()
	time.Sleep(*after)
	writes, werr := lw.stop()
	if eerr != nil {
		return fmt.Errorf("expire: %w", eerr)
	}
	if werr != nil {
		return fmt.Errorf("a writer failed: %w", werr)
	}
	var base, during []time.Duration
	for _, w := range writes {
		d := w.end.Sub(w.start)
		switch {
		case w.end.Before(t1) && w.start.After(t1.Add(-*warm/2)):
			base = append(base, d)
		case w.start.Before(t2) && w.end.After(t1):
			during = append(during, d)
		}
	}
	fmt.Printf("RESULT expire before=%s removed=%d seconds=%.2f rows_before=%d bytes_before=%d\n",
		before.Format(time.RFC3339), removed, t2.Sub(t1).Seconds(), rowsBefore, sizeBefore)
	fmt.Printf("RESULT writers_before_expiry %s (the %v before it)\n", latencyLine(base), *warm/2)
	fmt.Printf("RESULT writers_during_expiry %s (writes that overlapped it)\n", latencyLine(during))
	return checkExpired(ctx, st, *dsn, before, pg)
}

// write is one batch a live writer stored: when it began and was committed.
type write struct{ start, end time.Time }

// liveWriters store batches of live readings of the seeded kettles, as
// kettle serve's batchers do, until stopped.
type liveWriters struct {
	mu     sync.Mutex
	writes []write
	err    error
	wg     sync.WaitGroup
	done   chan struct{}
}

func startLiveWriters(ctx context.Context, st kettle.Store, writers, batch int, seedN uint64, devices int) *liveWriters {
	lw := &liveWriters{done: make(chan struct{})}
	for w := range writers {
		lw.wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 5))
			rows := make([]kettle.Measurement, batch)
			for k := 0; ; k++ {
				select {
				case <-lw.done:
					return
				default:
				}
				tm := time.Now().UTC().Truncate(time.Microsecond)
				for i := range rows {
					// one reading per kettle and write: distinct keys
					rows[i] = kettle.Measurement{Device: seed.DeviceID(seedN, ((k*writers+w)*batch+i)%devices),
						Time: tm, ChargeMWh: 50 + rng.Float64(), FullMWh: 100, RateMW: -1, AmbientC: 20, WaterC: 60, LevelML: 500}
				}
				t0 := time.Now()
				if _, err := st.Write(ctx, rows, t0); err != nil {
					lw.mu.Lock()
					lw.err = err
					lw.mu.Unlock()
					return
				}
				lw.mu.Lock()
				lw.writes = append(lw.writes, write{t0, time.Now()})
				lw.mu.Unlock()
			}
		})
	}
	return lw
}

// stop stops the writers and returns their writes and the error that
// stopped one of them (nil: none).
func (lw *liveWriters) stop() ([]write, error) {
	close(lw.done)
	lw.wg.Wait()
	return lw.writes, lw.err
}

// latencyLine is a RESULT line's fields for write latencies v.
func latencyLine(v []time.Duration) string {
	if len(v) == 0 {
		return "writes=0"
	}
	slices.Sort(v)
	return fmt.Sprintf("writes=%d p50_ms=%.1f p99_ms=%.1f max_ms=%.1f", len(v), ms(pct(v, 50)), ms(pct(v, 99)), ms(v[len(v)-1]))
}

// checkExpired checks that the figures still equal the rows after the
// expiry: the statistics' count and the devices' counts against count(*)
// (PostgreSQL), or against each other (SQLite).
func checkExpired(ctx context.Context, st kettle.Store, dsn string, before time.Time, pg bool) error {
	stt, err := st.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		return err
	}
	var devSum int64
	if err := st.Scan(ctx, func(d kettle.DeviceState) error { devSum += d.Measurements; return nil }); err != nil {
		return err
	}
	if !pg {
		ok := stt.MeasurementCount == devSum
		fmt.Printf("RESULT expire_check ok=%v statistics_count=%d devices_sum=%d\n", ok, stt.MeasurementCount, devSum)
		if !ok {
			return fmt.Errorf("the figures do not match after the expiry")
		}
		return nil
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var rows, oldRows, badDevs int64
	if err := conn.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE t < $1) FROM measurements", before).Scan(&rows, &oldRows); err != nil {
		return err
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM devices d LEFT JOIN device_expired x ON x.id = d.id
		LEFT JOIN (SELECT device, count(*) n FROM measurements GROUP BY device) m ON m.device = d.id
		WHERE d.measurements - coalesce(x.n, 0) <> coalesce(m.n, 0)`).Scan(&badDevs); err != nil {
		return err
	}
	sizeAfter, _, err := tableSize(ctx, dsn)
	if err != nil {
		return err
	}
	ok := stt.MeasurementCount == rows && devSum == rows && badDevs == 0 && oldRows == 0
	fmt.Printf("RESULT expire_check ok=%v rows=%d statistics_count=%d devices_sum=%d devices_wrong=%d rows_before_bound=%d bytes_after=%d\n",
		ok, rows, stt.MeasurementCount, devSum, badDevs, oldRows, sizeAfter)
	if !ok {
		return fmt.Errorf("the figures do not match the rows after the expiry")
	}
	return nil
}

// tableSize is the measurements' bytes (tables and indexes) and estimated rows.
func tableSize(ctx context.Context, dsn string) (bytes, rows int64, err error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(ctx)
	err = conn.QueryRow(ctx, `SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8, coalesce(sum(greatest(c.reltuples, 0)), 0)::int8
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'measurements'::regclass`).Scan(&bytes, &rows)
	return bytes, rows, err
}
