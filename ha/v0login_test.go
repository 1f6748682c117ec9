package ha_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
)

// v0Kettle is a client that is not ours: the case-study protocol as its
// firmware speaks it — POST /login, then a reading every 50 ms with the id
// it got in servant-auth-cookie — through HAProxy, which sends each request
// to the next node (round robin). On 503 it waits for Retry-After (at most
// a second) and sends the same reading again; on 401 it logs in again, as
// the firmware does (a new identity, its history orphaned): the test
// counts those.
type v0Kettle struct {
	hc     *http.Client
	status *v0Counts
}

// v0Counts are the answers the foreign kettles got, by status (0: no
// answer), and the readings acknowledged.
type v0Counts struct {
	mu    sync.Mutex
	by    map[int]int
	acked atomic.Int64
}

func (c *v0Counts) add(status int) {
	c.mu.Lock()
	if c.by == nil {
		c.by = map[int]int{}
	}
	c.by[status]++
	c.mu.Unlock()
}

func (c *v0Counts) get(status int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.by[status]
}

func (c *v0Counts) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ss []sample
	for st, n := range c.by {
		for range n {
			ss = append(ss, sample{status: st})
		}
	}
	return counts(ss)
}

// send makes one request and returns its status and Retry-After (0 status:
// no answer).
func (k *v0Kettle) send(method, path, id, body string) (int, string, string) {
	r, _ := http.NewRequest(method, balancer+path, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	if id != "" {
		r.Header.Set("servant-auth-cookie", id)
	}
	res, err := k.hc.Do(r)
	if err != nil {
		k.status.add(0)
		return 0, "", ""
	}
	b, _ := io.ReadAll(io.LimitReader(res.Body, 4096))
	res.Body.Close()
	k.status.add(res.StatusCode)
	return res.StatusCode, res.Header.Get("Retry-After"), string(b)
}

// backoff waits after a refusal: Retry-After (capped at 1 s), or 100 ms
// without an answer; false once stop is closed.
func backoff(retry string, stop <-chan struct{}) bool {
	d := 100 * time.Millisecond
	if retry != "" {
		d = time.Second
	}
	select {
	case <-stop:
		return false
	case <-time.After(d):
		return true
	}
}

// login registers until it gets an id (or stop).
func (k *v0Kettle) login(stop <-chan struct{}) string {
	for {
		st, retry, body := k.send("POST", "/login", "", `{"username":"kettle"}`)
		var out struct{ Username string }
		if st == 200 && json.Unmarshal([]byte(body), &out) == nil && out.Username != "" {
			return out.Username
		}
		if !backoff(retry, stop) {
			return ""
		}
	}
}

// run logs in and sends readings readings 50 ms apart (each until it is
// acknowledged), then logs in again as a new kettle, until stop, or once
// when once is set.
func (k *v0Kettle) run(readings int, once bool, stop <-chan struct{}) {
	for {
		id := k.login(stop)
		if id == "" {
			return
		}
		t0 := time.Now().UTC().Add(-time.Hour)
		for i := 0; i < readings; {
			at := t0.Add(time.Duration(i) * time.Second).Format(time.RFC3339Nano)
			body := fmt.Sprintf(`{"id":7,"time":%q,"charge_now":50,"charge_full":100,"charge_rate":1,"ambient_temp":20,"water_temp":60,"water_level":700}`, at)
			switch st, retry, _ := k.send("POST", "/measurement", id, body); st {
			case 200:
				k.status.acked.Add(1)
				i++
				k.send("GET", "/command", id, "")
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
			case 401:
				if id = k.login(stop); id == "" {
					return
				}
			default:
				if !backoff(retry, stop) {
					return
				}
			}
		}
		if once {
			return
		}
	}
}

// v0Fleet runs n foreign kettles (kettle.run) at once.
func v0Fleet(n, readings int, once bool, stop <-chan struct{}) (*v0Counts, *sync.WaitGroup) {
	c := &v0Counts{}
	var wg sync.WaitGroup
	for range n {
		k := &v0Kettle{hc: &http.Client{Timeout: 10 * time.Second}, status: c}
		wg.Go(func() { k.run(readings, once, stop) })
	}
	return c, &wg
}

// TestV0LoginRoundRobin: case-study kettles that are not ours log in
// through HAProxy and send their readings at once, so that the login and
// the next requests go to different nodes. Neither node answers 401 to a
// kettle the fleet registered, in steady state and while the primary is
// killed (-9, as when its machine dies) and a standby takes over; an id
// the fleet never issued is still 401 on each node.
func TestV0LoginRoundRobin(t *testing.T) {
	tp := up(t, 2)
	nodes := []string{"http://" + haNet + ".21:8080", "http://" + haNet + ".22:8080"}
	never := func(when string) {
		t.Helper()
		k := &v0Kettle{hc: &http.Client{Timeout: 10 * time.Second}, status: &v0Counts{}}
		for _, n := range nodes {
			r, _ := http.NewRequest("GET", n+"/command", nil)
			r.Header.Set("servant-auth-cookie", uuid.NewString())
			res, err := k.hc.Do(r)
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			res.Body.Close()
			if res.StatusCode != 401 {
				t.Errorf("%s: an id never issued answered %d by %s, want 401", when, res.StatusCode, n)
			}
		}
	}
	never("before")

	// Steady state: 30 kettles log in and send 20 readings each, at once.
	steady, wg := v0Fleet(30, 20, true, nil)
	wg.Wait()
	t.Logf("steady: 30 foreign kettles, 20 readings each: %s; %d readings acknowledged", steady, steady.acked.Load())
	figure(t, "v0_roundrobin_steady_401", float64(steady.get(401)), "answers")
	if n := steady.get(401); n > 0 {
		t.Errorf("steady: %d answers 401 to kettles the fleet registered, want 0", n)
	}
	found := 0.0
	for _, n := range nodes {
		found += metricOf(t, n, `kettle_device_lookups_total{kind="found"}`)
	}
	if found == 0 {
		t.Error("no node looked a kettle up: did HAProxy send the readings to the node of the login?")
	}
	t.Logf("steady: ids looked up in the store by the nodes: %v", found)

	// Failover: kettles keep logging in and sending while the primary is
	// killed, until readings are acknowledged under the new one, and 3 s
	// more.
	stop := make(chan struct{})
	during, wg := v0Fleet(30, 10, false, stop)
	for end := time.Now().Add(30 * time.Second); during.acked.Load() < 60 && time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
	}
	old := tp.leader()
	kill := time.Now()
	tp.must(30*time.Second, "kill", old)
	// The first readings acknowledged after a standby took over.
	var back time.Time
	for end := time.Now().Add(90 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		if l, err := tp.cmd(10*time.Second, "leader"); err == nil && l != "" && l != old {
			base := during.acked.Load()
			for ; time.Now().Before(end) && during.acked.Load() < base+30; time.Sleep(50 * time.Millisecond) {
			}
			if during.acked.Load() >= base+30 {
				back = time.Now()
			}
			break
		}
	}
	if back.IsZero() {
		t.Fatalf("failover: no new leader and readings acknowledged under it within 90 s of the kill of %s (%s)", old, during)
	}
	// Under the new primary as long as before the kill: 60 more readings
	// acknowledged, every kettle round-robin over both nodes again.
	for end, after := time.Now().Add(30*time.Second), during.acked.Load(); during.acked.Load() < after+60; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("failover: 60 readings more not acknowledged within 30 s of the first under the new primary (%s)", during)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("failover: killed %s; foreign kettles from 2 s before until 60 readings after the first acknowledged after it (%.1fs): %s; %d readings acknowledged",
		old, back.Sub(kill).Seconds(), during, during.acked.Load())
	figure(t, "v0_roundrobin_failover_401", float64(during.get(401)), "answers")
	if n := during.get(401); n > 0 {
		t.Errorf("failover: %d answers 401 to kettles the fleet registered, want 0", n)
	}
	never("after the failover")
}

// metricOf reads one series from a node's /metrics (0 if absent).
func metricOf(t *testing.T, node, series string) float64 {
	t.Helper()
	for _, l := range strings.Split(scrape(t, http.DefaultClient, node+"/metrics"), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}
