package main_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

var kettleBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kettle-bin-")
	if err != nil {
		panic(err)
	}
	if kettleBin, err = testkit.BuildKettle(dir, "-race"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := pgtest.Run(m) // runs the tests, removes a cluster if one was started
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is a kettle process started as a user starts it.
type proc struct {
	cmd    *exec.Cmd
	url    string          // what its ready line names: serve's URL, a worker's host:port
	log    *syncbuf.Buffer // its standard error
	done   chan error      // its exit status, once
	exited chan struct{}   // closed after done is sent
}

var listening = regexp.MustCompile(`listening on (https?://\S+)`)

// start runs kettle with args and returns once a line of its standard
// error matches ready (p.url: the line's first group); the test fails if
// the process exits first or no such line comes within a minute. A process
// still running when the test ends is killed.
func start(t *testing.T, ready *regexp.Regexp, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(kettleBin, args...)
	stderr, _ := cmd.StderrPipe()
	p := &proc{cmd: cmd, log: &syncbuf.Buffer{}, done: make(chan error, 1), exited: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.log.Write([]byte(sc.Text() + "\n"))
			if m := ready.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case found <- m[1]:
				default: // only the first
				}
			}
		}
		// Wait closes the pipe, so only once every line is read.
		p.done <- cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.exited
	})
	select {
	case p.url = <-found:
	case err := <-p.done:
		t.Fatalf("%s exited before a line matching %q: %v\n%s", cmd, ready, err, p.log)
	case <-time.After(time.Minute):
		t.Fatalf("%s: no line matching %q within a minute\n%s", cmd, ready, p.log)
	}
	return p
}

// serve starts kettle serve on a port the kernel chooses.
func serve(t *testing.T, dataDir, db string, extra ...string) *proc {
	t.Helper()
	return start(t, listening, append([]string{"serve", "--addr", "127.0.0.1:0", "--data-dir", dataDir, "--db", db}, extra...)...)
}

func req(method, url string, hdr map[string]string, body string) (int, []byte, error) {
	r, _ := http.NewRequest(method, url, strings.NewReader(body))
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(r)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, b, err
}

func mustJSON(t *testing.T, url string, hdr map[string]string, v any) {
	t.Helper()
	st, b, err := req("GET", url, hdr, "")
	if err != nil || st != 200 {
		t.Fatalf("GET %s: %d %v %s", url, st, err, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
}

type reading struct {
	dev string
	t   time.Time
}

// load posts case-study readings from devs until stop is closed and returns
// every reading that was acknowledged with a 200.
func load(p *proc, devs []string, start time.Time, stop <-chan struct{}) []reading {
	var (
		mu    sync.Mutex
		acked []reading
		wg    sync.WaitGroup
		seq   atomic.Int64
	)
	for _, d := range devs {
		wg.Add(1)
		go func(d string) {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				ts := start.Add(time.Duration(seq.Add(1)) * time.Millisecond).UTC().Truncate(time.Microsecond)
				body := fmt.Sprintf(`{"time":%q,"charge_now":40,"charge_full":100,"charge_rate":-1,"ambient_temp":20,"water_temp":70,"water_level":300}`, ts.Format(time.RFC3339Nano))
				st, _, err := req("POST", p.url+"/measurement", map[string]string{"servant-auth-cookie": d}, body)
				if err == nil && st == 200 {
					mu.Lock()
					acked = append(acked, reading{d, ts})
					mu.Unlock()
				} else if err != nil {
					time.Sleep(5 * time.Millisecond)
				}
			}
		}(d)
	}
	wg.Wait()
	return acked
}

// logins signs n case-study kettles in (POST /login) and returns their
// cookies.
func logins(t *testing.T, p *proc, n int) []string {
	t.Helper()
	var devs []string
	for range n {
		st, b, err := req("POST", p.url+"/login", nil, `{"username":"k"}`)
		var u struct{ Username string }
		if err == nil {
			err = json.Unmarshal(b, &u)
		}
		if err != nil || st != 200 || u.Username == "" {
			t.Fatalf("POST /login: %d %v %s", st, err, b)
		}
		devs = append(devs, u.Username)
	}
	return devs
}

func stats(t *testing.T, p *proc, op string) map[string]any {
	var s map[string]any
	mustJSON(t, p.url+"/v1/statistics", map[string]string{"Authorization": "Bearer " + op}, &s)
	delete(s, "devices_reporting") // depends on the wall clock
	return s
}

// audit checks every acknowledged reading is stored exactly once.
func audit(t *testing.T, p *proc, op string, devs []string, acked []reading) (stored int) {
	t.Helper()
	have := map[reading]int{}
	for _, d := range devs {
		after := ""
		for {
			var page struct {
				Measurements []struct{ Time time.Time }
				Next         string
			}
			mustJSON(t, p.url+"/v1/devices/"+d+"/measurements?limit=1000"+after, map[string]string{"Authorization": "Bearer " + op}, &page)
			for _, m := range page.Measurements {
				have[reading{d, m.Time.UTC()}]++
			}
			if page.Next == "" {
				break
			}
			after = "&after=" + page.Next
		}
	}
	lost := 0
	for _, a := range acked {
		if have[a] == 0 {
			lost++
		}
	}
	for r, n := range have {
		if n > 1 {
			t.Errorf("reading %v stored %d times", r, n)
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d acknowledged readings lost", lost, len(acked))
	}
	return len(have)
}

// operatorToken is the operator token kettle serve generated in dir.
func operatorToken(dir string) string {
	b, _ := os.ReadFile(filepath.Join(dir, "operator-token"))
	return strings.TrimSpace(string(b))
}

func storesUnderTest(t *testing.T, f func(t *testing.T, db string)) {
	t.Run("sqlite", func(t *testing.T) { f(t, "sqlite:"+t.TempDir()+"/kettle.db") })
	t.Run("postgres", func(t *testing.T) { f(t, pgtest.Start(t)) })
}

// TestKill9LosesNothing: kill -9 during a stream of acknowledged readings;
// after a restart every acknowledged reading is there once, and a further
// restart changes no answer.
func TestKill9LosesNothing(t *testing.T) {
	storesUnderTest(t, func(t *testing.T, db string) {
		dir := t.TempDir()
		p := serve(t, dir, db)
		op := operatorToken(dir)
		devs := logins(t, p, 8)
		stop := make(chan struct{})
		res := make(chan []reading)
		go func() { res <- load(p, devs, time.Now().Add(-time.Hour), stop) }()
		time.Sleep(1500 * time.Millisecond)
		p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
		time.Sleep(200 * time.Millisecond)
		close(stop)
		acked := <-res
		if len(acked) < 50 {
			t.Fatalf("only %d readings acknowledged before the kill; the test proves nothing", len(acked))
		}

		p2 := serve(t, dir, db)
		stored := audit(t, p2, op, devs, acked)
		before := stats(t, p2, op)
		if int(before["measurement_count"].(float64)) != stored {
			t.Errorf("measurement_count %v, history holds %d", before["measurement_count"], stored)
		}
		t.Logf("acked=%d stored=%d (stored ≥ acked: requests in flight at the kill may have committed without their answer)", len(acked), stored)

		// A graceful restart changes no answer.
		p2.cmd.Process.Signal(syscall.SIGTERM)
		if err := <-p2.done; err != nil {
			t.Errorf("SIGTERM exit: %v", err)
		}
		p3 := serve(t, dir, db)
		after := stats(t, p3, op)
		bj, _ := json.Marshal(before)
		aj, _ := json.Marshal(after)
		if string(bj) != string(aj) {
			t.Errorf("statistics changed across a restart:\n%s\n%s", bj, aj)
		}
	})
}

// TestSIGTERMDrains: SIGTERM while readings stream in: the process exits 0,
// and every reading that got a 200 is stored.
func TestSIGTERMDrains(t *testing.T) {
	dir := t.TempDir()
	db := "sqlite:" + dir + "/kettle.db"
	p := serve(t, dir, db)
	op := operatorToken(dir)
	devs := logins(t, p, 8)
	stop := make(chan struct{})
	res := make(chan []reading)
	go func() { res <- load(p, devs, time.Now().Add(-time.Hour), stop) }()
	time.Sleep(time.Second)
	p.cmd.Process.Signal(syscall.SIGTERM)
	err := <-p.done
	close(stop)
	acked := <-res
	if err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, p.log)
	}
	if !strings.Contains(p.log.String(), "kettle serve stopped") {
		t.Errorf("no shutdown line in the log:\n%s", p.log)
	}
	p2 := serve(t, dir, db)
	stored := audit(t, p2, op, devs, acked)
	if stored < len(acked) {
		t.Errorf("stored %d < acked %d", stored, len(acked))
	}
}

func TestServeHelpIsTheReference(t *testing.T) {
	out, _ := exec.Command(kettleBin, "serve", "--help").CombinedOutput()
	for _, want := range []string{"--addr", "KETTLE_ADDR", "--db", "KETTLE_DB", "--operator-token", "KETTLE_OPERATOR_TOKEN", "--secret", "KETTLE_SECRET", "--ingest-queue", "--max-conns",
		"--shed-latency", "KETTLE_SHED_LATENCY", "--shed-window", "KETTLE_SHED_WINDOW", "--shed-windows", "KETTLE_SHED_WINDOWS", "--shed-runnable", "KETTLE_SHED_RUNNABLE", "--shed-min-ingest-share", "KETTLE_SHED_MIN_INGEST_SHARE", "--device-rate", "KETTLE_DEVICE_RATE", "--device-burst", "KETTLE_DEVICE_BURST",
		"--login-rate", "KETTLE_LOGIN_RATE", "--login-burst", "--max-devices", "KETTLE_MAX_DEVICES", "--prune-unreported", "KETTLE_PRUNE_UNREPORTED"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("kettle serve --help lacks %s", want)
		}
	}
	// Bad values are refused before anything starts, the flag named.
	for _, args := range [][]string{{"--device-rate", "-1"}, {"--device-rate", "NaN"}, {"--device-rate", "0.0001"}, {"--device-rate", "1", "--device-burst", "0"},
		{"--login-rate", "-5"}, {"--login-burst", "0"}, {"--max-devices", "-1"}} {
		out, err := exec.Command(kettleBin, append([]string{"serve", "--addr", "127.0.0.1:0", "--data-dir", t.TempDir()}, args...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), args[len(args)-2]+" "+args[len(args)-1]+":") {
			t.Errorf("kettle serve %v: %v\n%s\nwant a refusal naming %s", args, err, out, args[len(args)-2])
		}
	}
	// The configuration's own checks (server.Config.Validate), by flag.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--ingest-queue", "500"}, "--ingest-queue 500 is smaller than the largest upload (1000 readings)"},
		{[]string{"--store-timeout", "-1s"}, "--store-timeout -1s:"},
		{[]string{"--access-log-sample", "2"}, "--access-log-sample 2:"},
		{[]string{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key go together"},
	} {
		out, err := exec.Command(kettleBin, append([]string{"serve", "--addr", "127.0.0.1:0", "--data-dir", t.TempDir()}, c.args...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("kettle serve %v: %v\n%s\nwant a refusal saying %q", c.args, err, out, c.want)
		}
	}
	if !strings.Contains(string(out), "--store-timeout  [KETTLE_STORE_TIMEOUT]") {
		t.Error("kettle serve --help lacks --store-timeout [KETTLE_STORE_TIMEOUT]")
	}
	for _, v := range []string{"5m", "soon", "-1h"} {
		out, err := exec.Command(kettleBin, "serve", "--addr", "127.0.0.1:0", "--data-dir", t.TempDir(), "--prune-unreported", v).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "prune-unreported") || !strings.Contains(string(out), `"`+v+`"`) {
			t.Errorf("kettle serve --prune-unreported %s: %v\n%s\nwant a refusal naming the flag and the value", v, err, out)
		}
	}
}

func TestTokenCommand(t *testing.T) {
	dir := t.TempDir()
	p := serve(t, dir, "sqlite:"+dir+"/k.db")
	id := "7f9a1c52-3b1e-4c4e-9a51-0d7f6a1b2c3d"
	out, err := exec.Command(kettleBin, "token", "--data-dir", dir, "--device", id).Output()
	if err != nil {
		t.Fatal(err)
	}
	tok := strings.TrimSpace(string(out))
	st, b, _ := req("GET", p.url+"/v1/command", map[string]string{"Authorization": "Bearer " + tok}, "")
	if st != 200 {
		t.Errorf("token from kettle token refused: %d %s", st, b)
	}
	// The environment twin of a flag works too.
	cmd := exec.Command(kettleBin, "token", "--device", id)
	cmd.Env = append(os.Environ(), "KETTLE_DATA_DIR="+dir)
	out2, err := cmd.Output()
	if err != nil || strings.TrimSpace(string(out2)) != tok {
		t.Errorf("KETTLE_DATA_DIR: %q %v", out2, err)
	}
}
