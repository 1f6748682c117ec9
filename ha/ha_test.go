package ha_test

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/sim"
)

// The address block of these tests (deploy/cluster.sh's KETTLE_HA_NET).
const haNet = "127.0.44"

var balancer = "http://" + haNet + ".30:8080"

// long is make chaos's longer run with every fault (KETTLE_HA_LONG=1).
var long = os.Getenv("KETTLE_HA_LONG") != ""

// topo is one deploy/cluster.sh topology.
type topo struct {
	t    *testing.T
	root string // module root
	dir  string // KETTLE_HA_DIR
	bin  string // the kettle binary
	pw   string // every database role's password
	env  []string
}

func figure(t *testing.T, name string, value float64, unit string) {
	t.Helper()
	t.Logf("figure: %s = %.6g %s", name, value, unit)
}

// up builds kettle, brings the topology up with nodes kettle serve nodes,
// and takes it down when the test ends.
func up(t *testing.T, nodes int, extraEnv ...string) *topo {
	t.Helper()
	root := testkit.Root()
	bin, err := testkit.BuildKettle(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// Short: PostgreSQL's socket path must fit in 107 bytes.
	dir, err := os.MkdirTemp("/tmp", "kha-")
	if err != nil {
		t.Fatal(err)
	}
	pw := uuid.NewString()
	tp := &topo{t: t, root: root, dir: dir, bin: bin, pw: pw}
	// Reads that tolerate lag go to a standby (--db-read), lag measured.
	read := fmt.Sprintf("postgres://kettle:%s@%[2]s.11:5432,%[2]s.12:5432,%[2]s.13:5432/kettle?target_session_attrs=prefer-standby&connect_timeout=2&%[3]s", pw, haNet, dsnTLS(dir))
	tp.env = append(os.Environ(), "KETTLE_HA_NET="+haNet, "KETTLE_HA_DIR="+dir, "KETTLE_BIN="+bin, fmt.Sprintf("KETTLE_HA_NODES=%d", nodes),
		// The read DSN holds the password: in the environment, not argv.
		"KETTLE_HA_PASSWORD="+pw, "KETTLE_DB_READ="+read, "KETTLE_HA_SERVE_ARGS=--access-log-sample 0")
	tp.env = append(tp.env, extraEnv...)
	t.Cleanup(func() {
		if t.Failed() {
			for _, f := range []string{"pg1.log", "pg2.log", "pg3.log", "kettle1.log", "kettle2.log", "haproxy.log"} {
				b, _ := os.ReadFile(filepath.Join(dir, f))
				lines := strings.Split(strings.TrimSpace(string(b)), "\n")
				t.Logf("--- last lines of %s:\n%s", f, strings.Join(lines[max(0, len(lines)-15):], "\n"))
			}
		}
		if out, err := tp.cmd(3*time.Minute, "down"); err != nil {
			t.Errorf("cluster.sh down: %v\n%s", err, out)
		}
	})
	start := time.Now()
	if out, err := tp.cmd(4*time.Minute, "up"); err != nil {
		t.Fatalf("deploy/cluster.sh up: %v\n%s", err, out)
	}
	figure(t, "topology_up", time.Since(start).Seconds(), "s")
	return tp
}

// tlsOff: the topology without TLS (KETTLE_HA_TLS=0, comparison runs).
var tlsOff = os.Getenv("KETTLE_HA_TLS") == "0"

// dsnTLS is a DSN's TLS parameters for the topology in dir, as
// cluster.sh dsn writes them: PostgreSQL takes TCP clients over TLS only.
func dsnTLS(dir string) string {
	if tlsOff {
		return "sslmode=disable"
	}
	return "sslmode=verify-full&sslrootcert=" + filepath.Join(dir, "tls", "ca.crt")
}

// patroni is member i's REST API URL for path.
func patroni(i int, path string) string {
	scheme := "https"
	if tlsOff {
		scheme = "http"
	}
	return fmt.Sprintf("%s://%s.1%d:8008%s", scheme, haNet, i, path)
}

// client trusts the topology's CA (the members' HTTPS).
func (tp *topo) client() *http.Client {
	if tlsOff {
		return http.DefaultClient
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(tp.readFile("tls/ca.crt"))) {
		tp.t.Fatalf("no CA in %s/tls/ca.crt", tp.dir)
	}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
}

// scrape returns the text of a /metrics page.
func scrape(t *testing.T, c *http.Client, url string) string {
	t.Helper()
	r, err := c.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer r.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(r.Body)
	return b.String()
}

// metricsExist fails for each series prefix (name and leading labels, as
// the alerts and the dashboard use them) the page lacks.
func metricsExist(t *testing.T, c *http.Client, url string, series ...string) {
	t.Helper()
	page := scrape(t, c, url)
	for _, s := range series {
		if !strings.Contains(page, "\n"+s) {
			t.Errorf("%s has no %s (deploy/prometheus/alerts.yml and the dashboard use it)", url, s)
		}
	}
}

// cmd runs deploy/cluster.sh args… within limit.
func (tp *topo) cmd(limit time.Duration, args ...string) (string, error) {
	return (&testkit.Cluster{T: tp.t, Env: tp.env}).Run(limit, args...)
}

func (tp *topo) must(limit time.Duration, args ...string) string {
	tp.t.Helper()
	return (&testkit.Cluster{T: tp.t, Env: tp.env}).Must(limit, args...)
}

func (tp *topo) leader() string { return tp.must(30*time.Second, "leader") }

// waitHealthy waits for a leader and two streaming standbys (one
// synchronous) and returns how long that took.
func (tp *topo) waitHealthy(limit time.Duration) time.Duration {
	tp.t.Helper()
	start := time.Now()
	for {
		if _, err := tp.cmd(10*time.Second, "healthy"); err == nil {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			out, _ := tp.cmd(30*time.Second, "status")
			tp.t.Fatalf("the Patroni cluster is not three healthy members %s after: \n%s", limit, out)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (tp *topo) readFile(name string) string {
	b, err := os.ReadFile(filepath.Join(tp.dir, name))
	if err != nil {
		tp.t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// swarm is a running `kettle swarm` through the balancer.
type swarm struct {
	out  string
	cmd  *exec.Cmd
	done chan error
}

func (tp *topo) swarm(api string, devices int, d time.Duration, extra ...string) *swarm {
	tp.t.Helper()
	name := api
	if slices.Contains(extra, "--protocol") {
		name = "mqtt"
	}
	out := filepath.Join(tp.dir, "swarm-"+name)
	args := []string{"swarm", "--target", balancer, "--api", api, "--devices", fmt.Sprint(devices), "--interval", "2s",
		"--duration", d.String(), "--data-dir", filepath.Join(tp.dir, "kettle1"), "--out", out,
		"--report=false", "--sample=false", "--slo-p99", "0", "--max-error-rate", "-1", "--hatch-rate", "0"}
	c := exec.Command(tp.bin, append(args, extra...)...)
	var buf bytes.Buffer
	c.Stdout, c.Stderr = &buf, &buf
	if err := c.Start(); err != nil {
		tp.t.Fatal(err)
	}
	s := &swarm{out: out, cmd: c, done: make(chan error, 1)}
	go func() {
		err := c.Wait()
		if err != nil {
			err = fmt.Errorf("%v: %s", err, buf.String())
		}
		s.done <- err
	}()
	tp.t.Cleanup(func() { c.Process.Kill() })
	return s
}

// results waits for the swarm's end and reads its results.json.
func (s *swarm) results(t *testing.T, limit time.Duration) *sim.Results {
	t.Helper()
	select {
	case err := <-s.done:
		if err != nil {
			t.Fatalf("kettle swarm: %v", err)
		}
	case <-time.After(limit):
		s.cmd.Process.Kill()
		t.Fatalf("kettle swarm still running after %s", limit)
	}
	b, err := os.ReadFile(filepath.Join(s.out, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	var r sim.Results
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return &r
}

// sample is one probe request's outcome.
type sample struct {
	at, done time.Time
	status   int // 0: no answer
	retry    string
}

// probe sends one request every period on its own client until stopped.
type probe struct {
	mu      sync.Mutex
	samples []sample
	stop    chan struct{}
	wg      sync.WaitGroup
}

func startProbe(period, timeout time.Duration, req func(i int) *http.Request) *probe {
	p := &probe{stop: make(chan struct{})}
	hc := &http.Client{Timeout: timeout}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for i := 0; ; i++ {
			s := sample{at: time.Now()}
			if r, err := hc.Do(req(i)); err == nil {
				s.status, s.retry = r.StatusCode, r.Header.Get("Retry-After")
				r.Body.Close()
			}
			s.done = time.Now()
			p.mu.Lock()
			p.samples = append(p.samples, s)
			p.mu.Unlock()
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
		}
	}()
	return p
}

func (p *probe) close() { close(p.stop); p.wg.Wait() }

func (p *probe) between(from, to time.Time) []sample {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []sample
	for _, s := range p.samples {
		if !s.at.Before(from) && s.at.Before(to) {
			out = append(out, s)
		}
	}
	return out
}

// firstOK is the completion of the first 2xx sent at or after t (zero: none).
func (p *probe) firstOK(t time.Time) time.Time {
	for _, s := range p.between(t, time.Now().Add(time.Hour)) {
		if s.status/100 == 2 {
			return s.done
		}
	}
	return time.Time{}
}

// waitOK waits until a 2xx sent after t arrives.
func (p *probe) waitOK(t *testing.T, after time.Time, limit time.Duration, what string) time.Time {
	t.Helper()
	for end := time.Now().Add(limit); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if ok := p.firstOK(after); !ok.IsZero() {
			return ok
		}
	}
	t.Fatalf("%s: no 2xx within %s", what, limit)
	return time.Time{}
}

// waitFailed waits until a request sent after t fails, and returns when it was sent.
func (p *probe) waitFailed(t *testing.T, after time.Time, limit time.Duration, what string) time.Time {
	t.Helper()
	for end := time.Now().Add(limit); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		for _, s := range p.between(after, time.Now()) {
			if s.status/100 != 2 && !s.done.IsZero() {
				return s.at
			}
		}
	}
	t.Fatalf("%s: none failed within %s", what, limit)
	return time.Time{}
}

func counts(ss []sample) string {
	m := map[int]int{}
	for _, s := range ss {
		m[s.status]++
	}
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		name := fmt.Sprint(k)
		if k == 0 {
			name = "no answer"
		}
		fmt.Fprintf(&b, "%s×%d ", name, m[k])
	}
	return strings.TrimSpace(b.String())
}

func p99(ss []sample) time.Duration {
	d := make([]time.Duration, 0, len(ss))
	for _, s := range ss {
		d = append(d, s.done.Sub(s.at))
	}
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	return d[min(len(d)-1, len(d)*99/100)]
}

// probeDevice is a v1 kettle of the probes.
type probeDevice struct{ token string }

func newProbeDevice(secret string) probeDevice {
	return probeDevice{kettle.DeviceToken([]byte(secret), uuid.New())}
}

func (d probeDevice) reading(start time.Time) func(int) *http.Request {
	return func(i int) *http.Request {
		t := start.Add(time.Duration(i) * time.Millisecond).UTC()
		body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":500,"battery_full_mwh":1000,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":60,"water_level_ml":700}`, t.Format(time.RFC3339Nano))
		r, _ := http.NewRequest("POST", balancer+"/v1/measurements", strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer "+d.token)
		r.Header.Set("Content-Type", "application/json")
		return r
	}
}

func (d probeDevice) command() func(int) *http.Request {
	return func(int) *http.Request {
		r, _ := http.NewRequest("GET", balancer+"/v1/command", nil)
		r.Header.Set("Authorization", "Bearer "+d.token)
		return r
	}
}

// swarmErrors sums the swarm's failed requests in the seconds overlapping [from, to).
func swarmErrors(res *sim.Results, from, to time.Time) (int64, map[string]int64) {
	var n int64
	kinds := map[string]int64{}
	for _, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.Add(time.Second).Before(from) || !t.Before(to) {
			continue
		}
		for _, ep := range s.Endpoints {
			for k, v := range ep.Errors {
				n += v
				kinds[k] += v
			}
		}
	}
	return n, kinds
}

// swarmP99 is the p99 of one endpoint over the seconds in [from, to), from
// each kettle's intended send time.
func swarmP99(res *sim.Results, ep string, from, to time.Time) (time.Duration, int64) {
	p, n, _ := swarmP99If(res, ep, from, to, func(sim.Second) bool { return true })
	return p, n
}

// swarmP99OnTime is swarmP99 over the seconds of [from, to) without late
// starts (sends due while the kettle's previous exchange was still out),
// and how many seconds had some.
func swarmP99OnTime(res *sim.Results, ep string, from, to time.Time) (time.Duration, int64, int) {
	return swarmP99If(res, ep, from, to, func(s sim.Second) bool { return s.LateStarts == 0 })
}

// swarmP99If is swarmP99 over the seconds keep accepts, and how many it
// left out.
func swarmP99If(res *sim.Results, ep string, from, to time.Time, keep func(sim.Second) bool) (time.Duration, int64, int) {
	h := sim.NewHistogram()
	left := 0
	for _, s := range res.Seconds {
		t := res.Start.Add(time.Duration(s.T) * time.Second)
		if t.Before(from) || !t.Before(to) {
			continue
		}
		if !keep(s) {
			left++
			continue
		}
		if e := s.Endpoints[ep]; e != nil && e.Histogram != "" {
			if sh, err := hdrhistogram.Decode([]byte(e.Histogram)); err == nil {
				h.Merge(sh)
			}
		}
	}
	return time.Duration(h.ValueAtQuantile(99)) * time.Microsecond, h.TotalCount(), left
}

func checkAudit(t *testing.T, name string, res *sim.Results) {
	t.Helper()
	a := res.Audit
	if a == nil {
		t.Errorf("%s swarm: no audit", name)
		return
	}
	t.Logf("%s swarm audit: %s", name, a.Line())
	figure(t, name+"_acked", float64(a.Acked), "readings")
	figure(t, name+"_lost", float64(a.Lost), "readings")
	figure(t, name+"_duplicated", float64(a.Duplicated), "readings")
	if a.Lost != 0 || a.Duplicated != 0 || a.Acked == 0 {
		t.Errorf("%s swarm audit: want lost=0 duplicated=0 and readings acked: %s %v", name, a.Line(), a.Examples)
	}
}
