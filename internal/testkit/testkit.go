// Package testkit holds what the process-level tests of several packages
// share: the kettle binary of this checkout, the Debian-packaged tools they
// run (Prometheus, HAProxy …) found and started for the test's length, a
// free loopback address for such a process, a wait on a condition, and
// deploy/cluster.sh run for a topology.
package testkit

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
)

// Root is the directory of this checkout (the module's root).
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}

// BuildKettle builds ./cmd/kettle of this checkout into dir/kettle with the
// go build flags given (-race for a test that wants the detector in the
// child too) and returns the binary's path.
func BuildKettle(dir string, flags ...string) (string, error) {
	bin := filepath.Join(dir, "kettle")
	args := append(append([]string{"build"}, flags...), "-o", bin, "./cmd/kettle")
	cmd := exec.Command("go", args...)
	cmd.Dir = Root()
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/kettle: %v\n%s", err, out)
	}
	return bin, nil
}

// Tool finds a Debian-packaged binary under one of names or fails saying
// how to install it.
func Tool(t testing.TB, pkg string, names ...string) string {
	t.Helper()
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	t.Fatalf("%s not found on PATH: apt-get install -y %s (make deps)", names[0], pkg)
	return ""
}

// Start runs bin with args until the test ends (SIGTERM, then SIGKILL after
// 5 s) and returns its output so far, stdout and stderr together; when the
// test has failed, the output is logged.
func Start(t testing.TB, bin string, args ...string) *syncbuf.Buffer {
	t.Helper()
	out := &syncbuf.Buffer{}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = time.Second // a child it left holding the output does not hold the test
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s's output:\n%s", filepath.Base(bin), out)
		}
	})
	return out
}

// FreeAddr returns a loopback TCP address that nothing listens on: the
// kernel's choice of port, closed again, for a child process's flag. Another
// process may take it in between; on loopback in a test that is rare.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Poll checks cond at once and then every interval until it holds or limit
// has passed, and reports whether it held: the one polling loop of the
// tests, for waits that end on a condition and fail in their own words.
func Poll(limit, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		<-tick.C
	}
	return true
}

// WaitFor polls cond every 100 ms until it holds and returns how long that
// took; past limit the test fails naming what.
func WaitFor(t testing.TB, what string, limit time.Duration, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	if !Poll(limit, 100*time.Millisecond, cond) {
		t.Fatalf("%s: not within %s", what, limit)
	}
	return time.Since(start)
}

// Answers200 reports whether a GET of url through c (nil: the default
// client) answers 200 OK.
func Answers200(c *http.Client, url string) bool {
	if c == nil {
		c = http.DefaultClient
	}
	res, err := c.Get(url)
	if err != nil {
		return false
	}
	res.Body.Close()
	return res.StatusCode == http.StatusOK
}

// Cluster runs deploy/cluster.sh of this checkout for one topology, whose
// settings (KETTLE_HA_NET, KETTLE_HA_DIR …) are in Env.
type Cluster struct {
	T   testing.TB
	Env []string
}

// Command is deploy/cluster.sh args… with c's environment, not started.
func (c *Cluster) Command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(Root(), "deploy", "cluster.sh"), args...)
	cmd.Env = c.Env
	cmd.WaitDelay = 5 * time.Second // the script's children may hold its output
	return cmd
}

// Run runs deploy/cluster.sh args… within limit and returns its output
// (stdout and stderr), trimmed.
func (c *Cluster) Run(limit time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	out, err := c.Command(ctx, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// Must is Run that fails the test, with the output, when the script fails.
func (c *Cluster) Must(limit time.Duration, args ...string) string {
	c.T.Helper()
	out, err := c.Run(limit, args...)
	if err != nil {
		c.T.Fatalf("deploy/cluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}
