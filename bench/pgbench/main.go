// Command pgbench is the client side of the PostgreSQL benchmarks of issue 3
// (bench/pg-*.sh run it; it is not a timed test):
//
//	pgbench ceiling --dsn DSN [fleet flags]   raw COPY of the seeder's rows into a scratch table of measurements' shape
//	pgbench ingest  --url URL --data-dir DIR  POST /v1/measurements batches, acknowledged rows/s
//	pgbench login   --url URL -n N            register N devices with POST /login, print their ids
//	pgbench stats   --url URL --data-dir DIR  GET /v1/statistics latency; --dsn: the naive SQL beside it
//	pgbench expire  --dsn DSN --devices N     Store.Expire of the partitions before --before while writers store live readings
//
// Every subcommand prints one RESULT line with what it measured.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/seed"
	"github.com/kettlefleet/kettlefleet/server"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: pgbench ceiling|ingest|login|stats|expire [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "ceiling":
		err = ceiling(os.Args[2:])
	case "ingest":
		err = ingest(os.Args[2:])
	case "login":
		err = login(os.Args[2:])
	case "stats":
		err = stats(os.Args[2:])
	case "expire":
		err = expire(os.Args[2:])
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "pgbench:", err)
		os.Exit(1)
	}
}

// ---- ceiling ----

// ceiling COPYs rows into a scratch table shaped like measurements (same
// columns, same primary key), with nothing else: no staging, no devices, no
// rollups. --rows seed generates exactly kettle seed's rows, in its groups
// and chunks (seed.Fleet.Groups, seed.Chunks) and with its number of
// parallel streams, into a scratch table partitioned by UTC day like
// measurements, each chunk straight into its day's partition as kettle
// seed does; --rows ingest generates the rows pgbench ingest sends, into
// the same day partitions, each chunk straight into its day's
// partition when it falls in one (as kettle serve's COPY does), else into
// the parent table.
func ceiling(args []string) error {
	fs := flag.NewFlagSet("ceiling", flag.ExitOnError)
	dsn := fs.String("dsn", "", "PostgreSQL DSN")
	rowsKind := fs.String("rows", "seed", "which rows: seed (kettle seed's) or ingest (pgbench ingest's)")
	devices := fs.Int("devices", 100, "seed: kettles in the fleet; ingest: devices")
	days := fs.Float64("days", 7, "seed: days of history ending at --end")
	interval := fs.Duration("interval", 30*time.Second, "seed: time between readings")
	endFlag := fs.String("end", "", "seed: end of history, RFC 3339 (as kettle seed --end)")
	seedN := fs.Uint64("seed", 42, "seed: random seed")
	workers := fs.Int("workers", 3, "parallel COPY streams")
	chunkRows := fs.Int("chunk-rows", 200_000, "readings per COPY (seed: at most, as kettle seed --chunk-rows)")
	total := fs.Int("total", 1_000_000, "ingest: rows to copy")
	batch := fs.Int("batch", 500, "ingest: rows per device request (the COPY chunk is --chunk-rows)")
	encoder := fs.String("encoder", "raw", "raw: binary rows encoded by hand (pgconn.CopyFrom, no allocation per row); pgx: pgx.Conn.CopyFrom with CopyFromSlice")
	keep := fs.Bool("keep", false, "keep the scratch table")
	load := fs.String("load", "copy", "seed: copy (each chunk COPYed into its day's partition, primary key in place) or day (each day as kettle seed loads a new day: COPY FREEZE into a table of its own, primary key and ANALYZE after, then attached; seed.Fleet.Days)")
	fs.Parse(args)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, *dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS ceiling_scratch"); err != nil {
		return err
	}
	if !*keep {
		defer conn.Exec(context.Background(), "DROP TABLE IF EXISTS ceiling_scratch")
	}
	// measurements' shape: partitioned by UTC day of t
	const columns = `device uuid NOT NULL, t timestamptz NOT NULL,
			charge_mwh float8 NOT NULL, full_mwh float8 NOT NULL, rate_mw float8 NOT NULL,
			ambient_c float8 NOT NULL, water_c float8 NOT NULL, level_ml float8 NOT NULL,
			PRIMARY KEY (device, t)`
	createScratch := func() error {
		_, err := conn.Exec(ctx, "CREATE TABLE ceiling_scratch ("+columns+") PARTITION BY RANGE (t)")
		return err
	}

	var newSource func() chunkSource
	switch *rowsKind {
	case "seed":
		end := time.Now().UTC().Truncate(time.Hour)
		if *endFlag != "" {
			if end, err = time.Parse(time.RFC3339, *endFlag); err != nil {
				return err
			}
		}
		f := seed.Fleet{Seed: *seedN, Devices: *devices, Interval: *interval, End: end,
			Start: end.Add(-time.Duration(*days * float64(24*time.Hour)))}
		if err := f.Validate(); err != nil {
			return err
		}
		if err := createScratch(); err != nil {
			return err
		}
		switch *load {
		case "day":
			return dayCeiling(ctx, *dsn, f, *workers, *chunkRows)
		case "copy":
		default:
			return fmt.Errorf("--load %q: want copy or day", *load)
		}
		if err := scratchPartitions(ctx, conn, f.Start, f.End); err != nil {
			return err
		}
		newSource = seedSource(f, *chunkRows, *workers)
	case "ingest":
		if err := createScratch(); err != nil {
			return err
		}
		// ingestRow's times: from ingestBase, one second per reading of a device
		first := ingestBase()
		last := first.Add(time.Duration(*total / *devices + *batch) * time.Second)
		if err := scratchPartitions(ctx, conn, first, last.Add(time.Second)); err != nil {
			return err
		}
		newSource = ingestSource(ingestChunks(*devices, *batch, *total, *chunkRows))
	default:
		return fmt.Errorf("--rows %q: want seed or ingest", *rowsKind)
	}

	start := time.Now()
	n, err := copyCeiling(ctx, *dsn, *workers, *encoder, newSource)
	el := time.Since(start)
	if err != nil {
		return err
	}
	var bytes, parts int64
	conn.QueryRow(ctx, `SELECT coalesce(sum(pg_total_relation_size(c.oid)), pg_total_relation_size('ceiling_scratch')), count(i.inhrelid)
		FROM pg_class c LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
		WHERE i.inhparent = 'ceiling_scratch'::regclass OR (c.oid = 'ceiling_scratch'::regclass AND c.relkind = 'r')`).Scan(&bytes, &parts)
	fmt.Printf("RESULT ceiling rows=%d seconds=%.2f rows_per_s=%.0f streams=%d encoder=%s partitions=%d bytes_per_row=%.1f\n",
		n, el.Seconds(), float64(n)/el.Seconds(), *workers, *encoder, parts, float64(bytes)/float64(max(n, 1)))
	return nil
}

// chunkSource is one COPY stream's rows: it fills buf[:0] with the next
// chunk and names the table to copy it into, until ok is false.
type chunkSource func(buf []kettle.Measurement) (rows []kettle.Measurement, table string, ok bool)

// ingestSource is pgbench ingest's rows from next, each chunk into its
// day's partition when it falls in one (as kettle serve's COPY does), else
// into the parent table.
func ingestSource(next func([]kettle.Measurement) ([]kettle.Measurement, bool)) func() chunkSource {
	return func() chunkSource {
		return func(buf []kettle.Measurement) ([]kettle.Measurement, string, bool) {
			rows, ok := next(buf)
			if !ok || len(rows) == 0 {
				return rows, "ceiling_scratch", ok
			}
			lo, hi := rows[0].Time, rows[0].Time
			for i := range rows {
				if t := rows[i].Time; t.Before(lo) {
					lo = t
				} else if t.After(hi) {
					hi = t
				}
			}
			if dayStart(lo).Equal(dayStart(hi)) {
				return rows, scratchPartition(dayStart(lo)), true
			}
			return rows, "ceiling_scratch", true
		}
	}
}

// copyCeiling runs workers COPY streams, each on its own connection and
// its own source, until every source is done; it returns the rows copied.
func copyCeiling(ctx context.Context, dsn string, workers int, encoder string, newSource func() chunkSource) (int64, error) {
	var copied atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		next := newSource()
		wg.Go(func() {
			c, err := pgx.Connect(ctx, dsn)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close(ctx)
			var buf []kettle.Measurement
			for {
				rows, table, ok := next(buf)
				if !ok {
					return
				}
				buf = rows
				if len(rows) == 0 {
					continue
				}
				n, err := copyChunk(ctx, c, encoder, table, rows)
				if err != nil {
					errs <- err
					return
				}
				copied.Add(n)
			}
		})
	}
	wg.Wait()
	close(errs)
	return copied.Load(), <-errs
}

// copyChunk COPYs rows into table with the encoder asked for.
func copyChunk(ctx context.Context, c *pgx.Conn, encoder, table string, rows []kettle.Measurement) (int64, error) {
	if encoder == "pgx" {
		return c.CopyFrom(ctx, pgx.Identifier{table},
			[]string{"device", "t", "charge_mwh", "full_mwh", "rate_mw", "ambient_c", "water_c", "level_ml"},
			pgx.CopyFromSlice(len(rows), func(i int) ([]any, error) {
				m := &rows[i]
				return []any{m.Device, m.Time, m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML}, nil
			}))
	}
	tag, err := c.PgConn().CopyFrom(ctx, postgres.NewCopyReader(rows), "COPY "+table+" "+postgres.CopyColumns+" FROM STDIN (FORMAT binary)")
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// dayCeiling loads f's rows into ceiling_scratch the way kettle seed loads
// a day that has no partition yet (postgres.DayLoad), with nothing else
// (no devices, no rollups): for each day, in one transaction, a table of
// its own made, the day's chunks COPYed into it with FREEZE, its primary
// key built and ANALYZE run, then attached as the day's partition; workers
// days at once, generated as kettle seed generates them (seed.Fleet.Days).
func dayCeiling(ctx context.Context, dsn string, f seed.Fleet, workers, chunkRows int) error {
	conns := make(chan *pgx.Conn, workers)
	for range workers {
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		conns <- c
	}
	var copied atomic.Int64
	start := time.Now()
	err := f.Days(ctx, workers, chunkRows, func(ctx context.Context, day time.Time, feed *seed.DayFeed) (err error) {
		c := <-conns
		defer func() { conns <- c }()
		table := day.Format("ceiling_load_y2006m01d02")
		lo, hi := day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339)
		if _, err := c.Exec(ctx, fmt.Sprintf(`BEGIN; CREATE TABLE %s (LIKE ceiling_scratch, CHECK (t >= '%s' AND t < '%s'))`, table, lo, hi)); err != nil {
			return err
		}
		defer func() {
			if err != nil {
				c.Exec(context.Background(), "ROLLBACK")
			}
		}()
		for rows, err := range feed.All() {
			if err != nil {
				return err
			}
			tag, err := c.PgConn().CopyFrom(ctx, postgres.NewCopyReader(rows), "COPY "+table+" "+postgres.CopyColumns+" FROM STDIN (FORMAT binary, FREEZE)")
			if err != nil {
				return err
			}
			copied.Add(tag.RowsAffected())
		}
		_, err = c.Exec(ctx, fmt.Sprintf(`ALTER TABLE %[1]s ADD PRIMARY KEY (device, t); ANALYZE %[1]s;
			ALTER TABLE ceiling_scratch ATTACH PARTITION %[1]s FOR VALUES FROM ('%[2]s') TO ('%[3]s'); COMMIT`, table, lo, hi))
		return err
	})
	el := time.Since(start)
	if err != nil {
		return err
	}
	var bytes, parts int64
	conn := <-conns
	conns <- conn
	conn.QueryRow(ctx, `SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0), count(*) FROM pg_inherits i WHERE i.inhparent = 'ceiling_scratch'::regclass`).Scan(&bytes, &parts)
	n := copied.Load()
	fmt.Printf("RESULT ceiling rows=%d seconds=%.2f rows_per_s=%.0f streams=%d encoder=raw load=day partitions=%d bytes_per_row=%.1f\n",
		n, el.Seconds(), float64(n)/el.Seconds(), workers, parts, float64(bytes)/float64(max(n, 1)))
	return nil
}

func dayStart(t time.Time) time.Time {
	t = t.UTC()
	return time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
}

// scratchPartitions creates the day partitions of ceiling_scratch that hold
// [from, to), as kettle's store partitions measurements.
func scratchPartitions(ctx context.Context, conn *pgx.Conn, from, to time.Time) error {
	for d := dayStart(from); d.Before(to); d = d.AddDate(0, 0, 1) {
		if _, err := conn.Exec(ctx, fmt.Sprintf("CREATE TABLE %s PARTITION OF ceiling_scratch FOR VALUES FROM ('%s') TO ('%s')",
			scratchPartition(d), d.Format(time.RFC3339), d.AddDate(0, 0, 1).Format(time.RFC3339))); err != nil {
			return err
		}
	}
	return nil
}

func scratchPartition(day time.Time) string {
	return day.Format("ceiling_scratch_y2006m01d02")
}

// seedSource hands out kettle seed's work: the same groups of devices
// (seed.Fleet.Groups, four per worker), each generated by one worker in the
// same chunks (seed.Chunks), as cmd/kettle/seed.go does.
func seedSource(f seed.Fleet, chunkRows, workers int) func() chunkSource {
	groups := f.Groups(4 * workers)
	var next atomic.Int64
	return func() chunkSource {
		var cur *seed.Chunks
		return func(buf []kettle.Measurement) ([]kettle.Measurement, string, bool) {
			for {
				if cur == nil {
					g := int(next.Add(1)) - 1
					if g >= len(groups) {
						return buf, "", false
					}
					cur = f.Chunks(groups[g])
				}
				rows, ok := cur.Next(buf, chunkRows)
				if ok {
					// straight into the day's partition, as kettle seed
					// does, when the chunk falls in one day (a dense
					// history), else through the parent
					day := dayStart(rows[0].Time)
					for i := range rows {
						if !dayStart(rows[i].Time).Equal(day) {
							return rows, "ceiling_scratch", true
						}
					}
					return rows, scratchPartition(day), true
				}
				cur = nil
			}
		}
	}
}

// ingestRow is reading j of request k of device dev, exactly as pgbench
// ingest sends it: one second apart, plausible values (which depend on j
// only, so that the client can encode them once: see batchEncoder).
func ingestRow(base time.Time, id kettle.DeviceID, dev, k, j, batch int) kettle.Measurement {
	v := ingestValues(j)
	return kettle.Measurement{
		Device:    id,
		Time:      ingestTime(base, dev, k, j, batch),
		ChargeMWh: v[0], FullMWh: v[1], RateMW: v[2], AmbientC: v[3], WaterC: v[4], LevelML: v[5],
	}
}

func ingestTime(base time.Time, dev, k, j, batch int) time.Time {
	return base.Add(time.Duration(k*batch+j) * time.Second).Add(time.Duration(dev%1000) * time.Microsecond)
}

// ingestValues are the six values of reading j of every request.
func ingestValues(j int) [6]float64 {
	r := rand.New(rand.NewPCG(uint64(j), 42))
	return [6]float64{math.Round(r.Float64()*40000*10) / 10, 40000, math.Round((r.Float64()*2000-1000)*10) / 10,
		math.Round((15+r.Float64()*10)*100) / 100, math.Round((20+r.Float64()*80)*100) / 100,
		math.Round(r.Float64()*1500*10) / 10}
}

func ingestBase() time.Time { return time.Now().UTC().Add(-40 * 24 * time.Hour).Truncate(time.Hour) }

func ingestID(dev int) kettle.DeviceID {
	return uuid.NewSHA1(uuid.NameSpaceOID, []byte("pgbench-ingest/"+strconv.Itoa(dev)))
}

func ingestChunks(devices, batch, total, chunkRows int) func([]kettle.Measurement) ([]kettle.Measurement, bool) {
	base := ingestBase()
	var mu sync.Mutex
	req := 0 // request number: device req%devices, its k = req/devices
	return func(buf []kettle.Measurement) ([]kettle.Measurement, bool) {
		rows := buf[:0]
		mu.Lock()
		first := req
		nreq := max(1, chunkRows/batch)
		if first*batch >= total {
			mu.Unlock()
			return rows, false
		}
		req += nreq
		mu.Unlock()
		for q := first; q < first+nreq && q*batch < total; q++ {
			dev, k := q%devices, q/devices
			id := ingestID(dev)
			for j := range batch {
				rows = append(rows, ingestRow(base, id, dev, k, j, batch))
			}
		}
		return rows, true
	}
}

// ---- ingest ----

// batchEncoder writes the JSON array POST /v1/measurements takes for one
// request of pgbench ingest: what encoding/json makes of the v1 readings of
// ingestRow, without its reflection. Everything but the times is encoded
// once, when the encoder is made: this client shares the machine's cores
// with the server it measures, so its CPU a reading counts against the
// server's.
type batchEncoder struct {
	base  time.Time
	tails [][]byte // reading j after its time: `","battery_charge_mwh":…}`
}

func newBatchEncoder(base time.Time, batch int) *batchEncoder {
	e := &batchEncoder{base: base}
	for j := range batch {
		v := ingestValues(j)
		b := []byte(`"`)
		for i, name := range [...]string{`,"battery_charge_mwh":`, `,"battery_full_mwh":`, `,"battery_rate_mw":`,
			`,"ambient_temp_c":`, `,"water_temp_c":`, `,"water_level_ml":`} {
			b = append(b, name...)
			b = strconv.AppendFloat(b, v[i], 'f', -1, 64)
		}
		e.tails = append(e.tails, append(b, '}'))
	}
	return e
}

// encode appends request k of device dev. Its readings are one second
// apart: the first time is formatted in full, each next one by stepping the
// previous one's clock in the text (a new day formats in full again), which
// took this client's time formatting from ~17% of its CPU to a few.
func (e *batchEncoder) encode(b []byte, dev, k int) []byte {
	b = append(b, '[')
	var ts [27]byte // 2026-10-13T07:00:05.000123Z
	for j, tail := range e.tails {
		if j > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"time":"`...)
		if j == 0 || !nextSecond(&ts) {
			appendTimeMicro(ts[:0], ingestTime(e.base, dev, k, j, len(e.tails)))
		}
		b = append(b, ts[:]...)
		b = append(b, tail...)
	}
	return append(b, ']', '\n')
}

// nextSecond steps the clock of an appendTimeMicro time one second on, in
// place; false (ts unchanged) when that would start a new day.
func nextSecond(ts *[27]byte) bool {
	if string(ts[11:19]) == "23:59:59" {
		return false
	}
	// each clock digit from the seconds up, and its largest value (23:59:59,
	// the one carry out of the hours, is ruled out above)
	for _, d := range [...]struct {
		i   int
		max byte
	}{{18, '9'}, {17, '5'}, {15, '9'}, {14, '5'}, {12, '9'}, {11, '2'}} {
		if ts[d.i] < d.max {
			ts[d.i]++
			return true
		}
		ts[d.i] = '0'
	}
	return true
}

// appendTimeMicro appends t (UTC) as RFC 3339 with six fractional digits,
// 2026-10-13T07:00:05.000123Z, without time.AppendFormat's layout walk.
func appendTimeMicro(b []byte, t time.Time) []byte {
	t = t.UTC()
	y, mo, d := t.Date()
	h, mi, s := t.Clock()
	us := t.Nanosecond() / 1000
	b = append(b, byte('0'+y/1000), byte('0'+y/100%10), byte('0'+y/10%10), byte('0'+y%10), '-',
		byte('0'+int(mo)/10), byte('0'+int(mo)%10), '-', byte('0'+d/10), byte('0'+d%10), 'T',
		byte('0'+h/10), byte('0'+h%10), ':', byte('0'+mi/10), byte('0'+mi%10), ':', byte('0'+s/10), byte('0'+s%10), '.')
	for div := 100000; div > 0; div /= 10 {
		b = append(b, byte('0'+us/div%10))
	}
	return append(b, 'Z')
}

// ingest drives POST /v1/measurements with batches of --batch readings of
// one device each (a kettle uploading its backlog), from --conns concurrent
// keep-alive connections, every reading new; it counts the readings
// acknowledged as stored (200 {"stored": n}).
func ingest(args []string) error {
	fs := flag.NewFlagSet("ingest", flag.ExitOnError)
	url := fs.String("url", "http://127.0.0.1:8080", "kettle serve base URL")
	dataDir := fs.String("data-dir", "kettle-data", "kettle serve --data-dir (for the secret)")
	devices := fs.Int("devices", 2000, "devices")
	batch := fs.Int("batch", 500, "readings per request")
	conns := fs.Int("conns", 16, "concurrent connections")
	dur := fs.Duration("duration", 20*time.Second, "how long to send")
	warm := fs.Duration("warmup", 3*time.Second, "sent first, not counted")
	shift := fs.Duration("shift", 0, "add this to every reading's time: a later run in one database sends new readings, not duplicates of the earlier run's (each run starts its devices' readings anew, 40 days ago)")
	cpuProfile := fs.String("cpuprofile", "", "write this client's CPU profile of the counted part to this file")
	fs.Parse(args)
	sec, err := server.ReadSecret(*dataDir, "secret")
	if err != nil {
		return err
	}
	base := ingestBase().Add(*shift)
	tr := &http.Transport{MaxIdleConnsPerHost: *conns, MaxConnsPerHost: *conns}
	cl := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	var (
		counting   atomic.Bool
		stored     atomic.Int64
		dups       atomic.Int64
		reqs, errs atomic.Int64
		latMu      sync.Mutex
		lats       []time.Duration
		stop       atomic.Bool
		firstErr   atomic.Value
	)
	var wg sync.WaitGroup
	for c := range *conns {
		wg.Go(func() {
			var body []byte // reused: encoded in place, no copy
			enc := newBatchEncoder(base, *batch)
			k := map[int]int{}
			for i := 0; !stop.Load(); i++ {
				dev := c + (i%max(1, *devices / *conns))*(*conns)
				if dev >= *devices {
					dev = c
				}
				id := ingestID(dev)
				kk := k[dev]
				k[dev]++
				body = enc.encode(body[:0], dev, kk)
				req, _ := http.NewRequest("POST", *url+"/v1/measurements", bytes.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+kettle.DeviceToken([]byte(sec), id))
				req.Header.Set("Content-Type", "application/json")
				t0 := time.Now()
				resp, err := cl.Do(req)
				if err != nil {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					time.Sleep(100 * time.Millisecond)
					continue
				}
				var out struct{ Stored, Duplicates int64 }
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || json.Unmarshal(b, &out) != nil {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, fmt.Sprintf("%d %s", resp.StatusCode, bytes.TrimSpace(b)))
					if resp.StatusCode == 503 {
						time.Sleep(50 * time.Millisecond)
					}
					continue
				}
				if counting.Load() {
					stored.Add(out.Stored)
					dups.Add(out.Duplicates)
					reqs.Add(1)
					latMu.Lock()
					lats = append(lats, time.Since(t0))
					latMu.Unlock()
				}
			}
		})
	}
	time.Sleep(*warm)
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
	}
	counting.Store(true)
	start := time.Now()
	time.Sleep(*dur)
	counting.Store(false)
	pprof.StopCPUProfile()
	el := time.Since(start)
	stop.Store(true)
	wg.Wait()
	slices.Sort(lats)
	fmt.Printf("RESULT ingest stored=%d duplicates=%d requests=%d seconds=%.2f rows_per_s=%.0f req_per_s=%.1f p50_ms=%.1f p99_ms=%.1f errors=%d conns=%d batch=%d devices=%d\n",
		stored.Load(), dups.Load(), reqs.Load(), el.Seconds(), float64(stored.Load())/el.Seconds(), float64(reqs.Load())/el.Seconds(),
		ms(pct(lats, 50)), ms(pct(lats, 99)), errs.Load(), *conns, *batch, *devices)
	if e := firstErr.Load(); e != nil {
		fmt.Println("first error:", e)
	}
	return nil
}

func pct(v []time.Duration, p float64) time.Duration {
	if len(v) == 0 {
		return 0
	}
	return v[min(len(v)-1, int(math.Ceil(p/100*float64(len(v))))-1)]
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// ---- login ----

func login(args []string) error {
	fs := flag.NewFlagSet("login", flag.ExitOnError)
	url := fs.String("url", "http://127.0.0.1:8080", "kettle serve base URL")
	n := fs.Int("n", 2000, "devices")
	fs.Parse(args)
	ids := make([]string, *n)
	var wg sync.WaitGroup
	var next atomic.Int64
	var failed atomic.Value
	for range 8 {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < *n; i = int(next.Add(1)) - 1 {
				resp, err := http.Post(*url+"/login", "application/json", bytes.NewReader([]byte(`{"username":"bench"}`)))
				if err != nil {
					failed.Store(err.Error())
					return
				}
				var out struct{ Username string }
				json.NewDecoder(resp.Body).Decode(&out)
				resp.Body.Close()
				ids[i] = out.Username
			}
		})
	}
	wg.Wait()
	if e := failed.Load(); e != nil {
		return fmt.Errorf("login: %v", e)
	}
	for _, id := range ids {
		fmt.Println(id)
	}
	return nil
}

// ---- stats ----

// stats measures GET /v1/statistics (open range: all history) latency with
// sequential requests on one keep-alive connection, and with --dsn how long
// the naive SQL over every stored row takes.
func stats(args []string) error {
	fs := flag.NewFlagSet("stats", flag.ExitOnError)
	url := fs.String("url", "http://127.0.0.1:8080", "kettle serve base URL")
	dataDir := fs.String("data-dir", "kettle-data", "kettle serve --data-dir (for the operator token)")
	n := fs.Int("n", 2000, "requests")
	query := fs.String("query", "", "query string, e.g. from=…&to=…")
	path := fs.String("path", "/v1/statistics", "what to GET (as the operator): the statistics, or e.g. /v1/devices/ID/measurements")
	dsn := fs.String("dsn", "", "also time the naive SQL on this database")
	fs.Parse(args)
	tok, err := server.ReadSecret(*dataDir, "operator-token")
	if err != nil {
		return err
	}
	cl := &http.Client{Timeout: 30 * time.Second}
	get := func() (time.Duration, []byte, error) {
		u := *url + *path
		if *query != "" {
			u += "?" + *query
		}
		req, _ := http.NewRequest("GET", u, nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		t0 := time.Now()
		resp, err := cl.Do(req)
		if err != nil {
			return 0, nil, err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return 0, nil, fmt.Errorf("GET %s: %d %s", *path, resp.StatusCode, b)
		}
		return time.Since(t0), b, nil
	}
	var body []byte
	for range 50 { // warm up
		if _, body, err = get(); err != nil {
			return err
		}
	}
	lats := make([]time.Duration, 0, *n)
	for range *n {
		d, _, err := get()
		if err != nil {
			return err
		}
		lats = append(lats, d)
	}
	slices.Sort(lats)
	if *path != "/v1/statistics" {
		fmt.Printf("RESULT get path=%s requests=%d bytes=%d p50_ms=%.3f p99_ms=%.3f max_ms=%.3f\n",
			*path, *n, len(body), ms(pct(lats, 50)), ms(pct(lats, 99)), ms(lats[len(lats)-1]))
		return nil
	}
	var st struct {
		Count int64 `json:"measurement_count"`
	}
	json.Unmarshal(body, &st)
	fmt.Printf("RESULT statistics requests=%d measurement_count=%d p50_ms=%.3f p99_ms=%.3f max_ms=%.3f\n",
		*n, st.Count, ms(pct(lats, 50)), ms(pct(lats, 99)), ms(lats[len(lats)-1]))
	if *dsn != "" {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, *dsn)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		const naive = `SELECT extract(hour FROM t AT TIME ZONE 'UTC') h, count(*), avg(water_c), stddev_pop(water_c), avg(ambient_c), stddev_pop(ambient_c) FROM measurements GROUP BY 1 ORDER BY 1`
		for i := range 2 { // the second run with a warm cache
			t0 := time.Now()
			rows, _ := conn.Query(ctx, naive)
			var total int64
			for rows.Next() {
				var h, a, b, c, d float64
				var cnt int64
				if err := rows.Scan(&h, &cnt, &a, &b, &c, &d); err != nil {
					return err
				}
				total += cnt
			}
			if err := rows.Err(); err != nil {
				return err
			}
			fmt.Printf("RESULT naive_sql run=%d rows_scanned=%d ms=%.0f sql=%q\n", i+1, total, ms(time.Since(t0)), naive)
		}
	}
	return nil
}
