package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/backoff"
	"github.com/kettlefleet/kettlefleet/sim"
)

// serveProc is a kettle serve process, started as a user starts it.
type serveProc struct {
	args    []string
	url     string
	addr    string
	dataDir string
	cmd     *exec.Cmd
	done    chan struct{}
	exitErr error
	logPath string
	started time.Time
}

var listeningRE = regexp.MustCompile(`listening on (http://\S+)`)

// freeAddr returns a loopback address with a port nobody listens on now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// startPartServe starts the kettle serve a part runs against: in a fresh
// directory OUT/name (its data directory dir/data, its log dir/serve.log),
// on a free loopback address, with the store db ("": a SQLite file in the
// data directory) and the flags extra.
func startPartServe(ctx context.Context, e *env, name, db string, extra ...string) (srv *serveProc, dir, data string, err error) {
	dir = filepath.Join(e.out, name)
	os.RemoveAll(dir)
	data = filepath.Join(dir, "data")
	if err := os.MkdirAll(data, 0o755); err != nil {
		return nil, dir, data, err
	}
	addr, err := freeAddr()
	if err != nil {
		return nil, dir, data, err
	}
	if db == "" {
		db = "sqlite:" + filepath.Join(data, "kettle.db")
	}
	srv, err = startServe(ctx, e, addr, data, db, filepath.Join(dir, "serve.log"), extra...)
	return srv, dir, data, err
}

// startServe runs `kettle serve --addr addr --data-dir dir --db db extra…`
// and returns once it prints its URL (at most 60 s). Its output goes to
// logPath (appended: a restart continues the same file).
func startServe(ctx context.Context, e *env, addr, dataDir, db, logPath string, extra ...string) (*serveProc, error) {
	args := append([]string{"serve", "--addr", addr, "--data-dir", dataDir, "--db", db, "--access-log-sample", "0", "--log-level", "warn"}, extra...)
	p := &serveProc{args: args, addr: addr, dataDir: dataDir, logPath: logPath, done: make(chan struct{})}
	return p, p.start(ctx, e)
}

func (p *serveProc) start(ctx context.Context, e *env) error {
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(logf, "---- %s kettle %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(p.args, " "))
	cmd := exec.Command(e.bin, p.args...)
	// The server dies with us: no stray process on a shared machine.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		logf.Close()
		return err
	}
	cmd.Stdout = logf
	p.started = time.Now()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start kettle serve: %w", err)
	}
	p.cmd, p.done, p.exitErr = cmd, make(chan struct{}), nil
	urlc := make(chan string, 1)
	var copied sync.WaitGroup
	copied.Add(1)
	go func() {
		defer copied.Done()
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logf, line)
			if m := listeningRE.FindStringSubmatch(line); m != nil {
				select {
				case urlc <- m[1]:
				default:
				}
			}
		}
	}()
	done := p.done
	go func() {
		copied.Wait()
		p.exitErr = cmd.Wait()
		logf.Close()
		close(done)
	}()
	select {
	case p.url = <-urlc:
		return nil
	case <-done:
		return fmt.Errorf("kettle serve exited at start (%v); see %s", p.exitErr, p.logPath)
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		<-done
		return fmt.Errorf("kettle serve did not start within 60s; see %s", p.logPath)
	case <-ctx.Done():
		cmd.Process.Kill()
		<-done
		return ctx.Err()
	}
}

func (p *serveProc) pid() int { return p.cmd.Process.Pid }

// alive reports whether the process has not exited.
func (p *serveProc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// kill9 sends SIGKILL and waits for the exit.
func (p *serveProc) kill9() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
	}
}

// stop sends SIGTERM and waits up to 60 s (then SIGKILL).
func (p *serveProc) stop() error {
	if !p.alive() {
		return p.exitErr
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.exitErr
	case <-time.After(60 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("kettle serve did not stop within 60s of SIGTERM")
	}
}

// panicked reports whether the server's log shows a Go panic or fatal error.
func (p *serveProc) panicked() bool {
	b, _ := os.ReadFile(p.logPath)
	s := string(b)
	return strings.Contains(s, "panic:") || strings.Contains(s, "fatal error:")
}

func readSecret(dataDir, name string) string {
	b, _ := os.ReadFile(filepath.Join(dataDir, name))
	return strings.TrimSpace(string(b))
}

// swarmProc is a kettle swarm process.
type swarmProc struct {
	cmd     *exec.Cmd
	out     string
	done    chan struct{}
	exitErr error
	started time.Time
	logPath string
}

// startSwarm runs `kettle swarm --target url --out out args…` with its
// output in out/swarm.log. Judging (SLO) is left to the caller: the swarm
// is run with --slo-p99 0 --max-error-rate -1 unless args say otherwise.
func startSwarm(e *env, target, out string, args ...string) (*swarmProc, error) {
	return startSwarmNice(e, 0, target, out, args...)
}

// startSwarmNice is startSwarm with the swarm at nice level nice (0: as
// this process), for parts where the swarm stands for load that in reality
// comes from other machines and must not take the CPU of the server it
// measures.
func startSwarmNice(e *env, nice int, target, out string, args ...string) (*swarmProc, error) {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return nil, err
	}
	all := append([]string{"swarm", "--target", target, "--out", out, "--report=false", "--sample=false", "--slo-p99", "0", "--max-error-rate", "-1"}, args...)
	logPath := filepath.Join(out, "swarm.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(logf, "kettle %s\n", strings.Join(all, " "))
	cmd := exec.Command(e.bin, all...)
	if nice != 0 {
		// nice(1) sets the level before exec, so every thread of the swarm has it.
		cmd = exec.Command("nice", append([]string{"-n", fmt.Sprint(nice), e.bin}, all...)...)
		fmt.Fprintf(logf, "(at nice %d)\n", nice)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	s := &swarmProc{cmd: cmd, out: out, done: make(chan struct{}), logPath: logPath}
	s.started = time.Now()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	e.logf("swarm: kettle %s", strings.Join(all, " "))
	go func() { s.exitErr = cmd.Wait(); logf.Close(); close(s.done) }()
	return s, nil
}

// wait waits for the swarm to end (at most limit, then SIGKILL) and reads
// its results.json. The exit code is returned too (-1: killed).
func (s *swarmProc) wait(ctx context.Context, limit time.Duration) (*sim.Results, int, error) {
	select {
	case <-s.done:
	case <-time.After(limit):
		s.cmd.Process.Kill()
		<-s.done
		return nil, -1, fmt.Errorf("swarm still running after %s: killed", limit)
	case <-ctx.Done():
		s.cmd.Process.Kill()
		<-s.done
		return nil, -1, ctx.Err()
	}
	code := s.cmd.ProcessState.ExitCode()
	b, err := os.ReadFile(filepath.Join(s.out, "results.json"))
	if err != nil {
		return nil, code, fmt.Errorf("swarm exit %d, no results.json (%v); see %s: %s", code, err, s.logPath, tail(s.logPath, 3))
	}
	var r sim.Results
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, code, fmt.Errorf("results.json: %w", err)
	}
	return &r, code, nil
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// sleep waits d or until ctx ends (false).
var sleep = backoff.Sleep

// rssKiB reads VmRSS of a process (0 when gone).
func rssKiB(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

// sampler runs a sample once a second, from its start until end.
type sampler struct {
	stop, done chan struct{}
}

func everySecond(sample func()) *sampler {
	s := &sampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			sample()
			select {
			case <-t.C:
			case <-s.stop:
				return
			}
		}
	}()
	return s
}

// end stops sampling; it returns once no sample runs.
func (s *sampler) end() {
	close(s.stop)
	<-s.done
}

// rssSampler samples a process's VmRSS every second until stopped.
type rssSampler struct {
	mu      sync.Mutex
	samples []int64 // KiB
	every   *sampler
}

func sampleRSS(pid int) *rssSampler {
	s := &rssSampler{}
	s.every = everySecond(func() {
		if v := rssKiB(pid); v > 0 {
			s.mu.Lock()
			s.samples = append(s.samples, v)
			s.mu.Unlock()
		}
	})
	return s
}

// end stops sampling and returns the samples (KiB).
func (s *rssSampler) end() []int64 {
	s.every.end()
	return s.samples
}

// metricsText fetches /metrics.
func metricsText(url string) (string, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	r, err := c.Get(url + "/metrics")
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	b, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
	return string(b), err
}

// metricSum sums the samples of metric whose label set contains every
// label in want (e.g. `route="POST /v1/measurements"`, `le="0.1"`).
func metricSum(text, metric string, want ...string) float64 {
	var sum float64
	for _, l := range strings.Split(text, "\n") {
		if !strings.HasPrefix(l, metric) {
			continue
		}
		rest := l[len(metric):]
		if rest == "" || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		ok := true
		for _, w := range want {
			if !strings.Contains(rest, w) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		f := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}
