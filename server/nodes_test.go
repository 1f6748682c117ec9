package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/internal/blackhole"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/wire"
)

// TestTwoNodesOneDatabase: two kettle serve nodes on one PostgreSQL give the
// same answers: a reading taken by node A and an override set on node A
// reach node B's command polls (its cache refreshes from the store), and
// statistics agree.
func TestTwoNodesOneDatabase(t *testing.T) {
	dsn := pgtest.Start(t)
	secret := "shared-secret-0123456789"
	mod := func(c *server.Config) {
		c.Secret, c.OperatorToken = secret, "operator-token-test"
		c.Ingest = fleet.Config{Refresh: 200 * time.Millisecond}
	}
	a, b := start(t, dsn, mod), start(t, dsn, mod)
	ca, cb := newClient(t, a), newClient(t, b)
	id := uuid.New()
	tok := bearer(kettle.DeviceToken([]byte(secret), id))
	// Low battery on node A: the policy says charge.
	body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":5,"battery_full_mwh":100,"battery_rate_mw":-1,"ambient_temp_c":20,"water_temp_c":50,"water_level_ml":950}`, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339))
	if r := ca.do("POST", "/v1/measurements", tok, body); r.status != 200 {
		t.Fatalf("node A upload: %d %s", r.status, r.body)
	}
	eventually := func(what string, ok func(wire.CommandJSON) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			var c wire.CommandJSON
			cb.do("GET", "/v1/command", tok, "").json(t, &c)
			if ok(c) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("node B never saw %s: %+v", what, c)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	eventually("node A's reading", func(c wire.CommandJSON) bool {
		return c.Charge && c.Reason != "" && !contains(c.Reason, "no reading")
	})
	exp := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	if r := ca.do("PUT", "/v1/devices/"+id.String()+"/override", bearer("operator-token-test"), fmt.Sprintf(`{"charge":false,"expires_at":%q}`, exp)); r.status != 200 {
		t.Fatalf("override on A: %d %s", r.status, r.body)
	}
	eventually("node A's override", func(c wire.CommandJSON) bool { return !c.Charge && contains(c.Reason, "override") })
	if r := ca.do("DELETE", "/v1/devices/"+id.String()+"/override", bearer("operator-token-test"), ""); r.status != 204 {
		t.Fatalf("clear on A: %d", r.status)
	}
	eventually("the override cleared on A", func(c wire.CommandJSON) bool { return c.Charge })
	var sa, sb httpapi.StatsJSON
	ca.do("GET", "/v1/statistics", bearer("operator-token-test"), "").json(t, &sa)
	cb.do("GET", "/v1/statistics", bearer("operator-token-test"), "").json(t, &sb)
	ja, _ := json.Marshal(sa)
	jb, _ := json.Marshal(sb)
	if sa.MeasurementCount != 1 || string(ja) != string(jb) {
		t.Errorf("statistics differ between nodes:\n%+v\n%+v", sa, sb)
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// TestCacheRefreshOnlyWhileOthersWrite: a node alone on its PostgreSQL
// database does not rescan the devices every --cache-refresh (one refresh at
// its first beat, then none); a process that beats and writes (as kettle
// seed and other nodes do) makes it refresh, so its polls answer with what
// the other wrote; once the other has stopped beating for three intervals,
// the node refreshes once more and pauses again. Another's last beat is seen
// however often or seldom either beats.
func TestCacheRefreshOnlyWhileOthersWrite(t *testing.T) {
	dsn := pgtest.Start(t)
	const secret, every = "shared-secret-0123456789", 100 * time.Millisecond
	a := start(t, dsn, func(c *server.Config) {
		c.Secret, c.OperatorToken = secret, "operator-token-test"
		c.Ingest = fleet.Config{Refresh: every}
	})
	refreshes := func() float64 { return metricValue(t, a, "kettle_cache_refreshes_total") }
	failedBeats := func() float64 { return metricValue(t, a, "kettle_cache_refresh_beats_failed_total") }
	// The database server's periodic work is on /metrics (kettle capacity
	// reads it to say whether a step held any).
	if v := metricValue(t, a, "kettle_pg_checkpoint_timeout_seconds"); v <= 0 {
		t.Errorf("kettle_pg_checkpoint_timeout_seconds %v", v)
	}
	// The test cluster's role may list pg_wal: the segment being written
	// (numbered from 1) is there too.
	if v := metricValue(t, a, "kettle_pg_wal_segment"); v < 1 {
		t.Errorf("kettle_pg_wal_segment %v (absent?)", v)
	}
	db, beats, peers := watchNode(t, dsn, a)
	// Alone: over 15 beats, the first beat's refresh (and the failed beats').
	beats(15, "alone")
	peers(0, "alone")
	// A beat has a window of `every` to answer; on a loaded machine one can
	// miss it, and the node refreshes then to be safe: one refresh more for
	// each failed beat (read after the refreshes, so it counts every
	// failure whose refresh they count).
	if n, f := refreshes(), failedBeats(); n < 1 || n > 1+f {
		t.Fatalf("alone for 15 beats of %s: %v refreshes; want 1 (and one more for each of the %v failed beats)", every, n, f)
	}
	alone := refreshes()

	// Another process beats and writes a low-battery reading.
	other, err := postgres.Open(context.Background(), dsn, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	otherID := uuid.New()
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			if _, err := other.Beat(ctx, otherID, "test", every/2); err != nil && ctx.Err() == nil {
				t.Errorf("beat: %v", err)
			}
			time.Sleep(every / 2)
		}
	})
	defer func() { stop(); wg.Wait() }()
	dev := uuid.New()
	if _, err := other.Write(context.Background(), []kettle.Measurement{{Device: dev, Time: time.Now().Add(-time.Minute).UTC().Truncate(time.Second),
		ChargeMWh: 5, FullMWh: 100, RateMW: -1, AmbientC: 20, WaterC: 50, LevelML: 950}}, time.Now()); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, a)
	tok := bearer(kettle.DeviceToken([]byte(secret), dev))
	deadline := time.Now().Add(5 * time.Second)
	for {
		var cmd wire.CommandJSON
		c.do("GET", "/v1/command", tok, "").json(t, &cmd)
		if cmd.Charge && !contains(cmd.Reason, "no reading") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the node never saw the other process's reading: %+v (refreshes %v, peers %v)", cmd, refreshes(), metricValue(t, a, "kettle_cache_refresh_peers"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if p := metricValue(t, a, "kettle_cache_refresh_peers"); p != 1 {
		t.Errorf("peers while the other beats: %v, want 1", p)
	}

	// The other stops: three intervals after its last beat the node sees
	// it gone, refreshes once more (for the other's last writes) and pauses.
	stop()
	wg.Wait()
	peers(0, "the other stopped")
	beats(1, "after the other stopped") // the refresh after the beat that saw it gone is done
	before, failedBefore := refreshes(), failedBeats()
	if before <= alone {
		t.Errorf("refreshes while the other wrote: %v, no more than the %v of before", before, alone)
	}
	beats(15, "alone again")
	// At most one refresh of a beat that failed as the count began.
	if n, f := refreshes(), failedBeats(); n-before > f-failedBefore+1 {
		t.Errorf("alone again: %v refreshes in 15 beats (from %v), want one for each of the %v failed beats (and one at the start)", n-before, before, f-failedBefore)
	}

	// One beat of a process that beats often (its window 3 × the longer of
	// its 10 ms and this node's 100 ms) is seen by this node's next beat if
	// that comes within 300 ms: then the node refreshes before the beat
	// after.
	// A next beat later than that (a loaded machine) sees nothing and
	// proves nothing: the other beats again.
	for attempt := 1; ; attempt++ {
		before = refreshes()
		if _, err := other.Beat(context.Background(), uuid.New(), "test", 10*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		// This node's first beat whose transaction began after the other's
		// committed (seen_at is the transaction's start), then one more:
		// the refresh in between is done.
		var beatAt, committed time.Time
		if err := db.QueryRow(context.Background(), `SELECT max(seen_at), now() FROM nodes WHERE kind = 'test'`).Scan(&beatAt, &committed); err != nil {
			t.Fatal(err)
		}
		next := beats(1, "after the other's beat")
		for !next.After(committed) {
			next = beats(1, "after the other's beat")
		}
		beats(1, "after the refresh")
		if next.Sub(beatAt) < 300*time.Millisecond {
			if n := refreshes(); n <= before {
				t.Errorf("no refresh after the beat of a process that beats every 10ms, seen %s later (%v refreshes before and after)", next.Sub(beatAt), n)
			}
			break
		}
		if attempt == 20 {
			t.Fatalf("in 20 attempts this node never beat within 300 ms of the other's beat (last %s)", next.Sub(beatAt))
		}
	}
	peers(0, "the frequent beater gone")

	// A process that beats seldom counts as writing between its beats,
	// however often this node beats: still there 10 beats (1 s) later,
	// past the window a 100 ms beater would have.
	if _, err := other.Beat(context.Background(), uuid.New(), "test", time.Minute); err != nil {
		t.Fatal(err)
	}
	peers(1, "a process that beats every minute")
	beats(10, "beside a process that beats every minute")
	peers(1, "10 beats beside a process that beats every minute")
}

// TestCacheRefreshWhileOldVersionsConnected: kettle versions from before the
// nodes table write without beating; while a connection named as theirs
// ("kettle") is open to the database, a node counts one peer and refreshes
// (a rolling upgrade), and stops once it closes.
func TestCacheRefreshWhileOldVersionsConnected(t *testing.T) {
	dsn := pgtest.Start(t)
	const every = 100 * time.Millisecond
	a := start(t, dsn, func(c *server.Config) {
		c.Secret, c.OperatorToken = "nodes-secret-0123456789", "nodes-operator-0123456789"
		c.Ingest = fleet.Config{Refresh: every}
	})
	refreshes := func() float64 { return metricValue(t, a, "kettle_cache_refreshes_total") }
	failedBeats := func() float64 { return metricValue(t, a, "kettle_cache_refresh_beats_failed_total") }
	_, beats, waitPeers := watchNode(t, dsn, a)
	// Alone (its own connections not counted): 0 peers at a beat that
	// answered.
	beats(3, "alone")
	waitPeers(0, "alone (its own connections counted?)")
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "kettle"
	old, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Waited for, not slept on: beats run late on a loaded machine.
	before := refreshes()
	peers := func() float64 { return metricValue(t, a, "kettle_cache_refresh_peers") }
	waitFor(t, func() bool { return peers() == 1 && refreshes() >= before+3 },
		"with an old version's connection open: 1 peer and a refresh a beat")
	old.Close(context.Background())
	waitFor(t, func() bool { return peers() == 0 }, "the old version's connection closed: 0 peers")
	// The beat that saw it gone refreshes once more (for the old version's
	// last writes); then the refreshes pause.
	beats(1, "after the old version's connection closed")
	before, failedBefore := refreshes(), failedBeats()
	beats(20, "alone again")
	waitPeers(0, "alone again")
	if n, f := refreshes(), failedBeats(); n-before > f-failedBefore+1 {
		t.Errorf("after the old version's connection closed: %v refreshes in 20 beats, want at most one, and one for each of the %v failed beats", n-before, f-failedBefore)
	}
}

// TestV0LoginOnAnotherNode: a case-study kettle that logs in on node A and
// sends its first reading and poll to node B at once (a round-robin
// balancer) is answered 200 by B, which has not refreshed its cache since
// (--cache-refresh 1h here): B looks the id up in the store. An id never
// issued is still 401, on both nodes, and again from B's memory of it. With
// B's database unreachable (a proxy that stops forwarding), an id B has not
// seen is 503 + Retry-After — the store cannot say — never 401; once it
// forwards again, 200.
func TestV0LoginOnAnotherNode(t *testing.T) {
	dsn := pgtest.Start(t)
	network, target := blackhole.Target(dsn)
	bh, err := blackhole.Listen("127.0.0.1:0", network, target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bh.Close)
	mod := func(c *server.Config) {
		c.Ingest = fleet.Config{Refresh: time.Hour, StoreTimeout: time.Second}
	}
	a, b := start(t, dsn, mod), start(t, blackhole.Via(dsn, bh.Addr()), mod)
	ca, cb := newClient(t, a), newClient(t, b)
	now := time.Now().UTC()
	post := func(c *client, id string, i int) resp {
		t.Helper()
		return c.do("POST", "/measurement", cookie(id), v0Body(now.Add(time.Duration(i)*time.Second), 5, 100, -1, 20, 50, 90))
	}
	f := func(r resp, what string, want int) {
		t.Helper()
		if r.status != want {
			t.Errorf("%s: %d %s, want %d", what, r.status, r.body, want)
		}
		if want == 503 && r.status == 503 && r.header.Get("Retry-After") == "" {
			t.Errorf("%s: 503 without Retry-After", what)
		}
	}
	for i := range 5 {
		id := login(t, ca)
		f(post(cb, id, i), "a reading on B right after the login on A", 200)
		f(cb.do("GET", "/command", cookie(id), ""), "a poll on B right after the login on A", 200)
	}
	never := uuid.NewString()
	f(post(ca, never, 0), "an id never issued, on A", 401)
	f(post(cb, never, 0), "an id never issued, on B", 401)
	f(cb.do("GET", "/command", cookie(never), ""), "an id never issued, on B again", 401)
	if v := metricValue(t, b, `kettle_device_lookups_total{kind="found"}`); v != 5 {
		t.Errorf(`B's kettle_device_lookups_total{kind="found"} = %v, want 5`, v)
	}
	if v := metricValue(t, b, "kettle_device_lookups_avoided_total"); v != 1 {
		t.Errorf("B's kettle_device_lookups_avoided_total = %v, want 1 (the second use of the id never issued)", v)
	}

	id := login(t, ca)
	bh.Block(true)
	f(post(cb, id, 0), "a reading on B, its database unreachable, right after the login on A", 503)
	f(cb.do("GET", "/command", cookie(id), ""), "a poll on B, its database unreachable, right after the login on A", 503)
	f(post(cb, uuid.NewString(), 0), "an id never issued, on B, its database unreachable", 503)
	f(post(cb, never, 1), "an id B remembers as never issued, its database unreachable", 401)
	bh.Block(false)
	waitFor(t, func() bool { return post(cb, id, 0).status == 200 }, "a reading on B once its database is reachable again")
}

// watchNode watches a node through the nodes table, on a connection of
// its own to the database (db, not a kettle's: no peer). beats returns once the node has beaten n times more (its
// seen_at moved n times), with the seen_at of the first of them. peers
// waits for the node's count of other writers (-1, a failed beat, passes
// on).
func watchNode(t *testing.T, dsn string, a *server.Server) (db *pgx.Conn, beats func(n int, what string) time.Time, peers func(want float64, what string)) {
	db, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close(context.Background()) })
	seenAt := func() time.Time {
		t.Helper()
		var at time.Time
		if err := db.QueryRow(context.Background(), `SELECT coalesce(max(seen_at), 'epoch') FROM nodes WHERE kind = 'serve'`).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}
	beats = func(n int, what string) (first time.Time) {
		t.Helper()
		last := seenAt()
		seen := 0
		counted := func() bool {
			if at := seenAt(); !at.Equal(last) {
				if seen == 0 {
					first = at
				}
				seen, last = seen+1, at
			}
			return seen >= n
		}
		if !testkit.Poll(60*time.Second, 10*time.Millisecond, counted) {
			t.Fatalf("%s: the node beat %d times in 60 s, want %d", what, seen, n)
		}
		return first
	}
	peers = func(want float64, what string) {
		t.Helper()
		var p float64
		if !testkit.Poll(30*time.Second, 10*time.Millisecond, func() bool {
			n, _, _ := a.Service().RefreshStats() // what kettle_cache_refresh_peers shows, without a scrape every 10 ms
			p = float64(n)
			return p == want
		}) {
			t.Fatalf("%s: peers %v for 30 s, want %v", what, p, want)
		}
	}
	return db, beats, peers
}
