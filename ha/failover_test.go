package ha_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/sim"
)

// TestHA runs kettle swarm (v1 and v0) through HAProxy to two kettle serve
// nodes on a three-member Patroni cluster and, mid-run, kills the primary's
// postmaster and its Patroni together (kill -9, as when its machine dies),
// then starts the old primary again. With KETTLE_HA_LONG set it goes on with
// a planned switchover, a rolling restart of both nodes, a node killed -9,
// and the loss of one and then both standbys.
func TestHA(t *testing.T) {
	tp := up(t, 2)
	if !tlsOff {
		checkTLS(tp)
	}
	metricsExist(t, tp.client(), patroni(1, "/metrics"), "patroni_primary{", "patroni_sync_standby{", "patroni_replica{", "patroni_postgres_timeline{",
		"patroni_postgres_running{", "patroni_xlog_location{", "patroni_xlog_replayed_location{")
	metricsExist(t, http.DefaultClient, "http://"+haNet+".30:8404/metrics", `haproxy_backend_active_servers{proxy="kettle_nodes"}`, `haproxy_backend_active_servers{proxy="kettle_nodes_live"}`,
		`haproxy_server_status{proxy="kettle_nodes",server="kettle1",state="UP"}`)
	run := 70 * time.Second
	if long {
		run = 260 * time.Second
	}
	v1 := tp.swarm("v1", 300, run)
	v0 := tp.swarm("v0", 100, run)
	var mq *swarm
	if long {
		// MQTT kettles through HAProxy (TCP) to the nodes' embedded listeners.
		mq = tp.swarm("v1", 100, run, "--protocol", "mqtt", "--mqtt-target", haNet+".30:1883")
	}
	swarmStart := time.Now()
	dev := newProbeDevice(tp.readFile("secret"))
	ingest := startProbe(100*time.Millisecond, 20*time.Second, dev.reading(time.Now().Add(-time.Hour)))
	polls := startProbe(100*time.Millisecond, 5*time.Second, dev.command())
	node1 := "http://" + haNet + ".21:8080"
	ready := startProbe(250*time.Millisecond, 5*time.Second, func(int) *http.Request {
		r, _ := http.NewRequest("GET", node1+"/readyz", nil)
		return r
	})
	defer func() { ingest.close(); polls.close(); ready.close() }()
	devices := 300 + 100 + 1 // v1, v0, the probe
	if mq != nil {
		devices += 100
	}
	steady := tp.waitReporting(t, node1, devices, 2)

	var windows []window

	// Unplanned failover.
	old := tp.leader()
	nodes := []string{node1, "http://" + haNet + ".22:8080"}
	pollsBefore := serverPolls(t, nodes...)
	kill := time.Now()
	tp.must(30*time.Second, "kill", old)
	// The kill's effect: uploads start failing (a transaction already in
	// flight may still commit) …
	down := ingest.waitFailed(t, kill, 15*time.Second, "uploads after the primary was killed")
	// … until a standby has taken over and the first commit after the kill.
	back := ingest.waitOK(t, down, 90*time.Second, "an upload after the primary was killed")
	gap := back.Sub(kill)
	figure(t, "failover_no_writable_primary", gap.Seconds(), "s")
	during := ingest.between(kill, back)
	newLeader := tp.leader()
	t.Logf("failover: killed %s (postmaster and Patroni, -9); uploads until the first commit after it: %s; new primary %s", old, counts(during), newLeader)
	if newLeader == old {
		t.Errorf("failover: %s still the leader after the kill", old)
	}
	var slowest time.Duration
	for _, s := range during {
		slowest = max(slowest, s.done.Sub(s.at))
		if s.status/100 != 2 && (s.status != 503 || s.retry == "") {
			t.Errorf("failover: an upload was answered %d (Retry-After %q), want 503 with Retry-After while no primary is writable", s.status, s.retry)
		}
	}
	figure(t, "failover_slowest_upload_answer", slowest.Seconds(), "s")
	// /readyz is judged until the new primary accepts connections: from
	// then on the node may rightly say ready while commits still wait for
	// a standby to stream from it (synchronous_mode_strict; a standby that
	// had received more of the dead primary's WAL must pg_rewind first).
	until := back
	if promoted, _ := firstLine(tp.memberLogs(kill, back), "database system is ready to accept connections"); !promoted.IsZero() && promoted.Before(until) {
		until = promoted
	}
	rd := ready.between(down.Add(time.Second), until.Add(-time.Second))
	t.Logf("failover: node 1 /readyz while no primary was writable (until the new one accepted connections, %.1fs after the kill): %s", until.Sub(kill).Seconds(), counts(rd))
	if n := countStatus(rd, 200); n > 0 || len(rd) == 0 {
		t.Errorf("failover: node 1's /readyz said ready %d of %d times while no primary was writable", n, len(rd))
	}
	windows = append(windows, window{"failover", kill, back})
	tp.timeline(t, "failover", kill.Add(-time.Second), back.Add(time.Second), ingest.between(kill.Add(-time.Second), back.Add(time.Second)))
	tp.must(30*time.Second, "start", old)
	rejoin := tp.waitHealthy(2 * time.Minute)
	pollsFailover := serverPolls(t, nodes...).minus(pollsBefore)
	figure(t, "failover_old_primary_rejoined", rejoin.Seconds(), "s")
	log, _ := os.ReadFile(filepath.Join(tp.dir, old+".log"))
	t.Logf("failover: %s rejoined as a standby %.1fs after it was started again (pg_rewind ran: %v); three members again", old, rejoin.Seconds(), strings.Contains(string(log), "pg_rewind"))

	pollsEnd := time.Now().Add(time.Hour)
	if long {
		windows = append(windows, switchover(t, tp, ingest))
		windows = append(windows, rollingRestart(t, tp))
		windows = append(windows, nodeKill(t, tp))
		// With no standby, uploads wait for the statement timeout, and a
		// kettle's poll waits for its upload: polls are judged before.
		pollsEnd = standbyLoss(t, tp, ingest)
	}

	r1 := v1.results(t, run+3*time.Minute-time.Since(swarmStart))
	r0 := v0.results(t, time.Minute)
	checkAudit(t, "v1", r1)
	checkAudit(t, "v0", r0)
	if mq != nil {
		rm := mq.results(t, time.Minute)
		checkAudit(t, "mqtt", rm)
		t.Logf("mqtt kettles: %d connections lost and redialed, %d commands received", rm.Totals.ConnsLost, rm.Totals.CommandsReceived)
		figure(t, "mqtt_conns_lost", float64(rm.Totals.ConnsLost), "connections")
	}
	for _, w := range windows {
		n1, k1 := swarmErrors(r1, w.from, w.to)
		n0, k0 := swarmErrors(r0, w.from, w.to)
		t.Logf("%s: kettles saw %d errors (v1 %v, v0 %v) from %s to %s", w.name, n1+n0, k1, k0, w.from.Format("15:04:05.0"), w.to.Format("15:04:05.0"))
		figure(t, w.name+"_kettle_errors", float64(n1+n0), "requests")
		if w.name == "rolling_restart" && n1+n0 > 0 {
			t.Errorf("rolling restart: kettles saw %d errors, want 0", n1+n0)
		}
	}
	for _, w := range append([]window{{"before", steady, kill}, {"without_primary", kill, back}}, append(windows[1:], window{"after", back, time.Now()})...) {
		for _, r := range []struct {
			name string
			res  *sim.Results
		}{{"v1", r1}, {"v0", r0}} {
			p, n := swarmP99(r.res, "command", w.from, w.to)
			t.Logf("polls %s, %s: p99 %.1f ms of %d", r.name, strings.ReplaceAll(w.name, "_", " "), p.Seconds()*1000, n)
		}
		t.Logf("probe polls %s: p99 %.1f ms, %s", w.name, p99(polls.between(w.from, w.to)).Seconds()*1000, counts(polls.between(w.from, w.to)))
	}
	slowSeconds(t, "v1", r1, steady, pollsEnd)
	slowSeconds(t, "v0", r0, steady, pollsEnd)
	logSlowest(t, "probe polls", polls.between(steady, pollsEnd), 5)
	// The dashboard's and the audit's history reads went to the replica.
	node := scrape(t, http.DefaultClient, node1+"/metrics")
	metricsExist(t, http.DefaultClient, node1+"/metrics", "kettle_pg_read_replica_lag_seconds ", "kettle_pg_read_replica_max_lag_seconds ", `kettle_pg_read_replica_reads_total{target="replica"}`)
	for _, l := range strings.Split(node, "\n") {
		if strings.HasPrefix(l, "kettle_pg_read_replica") {
			t.Logf("node 1: %s", l)
		}
	}
	// Polls answer from memory throughout. The bound is fixed, not taken
	// from this run's p99 before the kill (a noisy run would loosen its own
	// bound): 100 ms under make chaos's failover part, which runs alone;
	// 1 s under make test, which runs this beside every other package on
	// two cores: a fifth of --store-timeout, so still the bound that tells
	// "answered from memory" from "waited on the database".
	//
	// The server is judged by its own clock: the nodes' request-duration
	// histograms of the poll routes, from the kill until the old primary
	// rejoined. The kettles' p99 over every second is a figure only: a
	// simulated kettle does one exchange at a time, so a poll that comes
	// due while its own upload is still out (a commit held for the
	// synchronous standby, a backlog of v0 readings sent one by one after
	// the failover), or while a swarm starved of CPU falls behind, is sent
	// late and its latency counts from when it came due (a late start).
	// Those seconds measure the uploads and the swarm's machine, not the
	// polls: the kettles' polls are judged over the seconds without late
	// starts, and by the probe, a kettle of the test's own that only polls,
	// on its own connection.
	for _, r := range []struct {
		name string
		res  *sim.Results
	}{{"v1", r1}, {"v0", r0}} {
		limit := 100 * time.Millisecond
		if !long {
			limit = fleet.DefaultStoreTimeout / 5
		}
		h := pollsFailover[r.name]
		over, n := h.over(t, limit)
		figure(t, "polls_server_p99_bound_failover_"+r.name, h.quantileBound(0.99).Seconds()*1000, "ms")
		t.Logf("server: %s polls from the kill until the old primary rejoined: %d, %d over %s", r.name, n, over, limit)
		if n == 0 || over*100 > n {
			t.Errorf("server: %d of %d %s polls took over %s from the kill until the old primary rejoined (%s), want ≤ 1 %%", over, n, r.name, limit, h)
		}
		before, _ := swarmP99(r.res, "command", steady, kill)
		whole, _ := swarmP99(r.res, "command", steady, pollsEnd)
		onTime, _, late := swarmP99OnTime(r.res, "command", steady, pollsEnd)
		failover, _ := swarmP99(r.res, "command", kill, back.Add(5*time.Second))
		figure(t, "polls_p99_"+r.name, whole.Seconds()*1000, "ms")
		figure(t, "polls_p99_no_late_starts_"+r.name, onTime.Seconds()*1000, "ms")
		figure(t, "polls_seconds_with_late_starts_"+r.name, float64(late), "s")
		figure(t, "polls_p99_failover_"+r.name, failover.Seconds()*1000, "ms")
		if onTime > limit {
			t.Errorf("%s polls p99 %s over the seconds without late starts (%d seconds had some; over all: %s), want ≤ %s (%s before the kill)", r.name, onTime, late, whole, limit, before)
		}
	}
	probeP99 := p99(polls.between(steady, pollsEnd))
	figure(t, "polls_p99_probe", probeP99.Seconds()*1000, "ms")
	if limit := 100 * time.Millisecond; long && probeP99 > limit {
		t.Errorf("probe polls p99 %s over the run, want ≤ %s", probeP99, limit)
	}
	if n := len(polls.samples) - countStatus(polls.samples, 200); n > 0 {
		t.Errorf("probe polls: %d of %d not 200 (%s)", n, len(polls.samples), counts(polls.samples))
	}
	checkNoLeaks(t, tp, nil)
}

func countStatus(ss []sample, status int) int {
	n := 0
	for _, s := range ss {
		if s.status == status {
			n++
		}
	}
	return n
}

// pollHist is the poll routes' kettle_http_request_duration_seconds summed
// over nodes and status classes: the count at or under each bucket's upper
// bound, and in all.
type pollHist struct {
	le map[float64]uint64
	n  uint64
}

// pollsByAPI is a pollHist by API ("v1", "v0").
type pollsByAPI map[string]pollHist

// pollRoutes are the poll routes by API.
var pollRoutes = map[string]string{"GET /v1/command": "v1", "GET /command": "v0"}

// serverPolls reads the poll histograms of each node's /metrics, by API.
func serverPolls(t *testing.T, nodes ...string) pollsByAPI {
	t.Helper()
	out := pollsByAPI{}
	for _, node := range nodes {
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(strings.NewReader(scrape(t, http.DefaultClient, node+"/metrics")))
		if err != nil {
			t.Fatalf("%s/metrics: %v", node, err)
		}
		for _, m := range fams["kettle_http_request_duration_seconds"].GetMetric() {
			var api string
			for _, l := range m.GetLabel() {
				if l.GetName() == "route" {
					api = pollRoutes[l.GetValue()]
				}
			}
			if api == "" {
				continue
			}
			h := out[api]
			if h.le == nil {
				h.le = map[float64]uint64{}
			}
			for _, b := range m.GetHistogram().GetBucket() {
				h.le[b.GetUpperBound()] += b.GetCumulativeCount()
			}
			h.n += m.GetHistogram().GetSampleCount()
			out[api] = h
		}
	}
	return out
}

// sub is the histogram of the polls since b.
func (a pollHist) sub(b pollHist) pollHist {
	d := pollHist{le: map[float64]uint64{}, n: a.n - b.n}
	for le, c := range a.le {
		d.le[le] = c - b.le[le]
	}
	return d
}

// minus is each API's histogram of the polls since before (a node that
// restarted in between would make it wrong: none does).
func (m pollsByAPI) minus(before pollsByAPI) pollsByAPI {
	d := pollsByAPI{}
	for api, h := range m {
		d[api] = h.sub(before[api])
	}
	return d
}

// over is how many polls took longer than limit (a bucket's upper bound),
// and how many there were.
func (h pollHist) over(t *testing.T, limit time.Duration) (uint64, uint64) {
	t.Helper()
	under, ok := h.le[limit.Seconds()]
	if !ok && h.n > 0 {
		t.Fatalf("%s is no bucket bound of kettle_http_request_duration_seconds (%v)", limit, h)
	}
	return h.n - under, h.n
}

// quantileBound is the upper bound of the bucket that holds quantile q.
func (h pollHist) quantileBound(q float64) time.Duration {
	les := slices.Sorted(maps.Keys(h.le))
	for _, le := range les {
		if float64(h.le[le]) >= q*float64(h.n) {
			return time.Duration(le * float64(time.Second))
		}
	}
	return time.Duration(math.MaxInt64)
}

func (h pollHist) String() string {
	les := slices.Sorted(maps.Keys(h.le))
	var b strings.Builder
	for _, le := range les {
		fmt.Fprintf(&b, "≤%gs %d, ", le, h.le[le])
	}
	fmt.Fprintf(&b, "all %d", h.n)
	return b.String()
}

// waitReporting waits until the statistics through node count devices
// kettles reporting (each stored a reading), then until rounds more
// readings a kettle are stored: every kettle runs at its rate. It returns
// when the last of them first reported.
func (tp *topo) waitReporting(t *testing.T, node string, devices, rounds int) time.Time {
	t.Helper()
	var st struct {
		Measurements int64 `json:"measurement_count"`
		Reporting    int64 `json:"devices_reporting"`
	}
	token := tp.readFile("operator-token")
	hc := &http.Client{Timeout: 5 * time.Second}
	read := func() {
		st.Measurements, st.Reporting = 0, 0
		r, _ := http.NewRequest("GET", node+"/v1/statistics", nil)
		r.Header.Set("Authorization", "Bearer "+token)
		if resp, err := hc.Do(r); err == nil {
			json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
		}
	}
	deadline := time.Now().Add(2 * time.Minute)
	wait := func(what string, ok func() bool) {
		t.Helper()
		if !testkit.Poll(time.Until(deadline), 250*time.Millisecond, func() bool { read(); return ok() }) {
			t.Fatalf("%s: not within 2 min (%d kettles reporting, %d readings stored)", what, st.Reporting, st.Measurements)
		}
	}
	wait(fmt.Sprintf("%d kettles reporting", devices), func() bool { return st.Reporting >= int64(devices) })
	all, stored := time.Now(), st.Measurements
	wait(fmt.Sprintf("%d more readings a kettle", rounds), func() bool { return st.Measurements >= stored+int64(rounds*devices) })
	t.Logf("%d kettles reporting, and %d more readings a kettle %.1fs later (%d stored)", devices, rounds, time.Since(all).Seconds(), st.Measurements)
	return all
}
