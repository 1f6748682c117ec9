package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
	"github.com/kettlefleet/kettlefleet/wire/wiretest"
)

// fakeServer implements the wire contract of kettle serve in memory. It is
// the edge the sim unit tests stand on; the end-to-end proof is a run against
// the real server (see the report of issue 4).
type fakeServer struct {
	secret   []byte
	operator string
	// fault, if set, is asked for every measurement upload (n counts them
	// from 1): 0 = answer normally, 503 = refuse with Retry-After: 1,
	// 500 = store, then answer 500 (an ack lost after commit).
	fault func(n int64) int
	delay time.Duration // before answering an upload
	// cacheControl, if set, is the Cache-Control of every v1 command answer.
	cacheControl string
	polls        atomic.Int64

	uploads  atomic.Int64
	mu       sync.Mutex
	stored   map[uuid.UUID][]int64 // device → device times (µs), as a store would keep them
	loggedIn map[string]bool
}

func newFake(t *testing.T) (*fakeServer, *httptest.Server) {
	f := &fakeServer{secret: []byte("s3cret"), operator: "op", stored: map[uuid.UUID][]int64{}, loggedIn: map[string]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /login", func(w http.ResponseWriter, r *http.Request) {
		id := uuid.New()
		f.mu.Lock()
		f.loggedIn[id.String()] = true
		f.mu.Unlock()
		writeJSON(w, 200, map[string]string{"username": id.String()})
	})
	v0 := func(r *http.Request) (uuid.UUID, bool) {
		c := r.Header.Get("servant-auth-cookie")
		f.mu.Lock()
		defer f.mu.Unlock()
		return uuid.MustParse(orNil(c)), f.loggedIn[c]
	}
	v1 := func(r *http.Request) (uuid.UUID, bool) {
		return kettle.VerifyDeviceToken(f.secret, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
	}
	upload := func(w http.ResponseWriter, id uuid.UUID, times []int64, v1 bool) {
		n := f.uploads.Add(1)
		time.Sleep(f.delay)
		fault := 0
		if f.fault != nil {
			fault = f.fault(n)
		}
		if fault == 503 {
			w.Header().Set("Retry-After", "1")
			writeJSON(w, 503, map[string]string{"error": "unavailable", "message": "queue full"})
			return
		}
		f.mu.Lock()
		dups := 0
		for _, t := range times {
			if slices.Contains(f.stored[id], t) {
				dups++
				continue
			}
			f.stored[id] = append(f.stored[id], t)
		}
		f.mu.Unlock()
		if fault != 0 {
			writeJSON(w, fault, map[string]string{"error": "internal"})
			return
		}
		if v1 {
			writeJSON(w, 200, map[string]int{"stored": len(times) - dups, "duplicates": dups})
		} else {
			writeJSON(w, 200, []int{})
		}
	}
	mux.HandleFunc("POST /measurement", func(w http.ResponseWriter, r *http.Request) {
		id, ok := v0(r)
		if !ok {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		var m struct {
			Time time.Time `json:"time"`
		}
		if err := json.NewDecoder(r.Body).Decode(&m); err != nil {
			writeJSON(w, 400, map[string]string{"error": "invalid"})
			return
		}
		upload(w, id, []int64{m.Time.UnixMicro()}, false)
	})
	mux.HandleFunc("GET /command", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := v0(r); !ok {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		io.WriteString(w, `{"charge":"ChargeBattery","fill":"NoFillReservoir","flush":{"tag":"FlushReservoir","contents":10}}`)
	})
	mux.HandleFunc("POST /v1/measurements", func(w http.ResponseWriter, r *http.Request) {
		id, ok := v1(r)
		if !ok {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		body, _ := io.ReadAll(r.Body)
		var ms []kettle.Measurement
		var one struct {
			Time time.Time `json:"time"`
		}
		if len(body) > 0 && body[0] == '[' {
			var arr []struct {
				Time time.Time `json:"time"`
			}
			if err := json.Unmarshal(body, &arr); err != nil {
				writeJSON(w, 400, map[string]string{"error": "invalid"})
				return
			}
			for _, a := range arr {
				ms = append(ms, kettle.Measurement{Time: a.Time})
			}
		} else if err := json.Unmarshal(body, &one); err != nil {
			writeJSON(w, 400, map[string]string{"error": "invalid", "message": err.Error()})
			return
		} else {
			ms = append(ms, kettle.Measurement{Time: one.Time})
		}
		times := make([]int64, len(ms))
		for i, m := range ms {
			times[i] = m.Time.UnixMicro()
		}
		upload(w, id, times, true)
	})
	mux.HandleFunc("GET /v1/command", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := v1(r); !ok {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		f.polls.Add(1)
		if f.cacheControl != "" {
			w.Header().Set("Cache-Control", f.cacheControl)
		}
		if r.Header.Get("If-None-Match") == `"c1"` {
			w.WriteHeader(304)
			return
		}
		w.Header().Set("ETag", `"c1"`)
		writeJSON(w, 200, map[string]any{"charge": false, "fill": true, "flush_ml_per_s": 0, "reason": "fake", "poll_after_s": 30})
	})
	operator := func(r *http.Request) bool { return r.Header.Get("Authorization") == "Bearer "+f.operator }
	mux.HandleFunc("POST /v1/devices", func(w http.ResponseWriter, r *http.Request) {
		if !operator(r) {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		var req struct{ Count int }
		json.NewDecoder(r.Body).Decode(&req)
		type dev struct {
			ID    uuid.UUID `json:"id"`
			Token string    `json:"token"`
		}
		var out struct {
			Devices []dev `json:"devices"`
		}
		for range req.Count {
			id := uuid.New()
			out.Devices = append(out.Devices, dev{id, kettle.DeviceToken(f.secret, id)})
		}
		writeJSON(w, 201, out)
	})
	mux.HandleFunc("GET /v1/devices/{id}/measurements", func(w http.ResponseWriter, r *http.Request) {
		if !operator(r) {
			writeJSON(w, 401, map[string]string{"error": "unauthorized"})
			return
		}
		id := uuid.MustParse(r.PathValue("id"))
		q := r.URL.Query()
		from, _ := time.Parse(time.RFC3339Nano, q.Get("from"))
		to, _ := time.Parse(time.RFC3339Nano, q.Get("to"))
		after := int64(-1 << 62)
		if a := q.Get("after"); a != "" {
			at, _ := time.Parse(time.RFC3339Nano, a)
			after = at.UnixMicro()
		}
		limit, _ := strconv.Atoi(q.Get("limit"))
		f.mu.Lock()
		ts := slices.Clone(f.stored[id])
		f.mu.Unlock()
		slices.Sort(ts)
		type row struct {
			Time string `json:"time"`
		}
		out := struct {
			Measurements []row  `json:"measurements"`
			Next         string `json:"next"`
		}{Measurements: []row{}}
		for _, t := range ts {
			if t < from.UnixMicro() || t >= to.UnixMicro() || t <= after {
				continue
			}
			if len(out.Measurements) == limit {
				out.Next = out.Measurements[limit-1].Time
				break
			}
			out.Measurements = append(out.Measurements, row{time.UnixMicro(t).UTC().Format(time.RFC3339Nano)})
		}
		writeJSON(w, 200, out)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return f, srv
}

func orNil(s string) string {
	if _, err := uuid.Parse(s); err != nil {
		return uuid.Nil.String()
	}
	return s
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func (f *fakeServer) storedCount() (n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ts := range f.stored {
		n += len(ts)
	}
	return n
}

func quick(target string) Config {
	return Config{
		TargetConfig:    TargetConfig{Target: target},
		FleetConfig:     FleetConfig{Devices: 50, Seed: 1},
		ScheduleConfig:  ScheduleConfig{Interval: 100 * time.Millisecond, Jitter: 10 * time.Millisecond, Duration: 1500 * time.Millisecond},
		TransportConfig: TransportConfig{Timeout: 2 * time.Second},
	}
}

func TestSwarmV1AuditsAgainstFake(t *testing.T) {
	f, srv := newFake(t)
	// Every 7th upload is refused, every 11th stored but its ack lost.
	f.fault = func(n int64) int {
		switch {
		case n%7 == 0:
			return 503
		case n%11 == 0:
			return 500
		}
		return 0
	}
	cfg := quick(srv.URL)
	cfg.Secret, cfg.Operator = f.secret, f.operator
	cfg.Batch = 2
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := res.Audit
	if a == nil || a.Acked == 0 || a.Lost != 0 || a.Duplicated != 0 || a.Stored != a.Acked {
		t.Fatalf("audit %+v, want every acked reading stored once", a)
	}
	tot := res.Totals
	if tot.ErrorsByKind["http_503"] == 0 || tot.ErrorsByKind["http_500"] == 0 {
		t.Errorf("errors %v, want the injected 503s and 500s counted", tot.ErrorsByKind)
	}
	if tot.DuplicatesReported == 0 || a.Unacked != 0 && a.Unacked > int64(f.storedCount()) {
		t.Errorf("duplicates reported %d: want the retries of lost acks seen as duplicates", tot.DuplicatesReported)
	}
	if got := int64(f.storedCount()); got < a.Acked {
		t.Errorf("server holds %d readings, fewer than the %d acked", got, a.Acked)
	}
	if tot.Acked != a.Acked {
		t.Errorf("totals acked %d, audit acked %d", tot.Acked, a.Acked)
	}
	if tot.Endpoints[EPCommand].Requests == 0 || len(res.Seconds) == 0 {
		t.Errorf("no command polls or no seconds recorded: %+v", tot)
	}
	// Only the first poll of a kettle gets a body; the rest are 304s.
	var s304 int64
	for _, s := range res.Seconds {
		if e := s.Endpoints[EPCommand]; e != nil {
			s304 += e.Status["304"]
		}
	}
	if s304 == 0 {
		t.Error("no 304 to If-None-Match")
	}
}

// A command answered with Cache-Control max-age is kept until then: the
// kettle polls again only after it (an overloaded server asks for that),
// while its readings keep being uploaded on schedule.
func TestSwarmHonorsCommandMaxAge(t *testing.T) {
	f, srv := newFake(t)
	f.cacheControl = "max-age=1"
	cfg := quick(srv.URL) // 50 kettles, a tick every 100 ms for 1.5 s
	cfg.Secret, cfg.Operator = f.secret, f.operator
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	// At most a first poll and one a second later per kettle (+1 for jitter),
	// instead of one per tick (~15).
	if n := f.polls.Load(); n == 0 || n > int64(3*cfg.Devices) {
		t.Errorf("%d polls for %d kettles over 1.5 s with max-age=1, want 1–3 each", n, cfg.Devices)
	}
	if d := res.Totals.PollsDeferred; d < int64(5*cfg.Devices) {
		t.Errorf("%d polls deferred, want most ticks' polls", d)
	}
	if a := res.Audit; a == nil || a.Acked == 0 || a.Lost != 0 || int64(f.storedCount()) < a.Acked {
		t.Errorf("audit %+v: uploads must go on while polls are deferred", a)
	}
	if maxAge("no-cache") != 0 || maxAge("private, max-age=12") != 12*time.Second || maxAge("max-age=x") != 0 {
		t.Error("maxAge parses Cache-Control wrong")
	}
}

func TestSwarmV0AgainstFake(t *testing.T) {
	f, srv := newFake(t)
	cfg := quick(srv.URL)
	cfg.API, cfg.Operator, cfg.HatchRate = "v0", f.operator, 40
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if e := res.Totals.Endpoints[EPLogin]; e == nil || e.Requests != int64(cfg.Devices) {
		t.Errorf("login endpoint %+v, want one login per kettle", e)
	}
	if a := res.Audit; a == nil || a.Acked == 0 || a.Lost != 0 || a.Duplicated != 0 {
		t.Fatalf("audit %+v", a)
	}
	if res.Totals.Errors != 0 {
		t.Errorf("errors %v", res.Totals.ErrorsByKind)
	}
	// Hatching at 40/s: the 50 kettles start over 1.25 s.
	if k := res.Seconds[0].Kettles; k >= cfg.Devices {
		t.Errorf("%d kettles after the first second, want a ramp", k)
	}
}

// A slow server must not lower the load: sends stay due on schedule, late
// ones are counted, and latency counts from the intended time.
func TestSwarmOpenModel(t *testing.T) {
	f, srv := newFake(t)
	f.delay = 300 * time.Millisecond
	cfg := quick(srv.URL)
	cfg.Devices, cfg.Secret, cfg.Operator = 5, f.secret, f.operator
	cfg.Duration = time.Second
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	tot := res.Totals
	if tot.LateStarts == 0 {
		t.Error("no late starts with a 300 ms server and a 100 ms interval")
	}
	if p := tot.Endpoints[EPMeasurement].P99Ms; p < 300 {
		t.Errorf("measurement p99 %.1f ms, want ≥ the server's 300 ms", p)
	}
	// A kettle's buffered readings go out in one batch, so all readings
	// still got acked or were pending at the end; none dropped.
	if tot.Acked+tot.Unacked != tot.Readings || tot.Dropped != 0 {
		t.Errorf("readings %d ≠ acked %d + unacked %d (dropped %d)", tot.Readings, tot.Acked, tot.Unacked, tot.Dropped)
	}
	if a := res.Audit; a.Lost != 0 || a.Duplicated != 0 {
		t.Errorf("audit %s", a.Line())
	}
}

func TestSwarmProvisionsWithOperatorToken(t *testing.T) {
	f, srv := newFake(t)
	cfg := quick(srv.URL)
	cfg.Operator, cfg.Conns = f.operator, 4
	cfg.Duration = 500 * time.Millisecond
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Params.Provisioning != "operator" || res.Params.ConnMode != "shared" || res.Totals.Dials > 8 {
		t.Errorf("params %+v dials %d", res.Params, res.Totals.Dials)
	}
	if a := res.Audit; a.Acked == 0 || a.Lost != 0 {
		t.Errorf("audit %s", a.Line())
	}
	// results.json round-trips and its histograms decode and merge.
	p, err := res.WriteFile(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	back, err := ReadResults(p)
	if err != nil {
		t.Fatal(err)
	}
	h, err := MergeHistograms(back, EPMeasurement)
	if err != nil {
		t.Fatal(err)
	}
	if h.TotalCount() != back.Totals.Endpoints[EPMeasurement].Requests {
		t.Errorf("merged per-second histograms hold %d, totals say %d", h.TotalCount(), back.Totals.Endpoints[EPMeasurement].Requests)
	}
}

func TestSwarmRefusesV1WithoutCredentials(t *testing.T) {
	_, srv := newFake(t)
	_, err := Run(context.Background(), quick(srv.URL))
	if err == nil || !strings.Contains(err.Error(), "--secret") {
		t.Fatalf("err %v, want a hint about --secret", err)
	}
}

func TestCheckLoopback(t *testing.T) {
	f := func(target string, ok bool) {
		t.Helper()
		_, err := CheckLoopback(target)
		if (err == nil) != ok {
			t.Errorf("%s: err %v, want ok=%v", target, err, ok)
		}
	}
	f("http://127.0.0.1:8080", true)
	f("http://127.3.4.5:80", true)
	f("http://localhost:8080", true)
	f("http://[::1]:8080", true)
	f("http://10.0.0.1:8080", false)
	f("http://example.com", false)
	f("http://0.0.0.0:8080", false)
	f("https://127.0.0.1", true)
	f("https://example.com", false)
	f("ftp://127.0.0.1", false)
	f("127.0.0.1:8080", false)
}

func TestCompare(t *testing.T) {
	f := func(acked, stored []int64, want string) {
		t.Helper()
		a, _ := Compare(acked, stored)
		if got := fmt.Sprintf("acked=%d stored=%d lost=%d dup=%d unacked=%d", a.Acked, a.Stored, a.Lost, a.Duplicated, a.Unacked); got != want {
			t.Errorf("Compare(%v, %v) = %s, want %s", acked, stored, got, want)
		}
	}
	f([]int64{1, 2, 3}, []int64{1, 2, 3}, "acked=3 stored=3 lost=0 dup=0 unacked=0")
	f([]int64{3, 1, 2}, []int64{2, 1}, "acked=3 stored=2 lost=1 dup=0 unacked=0")
	f([]int64{1, 2}, []int64{1, 1, 2, 5}, "acked=2 stored=2 lost=0 dup=1 unacked=1")
	f(nil, []int64{4}, "acked=0 stored=0 lost=0 dup=0 unacked=1")
	f([]int64{1, 1}, []int64{1}, "acked=1 stored=1 lost=0 dup=0 unacked=0")
}

// TestRoundTrip: what the simulator sends is what the server decodes — every
// good reading of the wire table, and a day of a model kettle's readings,
// one at a time and as batches, in both protocols.
func TestRoundTrip(t *testing.T) {
	f := func(ms []kettle.Measurement, api string) {
		t.Helper()
		body := appendUploadBody(nil, ms, api)
		var got []kettle.Measurement
		var err error
		if api == "v0" {
			var m kettle.Measurement
			m, err = wire.DecodeV0(body, ms[0].Device, wiretest.Win)
			got = []kettle.Measurement{m}
			ms = ms[:1]
		} else {
			got, err = wire.DecodeV1(body, ms[0].Device, wiretest.Win)
		}
		if err != nil || !slices.Equal(got, ms) {
			t.Errorf("%s %.80q: decoded %+v %v, want %+v", api, body, got, err, ms)
		}
	}
	for _, c := range wiretest.Cases {
		if c.Want != nil {
			f(c.Want, "v0")
			f(c.Want, "v1")
		}
	}
	rng := &pcg{}
	rng.Seed(1, 2)
	start := wiretest.Now.Add(-24 * time.Hour)
	m := NewModel(rng, start)
	var day []kettle.Measurement
	for i := range 2880 {
		m.Step(rng, start.Add(time.Duration(i+1)*30*time.Second))
		r := m.Reading()
		r.Device = wiretest.Device
		day = append(day, r)
	}
	for i := range day {
		f(day[i:i+1], "v0")
		f(day[i:i+1], "v1")
	}
	for i := 0; i < len(day); i += kettle.MaxBatch {
		f(day[i:min(i+kettle.MaxBatch, len(day))], "v1")
	}
}

// countingObserver records what the swarm reports to --metrics-addr.
type countingObserver struct {
	mu                       sync.Mutex
	offered, completed, errs map[string]int
	active, lagCalls         int
}

func (o *countingObserver) Offered(ep string) { o.mu.Lock(); o.offered[ep]++; o.mu.Unlock() }
func (o *countingObserver) Completed(ep string, status int, lat time.Duration) {
	o.mu.Lock()
	o.completed[ep]++
	o.mu.Unlock()
}
func (o *countingObserver) Error(ep, kind string) { o.mu.Lock(); o.errs[ep+" "+kind]++; o.mu.Unlock() }
func (o *countingObserver) SetActive(n int)       { o.mu.Lock(); o.active = n; o.mu.Unlock() }
func (o *countingObserver) SetLag(time.Duration)  { o.mu.Lock(); o.lagCalls++; o.mu.Unlock() }

// TestSwarmObserverAndOffered: the observer sees every request, and the
// per-second results count the offered load next to the completed one.
func TestSwarmObserverAndOffered(t *testing.T) {
	f, srv := newFake(t)
	f.fault = func(n int64) int {
		if n%5 == 0 {
			return 503
		}
		return 0
	}
	o := &countingObserver{offered: map[string]int{}, completed: map[string]int{}, errs: map[string]int{}}
	cfg := quick(srv.URL)
	cfg.Secret, cfg.NoAudit, cfg.Observer = f.secret, true, o
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	var offered, done int64
	for _, s := range res.Seconds {
		offered += s.Endpoints[EPCommand].Offered
		done += s.Endpoints[EPCommand].Requests
	}
	if offered == 0 || int64(o.offered[EPCommand]) != offered || done != res.Totals.Endpoints[EPCommand].Requests {
		t.Errorf("command offered %d (observer %d), completed %d of %d", offered, o.offered[EPCommand], done, res.Totals.Endpoints[EPCommand].Requests)
	}
	if int64(o.completed[EPMeasurement]) != res.Totals.Endpoints[EPMeasurement].Requests || o.errs[EPMeasurement+" http_503"] == 0 {
		t.Errorf("observer completed %v errors %v; totals %+v", o.completed, o.errs, res.Totals.Endpoints[EPMeasurement])
	}
	if o.active != cfg.Devices || o.lagCalls < len(res.Seconds) {
		t.Errorf("active %d (want %d), lag set %d times for %d seconds", o.active, cfg.Devices, o.lagCalls, len(res.Seconds))
	}
}

func TestParseSourceAddrs(t *testing.T) {
	f := func(in, want string) {
		t.Helper()
		ips, err := ParseSourceAddrs(in)
		got := strings.Join(ipStrings(ips), ",")
		if err != nil {
			got = "error"
		}
		if got != want {
			t.Errorf("ParseSourceAddrs(%q) = %s, want %s (err %v)", in, got, want, err)
		}
	}
	f("127.0.0.11", "127.0.0.11")
	f("127.0.0.11,127.0.0.12", "127.0.0.11,127.0.0.12")
	f("127.0.0.254-127.0.1.1", "127.0.0.254,127.0.0.255,127.0.1.0,127.0.1.1")
	f(" 127.0.0.2 , ", "127.0.0.2")
	f("10.0.0.1", "error")
	f("127.0.0.3-127.0.0.2", "error")
	f("::1", "error")
	f("", "error")
}

// TestDialerSourceAddrs: connections leave from the given source addresses,
// round-robin (a real listener sees them).
func TestDialerSourceAddrs(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	src, _ := ParseSourceAddrs("127.0.0.21-127.0.0.22")
	dial := dialer(ln.Addr().String(), src, 5*time.Second, nil)
	seen := map[string]int{}
	for range 4 {
		c, err := dial(nil)
		if err != nil {
			t.Fatal(err)
		}
		sc, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		seen[sc.RemoteAddr().(*net.TCPAddr).IP.String()]++
		sc.Close()
		c.Close()
	}
	if seen["127.0.0.21"] != 2 || seen["127.0.0.22"] != 2 {
		t.Errorf("source addresses seen %v, want 127.0.0.21 and 127.0.0.22 twice each", seen)
	}
}
