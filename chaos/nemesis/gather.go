package nemesis

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet/httpapi"
)

// What the checker reads from the running system: the statistics served
// and recomputed, the members' rows, the overrides' fate.

// ServedStats is GET /v1/statistics (open range) from base.
func ServedStats(ctx context.Context, base, operator string) (httpapi.StatsJSON, error) {
	var s httpapi.StatsJSON
	err := call(ctx, http.DefaultClient, "GET", base+"/v1/statistics", operator, nil, &s)
	return s, err
}

// RecomputeStats computes the six statistics from the measurement rows
// themselves (not the rollups and totals the store serves them from), on
// the database dsn; reporting counts devices whose last_seen is within
// window of the database's clock.
func RecomputeStats(ctx context.Context, dsn string, window time.Duration) (httpapi.StatsJSON, error) {
	var s httpapi.StatsJSON
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return s, fmt.Errorf("recompute statistics: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return s, fmt.Errorf("recompute statistics: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	err = tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM measurements), (SELECT count(*) FROM devices),
		(SELECT count(*) FROM devices WHERE last_seen >= now() - make_interval(secs => $1))`, window.Seconds()).
		Scan(&s.MeasurementCount, &s.DevicesRegistered, &s.DevicesReporting)
	if err != nil {
		return s, fmt.Errorf("recompute statistics 1-2: %w", err)
	}
	s.RangeCount = s.MeasurementCount
	err = tx.QueryRow(ctx, `SELECT coalesce(sum(charge_mwh), 0), coalesce(sum(level_ml), 0), coalesce(sum((water_c - ambient_c) * level_ml), 0)
		FROM (SELECT DISTINCT ON (device) * FROM measurements ORDER BY device, t DESC) latest`).
		Scan(&s.TotalChargeMWh, &s.TotalWaterML, &s.TotalPotentialCmL)
	if err != nil {
		return s, fmt.Errorf("recompute statistics 3, 4, 6: %w", err)
	}
	s.ByHour = make([]httpapi.HourJSON, 24)
	for h := range s.ByHour {
		s.ByHour[h].Hour = h
	}
	rows, _ := tx.Query(ctx, `SELECT extract(hour FROM t AT TIME ZONE 'UTC')::int, count(*),
		avg(water_c), coalesce(stddev_pop(water_c), 0), avg(ambient_c), coalesce(stddev_pop(ambient_c), 0)
		FROM measurements GROUP BY 1`)
	for rows.Next() {
		var h httpapi.HourJSON
		if err := rows.Scan(&h.Hour, &h.Count, &h.Water.Mean, &h.Water.Stddev, &h.Ambient.Mean, &h.Ambient.Stddev); err != nil {
			return s, fmt.Errorf("recompute statistic 5: %w", err)
		}
		s.ByHour[h.Hour] = h
	}
	if err := rows.Err(); err != nil {
		return s, fmt.Errorf("recompute statistic 5: %w", err)
	}
	return s, nil
}

// MemberDSNs splits a multi-host DSN (deploy/cluster.sh dsn) into one DSN
// per member, in its order, each taking whatever role the member has.
func MemberDSNs(multi string) ([]string, error) {
	u, err := url.Parse(multi)
	if err != nil {
		return nil, fmt.Errorf("member DSNs: %w", err)
	}
	q := u.Query()
	q.Set("target_session_attrs", "any")
	u.RawQuery = q.Encode()
	var out []string
	for _, h := range strings.Split(u.Host, ",") {
		m := *u
		m.Host = h
		out = append(out, m.String())
	}
	return out, nil
}

// memberSQL is the count and a digest of every measurement row, in key
// order, values included: two members agree only on the same rows.
const memberSQL = `SELECT count(*), coalesce(md5(string_agg(device::text || ' ' || (extract(epoch FROM t) * 1000000)::bigint || ' ' ||
	charge_mwh || ' ' || full_mwh || ' ' || rate_mw || ' ' || ambient_c || ' ' || water_c || ' ' || level_ml, ',' ORDER BY device, t)), '')
	FROM measurements`

// ReadMember reads one member's rows.
func ReadMember(ctx context.Context, name, dsn string) Member {
	m := Member{Name: name}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		m.Err = err.Error()
		return m
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := conn.QueryRow(ctx, memberSQL).Scan(&m.Rows, &m.Checksum); err != nil {
		m.Err = err.Error()
	}
	return m
}

// WaitMembers reads every member until they agree (standbys catch up after
// the faults) or limit passes, and returns the last reading.
func WaitMembers(ctx context.Context, names, dsns []string, limit time.Duration) []Member {
	end := time.Now().Add(limit)
	for {
		ms := make([]Member, len(dsns))
		for i := range dsns {
			ms[i] = ReadMember(ctx, names[i], dsns[i])
		}
		if Members(ms).Pass || time.Now().After(end) || ctx.Err() != nil {
			return ms
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// OverrideDriver is an operator during the run: it sets an override on one
// of its kettles every period, each with its own flush rate, and once the
// operator is answered 200, polls as that kettle every second until the
// command carries the rate (or MaxWait passes).
type OverrideDriver struct {
	base, operator string
	hc             *http.Client
	devs           []struct{ ID, Token string }
	mu             sync.Mutex
	done           []Override
	refused        map[string]int64 // operator requests not answered 200, by status
	acked          atomic.Int64     // overrides acknowledged so far
	wg             sync.WaitGroup
	cancel         context.CancelFunc
}

// OverrideMaxWait bounds how long an acknowledged override may take to
// reach its kettle's polls before it counts as never delivered (a
// variable for the tests of this package).
var OverrideMaxWait = 60 * time.Second

// StartOverrides provisions kettles devices at base and drives overrides
// on them until Stop.
func StartOverrides(ctx context.Context, base, operator string, kettles int, period time.Duration) (*OverrideDriver, error) {
	d := &OverrideDriver{base: base, operator: operator, hc: &http.Client{Timeout: 10 * time.Second}, refused: map[string]int64{}}
	var r struct {
		Devices []struct{ ID, Token string } `json:"devices"`
	}
	for try := 0; ; try++ {
		err := call(ctx, d.hc, "POST", base+"/v1/devices", operator, fmt.Appendf(nil, `{"count":%d}`, kettles), &r)
		if err == nil {
			break
		}
		if try == 20 || ctx.Err() != nil {
			return nil, fmt.Errorf("override driver: provision %d kettles: %w", kettles, err)
		}
		time.Sleep(time.Second)
	}
	d.devs = r.Devices
	ctx, d.cancel = context.WithCancel(ctx)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			dev := d.devs[i%len(d.devs)]
			// Unique per override, within the API's 0…1000.
			flush := float64(1+i%900) + 0.25
			body := fmt.Appendf(nil, `{"flush_ml_per_s":%g,"expires_at":%q}`, flush, time.Now().Add(3*time.Hour).UTC().Format(time.RFC3339))
			err := call(ctx, d.hc, "PUT", base+"/v1/devices/"+dev.ID+"/override", operator, body, nil)
			if err != nil && ctx.Err() != nil {
				return // stopped mid-request: neither acknowledged nor refused
			}
			if err != nil {
				d.mu.Lock()
				d.refused[statusOf(err)]++
				d.mu.Unlock()
				continue
			}
			o := Override{Device: dev.ID, Flush: flush, AckedAt: time.Now()}
			d.acked.Add(1)
			d.wg.Add(1)
			go func() {
				defer d.wg.Done()
				d.follow(ctx, dev.Token, o)
			}()
		}
	}()
	return d, nil
}

// follow polls as the kettle until its command carries o.
func (d *OverrideDriver) follow(ctx context.Context, token string, o Override) {
	// The wait outlives Stop's cancel: an override acknowledged just
	// before the end is still followed to its kettle.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), OverrideMaxWait)
	defer cancel()
	for polls := 1; ctx.Err() == nil; polls++ {
		var c struct {
			FlushMLPerS float64 `json:"flush_ml_per_s"`
			PollAfterS  int     `json:"poll_after_s"`
		}
		err := call(ctx, d.hc, "GET", d.base+"/v1/command", token, nil, &c)
		if err == nil && o.PollAfter == 0 {
			o.PollAfter = time.Duration(c.PollAfterS) * time.Second
		}
		if err == nil && c.FlushMLPerS == o.Flush {
			o.Polls, o.Delay = polls, time.Since(o.AckedAt)
			break
		} else if err == nil && c.FlushMLPerS > o.Flush {
			// a later override of the same kettle already landed: this
			// one was delivered and replaced
			o.Polls, o.Delay = polls, time.Since(o.AckedAt)
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	d.mu.Lock()
	d.done = append(d.done, o)
	d.mu.Unlock()
}

// Acked is how many overrides the node has acknowledged so far.
func (d *OverrideDriver) Acked() int64 { return d.acked.Load() }

// Stop ends the driver, waits for the overrides still being followed, and
// returns every acknowledged override and the operator requests refused.
func (d *OverrideDriver) Stop() ([]Override, map[string]int64) {
	d.cancel()
	d.wg.Wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.done, d.refused
}

type statusErr struct {
	code int
	body string
}

func (e *statusErr) Error() string { return fmt.Sprintf("HTTP %d: %s", e.code, e.body) }

func statusOf(err error) string {
	if se, ok := err.(*statusErr); ok {
		return fmt.Sprint(se.code)
	}
	return "no answer"
}

// call is one JSON request with a bearer token; a non-2xx is a *statusErr.
func call(ctx context.Context, hc *http.Client, method, u, token string, body []byte, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		return &statusErr{resp.StatusCode, strings.TrimSpace(string(b[:min(len(b), 200)]))}
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}
