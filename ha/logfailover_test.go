package ha_test

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/internal/leaktest"
)

// TestLogFailover (issue 53, scenario f; make chaos's log-failover part):
// both nodes are kettle serve --log fronts of deploy/kafka's three
// brokers, one writer (--role writer) stores the log through the
// multi-host DSN. Under v1 kettles through HAProxy the primary is killed
// -9 (an unplanned failover) and, once three members are healthy again,
// switched over (planned). The kettles are answered by the log, which
// does not depend on the database: every answer is 200 (Patroni's ttl
// floor becomes the writer's lag, never a refusal), and the audit after
// the writer drained the log finds every acknowledged reading stored once.
func TestLogFailover(t *testing.T) {
	if !long {
		t.Skip("KETTLE_HA_LONG: Kafka and the Patroni topology, a failover and a switchover (about 5 minutes; make chaos's log-failover part)")
	}
	// Its own port: make chaos's Kafka parts use 9092, the kafka suite 19092.
	kc, err := kafkatest.Start(filepath.Join(t.TempDir(), "kafka"), kafkatest.Options{Port: 29092})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kc.Stop() })
	logURL := kc.URL("kettle.readings")
	tp := up(t, 2, "KETTLE_DB_READ=", "KETTLE_HA_SERVE_ARGS=--access-log-sample 0 --log "+logURL+" --log-monitor-every 1s "+strings.Join(kc.Args(kafkatest.Front), " "))

	// The writer, on the same multi-host DSN as the nodes.
	wdir := filepath.Join(tp.dir, "writer")
	os.MkdirAll(wdir, 0o755)
	for _, f := range []string{"secret", "operator-token"} {
		os.WriteFile(filepath.Join(wdir, f), []byte(tp.readFile(f)), 0o600)
	}
	waddr := haNet + ".29:8080"
	wlog, err := os.Create(filepath.Join(tp.dir, "writer.log"))
	if err != nil {
		t.Fatal(err)
	}
	w := exec.Command(tp.bin, append([]string{"serve", "--role", "writer", "--addr", waddr, "--data-dir", wdir, "--log", logURL, "--log-monitor-every", "1s", "--log-format", "text"}, kc.Args(kafkatest.Writer)...)...)
	w.Env = append(os.Environ(), "KETTLE_DB="+tp.must(10*time.Second, "dsn"))
	w.Stdout, w.Stderr = wlog, wlog
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Process.Kill(); w.Wait(); wlog.Close() })
	writer := "http://" + waddr
	for end := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if r, err := http.Get(writer + "/readyz"); err == nil {
			r.Body.Close()
			if r.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(end) {
			b, _ := os.ReadFile(wlog.Name())
			t.Fatalf("the writer is not ready after a minute:\n%s", b)
		}
	}

	const run = 300 * time.Second
	s := tp.swarm("v1", 300, run, "--audit-after", writer+"/drained")
	swarmStart := time.Now()
	secret := tp.readFile("secret")
	var probes []*probe
	for range 10 {
		probes = append(probes, startProbe(100*time.Millisecond, 20*time.Second, newProbeDevice(secret).reading(time.Now().Add(-time.Hour))))
	}
	closed := false
	closeProbes := func() {
		if !closed {
			closed = true
			for _, p := range probes {
				p.close()
			}
		}
	}
	defer closeProbes()
	// Every kettle and probe stored through the log and the writer.
	tp.waitReporting(t, "http://"+haNet+".21:8080", 300+len(probes), 2)

	phase := func(name string, fault func() string) window {
		start := time.Now()
		what := fault()
		// The writer's lag after the fault, from its /metrics.
		var peak float64
		for end := time.Now().Add(90 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
			lag := metricValue(t, writer, "kettle_log_lag_records")
			peak = max(peak, lag)
			if time.Since(start) > 10*time.Second && lag < 2000 && tp.leaderOK() {
				break
			}
		}
		rejoin := tp.waitHealthy(3 * time.Minute)
		var all []sample
		for _, p := range probes {
			all = append(all, p.between(start, time.Now())...)
		}
		non200 := len(all) - countStatus(all, 200)
		var slowest time.Duration
		for _, s := range all {
			slowest = max(slowest, s.done.Sub(s.at))
		}
		t.Logf("%s (%s): probe uploads %s, slowest %.3fs; the writer's lag peaked at %.0f records; three healthy members %.1fs later", name, what, counts(all), slowest.Seconds(), peak, rejoin.Seconds())
		figure(t, "log_"+name+"_probe_non200", float64(non200), "answers")
		figure(t, "log_"+name+"_writer_lag_peak", peak, "records")
		figure(t, "log_"+name+"_slowest_upload", slowest.Seconds(), "s")
		if non200 > 0 {
			t.Errorf("%s: %d probe uploads not answered 200 (%s), want 0", name, non200, counts(all))
		}
		return window{name, start, time.Now()}
	}
	var windows []window
	windows = append(windows, phase("failover", func() string {
		old := tp.leader()
		tp.must(30*time.Second, "kill", old)
		// The old primary comes back once a standby took over.
		for end := time.Now().Add(90 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
			if l, err := tp.cmd(10*time.Second, "leader"); err == nil && l != old && l != "" {
				break
			}
		}
		tp.must(30*time.Second, "start", old)
		return "kill -9 of " + old + ", started again once another led"
	}))
	windows = append(windows, phase("switchover", func() string {
		old, sync := tp.leader(), syncStandby(t, tp)
		out := tp.must(2*time.Minute, "patronictl", "switchover", "--force", "--leader", old, "--candidate", sync, "kettle")
		t.Logf("switchover: %s", out)
		return "patronictl switchover " + old + " → " + sync
	}))
	closeProbes()
	res := s.results(t, run+6*time.Minute-time.Since(swarmStart))
	checkAudit(t, "v1", res)
	var total int64
	for _, w := range windows {
		n, kinds := swarmErrors(res, w.from, w.to)
		total += n
		t.Logf("%s: the swarm's kettles saw %d errors %v", w.name, n, kinds)
		figure(t, "log_"+w.name+"_kettle_errors", float64(n), "requests")
	}
	n, kinds := swarmErrors(res, res.Start, time.Now())
	figure(t, "log_run_kettle_errors", float64(n), "requests")
	if n > 0 {
		t.Errorf("the swarm's kettles saw %d errors over the run %v, want 0", n, kinds)
	}
	kafkaPW := leaktest.Secrets{}
	if kc.TLS {
		for _, u := range []string{kafkatest.Admin, kafkatest.Front, kafkatest.Writer} {
			kafkaPW["Kafka password of "+u] = kc.Auth(u).Password
		}
	}
	checkNoLeaks(t, tp, kafkaPW, kc.Dir)
}

// leaderOK reports whether a Patroni leader answers.
func (tp *topo) leaderOK() bool {
	_, err := tp.cmd(10*time.Second, "leader")
	return err == nil
}

// metricValue is the sum of a metric's samples on url's /metrics (0 when
// it cannot be read).
func metricValue(t *testing.T, url, name string) float64 {
	r, err := http.Get(url + "/metrics")
	if err != nil {
		return 0
	}
	defer r.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(r.Body)
	var sum float64
	for _, l := range bytes.Split(b.Bytes(), []byte("\n")) {
		if bytes.HasPrefix(l, []byte(name+" ")) || bytes.HasPrefix(l, []byte(name+"{")) {
			var v float64
			if _, err := fmt.Sscan(string(l[bytes.LastIndexByte(l, ' ')+1:]), &v); err == nil {
				sum += v
			}
		}
	}
	return sum
}
