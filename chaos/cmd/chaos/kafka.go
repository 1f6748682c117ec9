package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/sim"
)

// The readings log's parts: kettle serve --log in front of Kafka (deploy/
// kafka's three KRaft nodes on 127.0.46.1-3), kettle serve --role writer
// ×2 into PostgreSQL, kettle swarm against the front, the audit after the
// writers drained the log.

const (
	logDevices  = 1000
	logInterval = 2 * time.Second // fleet rate: 500 readings/s
)

// logRig is one run's processes.
type logRig struct {
	kafka   *kafkatest.Cluster
	pg      *pgCluster
	front   *serveProc
	writers []*serveProc
	dir     string
	data    string
	url     string
	dsn     string
}

func startLogRig(ctx context.Context, e *env, name string, writers int) (*logRig, error) {
	r := &logRig{dir: filepath.Join(e.out, name)}
	os.RemoveAll(r.dir)
	r.data = filepath.Join(r.dir, "data")
	os.MkdirAll(r.data, 0o755)
	start := time.Now()
	kc, err := kafkatest.Start(filepath.Join(r.dir, "kafka"), kafkatest.Options{})
	if err != nil {
		return r, err
	}
	r.kafka = kc
	e.logf("%s: kafka up in %.1fs on %v", name, time.Since(start).Seconds(), kc.Brokers)
	if r.pg, err = startPG(); err != nil {
		return r, fmt.Errorf("start PostgreSQL: %w", err)
	}
	dsn, err := r.pg.createDB("chaos_" + strings.ReplaceAll(name, "-", "_"))
	if err != nil {
		return r, err
	}
	r.dsn = dsn
	r.url = kc.URL("kettle.readings")
	logArgs := []string{"--log", r.url, "--log-monitor-every", "1s"}
	for i := range writers {
		addr, err := freeAddr()
		if err != nil {
			return r, err
		}
		w, err := startServe(ctx, e, addr, r.data, dsn, filepath.Join(r.dir, fmt.Sprintf("writer%d.log", i+1)), slices.Concat([]string{"--role", "writer"}, logArgs, kc.Args(kafkatest.Writer))...)
		if err != nil {
			return r, err
		}
		r.writers = append(r.writers, w)
	}
	addr, err := freeAddr()
	if err != nil {
		return r, err
	}
	r.front, err = startServe(ctx, e, addr, r.data, dsn, filepath.Join(r.dir, "front.log"), slices.Concat([]string{"--cache-refresh", "1s"}, logArgs, kc.Args(kafkatest.Front))...)
	return r, err
}

func (r *logRig) close() {
	if r.front != nil {
		r.front.stop()
	}
	for _, w := range r.writers {
		w.stop()
	}
	if r.kafka != nil {
		r.kafka.Stop()
	}
	if r.pg != nil {
		r.pg.close()
	}
}

// swarm runs the fleet against the front for d, auditing after a live
// writer says the log is drained.
func (r *logRig) swarm(e *env, d time.Duration, auditAfter string) (*swarmProc, error) {
	return startSwarm(e, r.front.url, filepath.Join(r.dir, "swarm"), "--devices", fmt.Sprint(logDevices), "--interval", logInterval.String(),
		"--duration", d.String(), "--api", "v1", "--data-dir", r.data, "--conns", "per-device", "--audit-after", auditAfter+"/drained")
}

// lagSampler reads the front's kettle_log_lag_records (summed over
// partitions) every second.
type lagSampler struct {
	mu    sync.Mutex
	at    []time.Time
	lag   []float64
	every *sampler
}

func sampleLag(url string) *lagSampler {
	s := &lagSampler{}
	s.every = everySecond(func() {
		if txt, err := metricsText(url); err == nil {
			s.mu.Lock()
			s.at = append(s.at, time.Now())
			s.lag = append(s.lag, metricSum(txt, "kettle_log_lag_records"))
			s.mu.Unlock()
		}
	})
	return s
}

func (s *lagSampler) end() { s.every.end() }

// peakAfter is the largest lag from t on and when it was seen.
func (s *lagSampler) peakAfter(t time.Time) (float64, time.Time) {
	var peak float64
	var at time.Time
	for i, a := range s.at {
		if a.After(t) && s.lag[i] >= peak {
			peak, at = s.lag[i], a
		}
	}
	return peak, at
}

// drainedAfter is the first sample after t whose lag is at most level.
func (s *lagSampler) drainedAfter(t time.Time, level float64) (time.Time, bool) {
	for i, a := range s.at {
		if a.After(t) && s.lag[i] <= level {
			return a, true
		}
	}
	return time.Time{}, false
}

// ingestRefused counts the swarm's upload answers that were not 2xx.
func ingestRefused(res *sim.Results) (refused int64, byKind map[string]int64) {
	byKind = map[string]int64{}
	for _, s := range res.Seconds {
		if ep := s.Endpoints[sim.EPMeasurement]; ep != nil {
			for k, n := range ep.Errors {
				refused += n
				byKind[k] += n
			}
		}
	}
	return refused, byKind
}

// statsCount is GET /v1/statistics' measurement_count.
func statsCount(url, token string) (int64, error) {
	req, _ := http.NewRequest("GET", url+"/v1/statistics", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	var s struct {
		MeasurementCount int64 `json:"measurement_count"`
	}
	if res.StatusCode != 200 {
		return 0, fmt.Errorf("GET /v1/statistics: %s", res.Status)
	}
	err = json.NewDecoder(res.Body).Decode(&s)
	return s.MeasurementCount, err
}

// auditAndCount judges the audit and checks, in the database itself, that
// no reading is stored twice (rows = distinct (device, time)) and that the
// statistics count each stored reading once (measurement_count = rows).
func auditAndCount(r *Result, rig *logRig, res *sim.Results, code int, logPath string) {
	a := res.Audit
	if a == nil {
		r.fail("no audit (swarm exit %d): %s", code, tail(logPath, 2))
		return
	}
	r.measure("audit: %s", a.Line())
	if a.Lost > 0 || a.Duplicated > 0 {
		r.fail("audit: %d lost, %d duplicated (e.g. %v)", a.Lost, a.Duplicated, a.Examples)
	}
	n, err := statsCount(rig.front.url, readSecret(rig.data, "operator-token"))
	if err != nil {
		r.fail("statistics: %v", err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, rig.dsn)
	if err != nil {
		r.fail("count rows: %v", err)
		return
	}
	defer conn.Close(ctx)
	var rows, distinct int64
	if err := conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT (device, t)) FROM measurements`).Scan(&rows, &distinct); err != nil {
		r.fail("count rows: %v", err)
		return
	}
	r.measure("store: %d rows, %d distinct (device, time); statistics: measurement_count %d", rows, distinct, n)
	if rows != distinct {
		r.fail("%d readings stored more than once", rows-distinct)
	}
	if n != rows {
		r.fail("the statistics count %d readings, the store holds %d", n, rows)
	}
}

// partLogOutage (a): PostgreSQL stopped 60 s under the fleet: kettles keep
// getting 200 (the log acknowledges), the lag rises and then drains at ≥ 5×
// the fleet's rate, the audit is clean.
func partLogOutage(ctx context.Context, e *env) *Result {
	const before, outage, duration = 20 * time.Second, 60 * time.Second, 150 * time.Second
	fleetRate := float64(logDevices) / logInterval.Seconds()
	r := &Result{Pass: true, Done: fmt.Sprintf("kettle serve --log (Kafka ×3, RF 3, min ISR 2) with 2 writers into PostgreSQL; kettle swarm (%d v1 kettles, every %s = %.0f readings/s, %s); %s in, PostgreSQL stopped (pg_ctl stop -m fast) for %s; the front's kettle_log_lag_records sampled every second; audit after the writers drained the log.",
		logDevices, logInterval, fleetRate, duration, before, outage)}
	rig, err := startLogRig(ctx, e, "log-outage", 2)
	defer rig.close()
	if err != nil {
		return r.fail("%v", err)
	}
	lag := sampleLag(rig.front.url)
	sw, err := rig.swarm(e, duration, rig.writers[0].url)
	if err != nil {
		lag.end()
		return r.fail("%v", err)
	}
	sleep(ctx, before)
	e.logf("log-outage: pg_ctl stop -m fast")
	if err := rig.pg.stop(); err != nil {
		r.fail("stop PostgreSQL: %v", err)
	}
	stopped := time.Now()
	sleep(ctx, outage)
	e.logf("log-outage: pg_ctl start")
	if err := rig.pg.start(); err != nil {
		r.fail("start PostgreSQL again: %v", err)
	}
	started := time.Now()
	res, code, err := sw.wait(ctx, duration+6*time.Minute)
	lag.end()
	if err != nil {
		return r.fail("swarm: %v", err)
	}
	refused, kinds := ingestRefused(res)
	r.measure("uploads: %d requests, %d readings acknowledged, %d refused or failed %v", res.Totals.Endpoints[sim.EPMeasurement].Requests, res.Totals.Acked, refused, kinds)
	if refused > 0 {
		r.fail("%d uploads refused or failed while PostgreSQL was away (want 0)", refused)
	}
	peak, peakAt := lag.peakAfter(stopped)
	drainedAt, drained := lag.drainedAfter(peakAt, fleetRate*2)
	r.measure("lag: peak %.0f records %.0fs after the stop (%.0fs after PostgreSQL was back)", peak, peakAt.Sub(stopped).Seconds(), peakAt.Sub(started).Seconds())
	if peak < fleetRate*outage.Seconds()/2 {
		r.fail("the lag peaked at %.0f, less than half of what %s of the fleet sends (%.0f): the outage did not reach the writers?", peak, outage, fleetRate*outage.Seconds())
	}
	if !drained {
		r.fail("the lag did not drain (to ≤ 2 s of the fleet's readings) before the end of the run")
	} else {
		secs := max(drainedAt.Sub(peakAt).Seconds(), 1)
		rate := peak/secs + fleetRate
		r.measure("drained to ≤ %.0f records in %.0fs: written at %.0f readings/s = %.1f× the fleet's %.0f/s", fleetRate*2, secs, rate, rate/fleetRate, fleetRate)
		if rate < 5*fleetRate {
			r.fail("drain rate %.0f readings/s < 5× the fleet's rate (%.0f)", rate, 5*fleetRate)
		}
	}
	auditAndCount(r, rig, res, code, sw.logPath)
	if r.Pass {
		r.Verdict = fmt.Sprintf("0 of %d uploads refused during a %s PostgreSQL outage; lag peaked at %.0f and drained; audit clean", res.Totals.Endpoints[sim.EPMeasurement].Requests, outage, peak)
	}
	return r
}

// partLogWriter (c): kill -9 one of two writers under the fleet: the other
// takes its partitions after the session timeout and writes from the last
// committed offsets; 0 lost, 0 duplicated in the store and the statistics.
func partLogWriter(ctx context.Context, e *env) *Result {
	const before, duration = 30 * time.Second, 90 * time.Second
	r := &Result{Pass: true, Done: fmt.Sprintf("kettle serve --log with 2 writers (batches of up to 16,000 readings); kettle swarm (%d v1 kettles every %s, %s); %s in, writer 1 killed with SIGKILL (whatever batch it was writing is abandoned, its offsets uncommitted); audit after writer 2 drained the log; statistics compared with the audit.", logDevices, logInterval, duration, before)}
	rig, err := startLogRig(ctx, e, "log-writer", 2)
	defer rig.close()
	if err != nil {
		return r.fail("%v", err)
	}
	lag := sampleLag(rig.front.url)
	sw, err := rig.swarm(e, duration, rig.writers[1].url)
	if err != nil {
		lag.end()
		return r.fail("%v", err)
	}
	sleep(ctx, before)
	w1, _ := metricsText(rig.writers[0].url)
	e.logf("log-writer: kill -9 writer 1 (it had written %.0f readings)", metricSum(w1, "kettle_log_written_readings_total"))
	rig.writers[0].kill9()
	killed := time.Now()
	res, code, err := sw.wait(ctx, duration+6*time.Minute)
	lag.end()
	if err != nil {
		return r.fail("swarm: %v", err)
	}
	peak, peakAt := lag.peakAfter(killed)
	r.measure("lag after the kill: peak %.0f records %.0fs after it (writer 2 takes the partitions after the 10 s session timeout)", peak, peakAt.Sub(killed).Seconds())
	w2, _ := metricsText(rig.writers[1].url)
	r.measure("writer 2: %.0f readings written, %.0f duplicates (the dead writer's uncommitted batch written again, stored once)", metricSum(w2, "kettle_log_written_readings_total"), metricSum(w2, "kettle_log_writer_duplicates_total"))
	auditAndCount(r, rig, res, code, sw.logPath)
	if r.Pass {
		r.Verdict = "writer killed mid-run: 0 lost, 0 duplicated, statistics count each reading once"
	}
	return r
}
