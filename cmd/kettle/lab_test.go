package main_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

var workerListening = regexp.MustCompile(`worker: listening on (\S+)`)

// startWorker starts `kettle swarm worker` on ip (port chosen by the kernel)
// and returns it with its address.
func startWorker(t *testing.T, ip, token string) (*proc, string) {
	t.Helper()
	return startWorkerWith(t, ip, "--token", token)
}

// startWorkerWith is startWorker with the worker's other arguments (its
// token among them) given.
func startWorkerWith(t *testing.T, ip string, args ...string) (*proc, string) {
	t.Helper()
	w := start(t, workerListening, append([]string{"swarm", "worker", "--listen", ip + ":0"}, args...)...)
	return w, w.url
}

// TestSwarmWorkersCLI: kettle swarm --workers drives three kettle swarm
// worker processes against a kettle serve process; one worker is killed
// (SIGKILL) mid-run. The run still ends with one merged results.json and
// report, the lost worker's share is marked, and the exit status is 1.
func TestSwarmWorkersCLI(t *testing.T) {
	dir := t.TempDir()
	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"))
	const token = "cli-lab-token-0123456789"
	var addrs []string
	var workers []*proc
	for i := range 3 {
		w, a := startWorker(t, fmt.Sprintf("127.0.45.%d", 21+i), token)
		workers, addrs = append(workers, w), append(addrs, a)
	}
	out := filepath.Join(dir, "out")
	ctl := exec.Command(kettleBin, "swarm", "--target", p.url, "--data-dir", dir,
		"--workers", strings.Join(addrs, ","), "--worker-token", token,
		"--devices", "30", "--interval", "250ms", "--jitter", "20ms", "--duration", "5s",
		"--slo-p99", "0", "--max-error-rate", "-1", "--sample=false", "--out", out)
	stderr, _ := ctl.StderrPipe()
	if err := ctl.Start(); err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		line := sc.Text()
		log.WriteString(line + "\n")
		if strings.HasPrefix(line, "lab: common start") {
			go func() {
				time.Sleep(4 * time.Second) // the 1 s start delay, then 3 s of its 5
				workers[1].cmd.Process.Kill()
			}()
		}
	}
	err := ctl.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("exit %v, want 1 (a worker lost)\n%s", err, log.String())
	}
	t.Log(log.String())
	for _, want := range []string{"1 of 3 workers lost", "LOST: its share (10 of 30 kettles, 33.3%)", "audit: acked=", "lost=0 duplicated=0", "report: "} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("output lacks %q\n%s", want, log.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(out, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Params  struct{ Devices int }
		Workers []struct {
			Addr, State string
			Requests    int64
		}
		Totals struct{ Requests int64 }
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	var sum int64
	for _, w := range res.Workers {
		sum += w.Requests
	}
	if res.Params.Devices != 30 || len(res.Workers) != 3 || res.Workers[1].State != "lost" || res.Workers[0].State != "done" || sum != res.Totals.Requests || res.Workers[1].Requests == 0 {
		t.Errorf("results.json: %+v", res)
	}
	if _, err := os.Stat(filepath.Join(out, "report.html")); err != nil {
		t.Error(err)
	}
}
