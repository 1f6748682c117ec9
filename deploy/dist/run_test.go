package dist_test

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// proc is a process of the test's, its output kept.
type proc struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan error
}

// lockedBuffer is internal/syncbuf.Buffer, copied for the same reason as
// freeAddr: this module imports none of kettlefleet's packages.
type lockedBuffer struct {
	mu chan struct{}
	b  bytes.Buffer
}

func newLockedBuffer() *lockedBuffer { return &lockedBuffer{mu: make(chan struct{}, 1)} }

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu <- struct{}{}
	defer func() { <-l.mu }()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu <- struct{}{}
	defer func() { <-l.mu }()
	return l.b.String()
}

func startProc(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(args[0], args[1:]...), out: newLockedBuffer(), done: make(chan error, 1)}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
		}
	})
	return p
}

// waitFor polls cond every 100 ms until it holds, the process ends, or
// within passes.
func (p *proc) waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		select {
		case err := <-p.done:
			p.done <- err
			t.Fatalf("%s: the process ended (%v) first:\n%s", what, err, p.out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s:\n%s", what, within, p.out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop sends SIGTERM and wants exit 0 within a minute.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.out)
		}
	case <-time.After(time.Minute):
		t.Fatalf("no exit within a minute of SIGTERM:\n%s", p.out)
	}
}

// freeAddr is internal/testkit.FreeAddr: deploy/dist is a module of its
// own that imports no package of kettlefleet's, so it keeps this copy.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

var auditLine = regexp.MustCompile(`audit: acked=(\d+) stored=(\d+) lost=(\d+) duplicated=(\d+)`)

// swarm runs a short simulated fleet against target (prefix: how to run
// the binary, e.g. nsenter into a namespace) and wants a clean audit.
func swarm(t *testing.T, prefix []string, bin, target, dataDir string) string {
	t.Helper()
	args := append(append([]string{}, prefix...), bin, "swarm", "--target", target, "--data-dir", dataDir,
		"--devices", "40", "--interval", "1s", "--duration", "8s", "--report=false", "--sample=false",
		// The SLO is not what is tested here (qemu emulates a CPU).
		"--slo-p99", "30s", "--out", t.TempDir())
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("swarm: %v\n%s", err, out)
	}
	m := auditLine.FindStringSubmatch(string(out))
	if m == nil || m[1] == "0" || m[3] != "0" || m[4] != "0" || m[1] != m[2] {
		t.Fatalf("swarm: no clean audit with readings in:\n%s", out)
	}
	return m[0]
}

// TestArm64ServeUnderQemu: the arm64 release binary serves under
// qemu-user, a swarm (the amd64 binary) against it audits clean, SIGTERM
// drains.
func TestArm64ServeUnderQemu(t *testing.T) {
	d := dist(t)
	data := t.TempDir()
	addr := freeAddr(t)
	srv := startProc(t, nil, qemu(t, "arm64"), filepath.Join(d, "kettle_linux_arm64"), "serve", "--addr", addr, "--data-dir", data,
		"--db", "sqlite:"+filepath.Join(data, "kettle.db"))
	srv.waitFor(t, "kettle serve (arm64) listening", 2*time.Minute, func() bool {
		return strings.Contains(srv.out.String(), "listening on")
	})
	t.Log(swarm(t, nil, filepath.Join(d, "kettle_linux_amd64"), "http://"+addr, data))
	srv.stop(t)
}

// TestImageReproducible: the image of the same binaries, version and
// epoch, built twice, has the same digest.
func TestImageReproducible(t *testing.T) {
	d := dist(t)
	a := buildImage(t, d, filepath.Join(t.TempDir(), "oci"))
	b := buildImage(t, d, filepath.Join(t.TempDir(), "oci"))
	if a != b {
		t.Fatalf("two builds of the image: %s, then %s", a, b)
	}
	if !strings.HasPrefix(a, "sha256:") {
		t.Fatalf("digest %q", a)
	}
}

var indexLine = regexp.MustCompile(`(?m)^index (sha256:[0-9a-f]{64}) `)

// buildImage runs cmd/image on a release directory, returns the index digest.
func buildImage(t *testing.T, dist, out string) string {
	t.Helper()
	cmd := exec.Command("go", "run", "./cmd/image", "--amd64", filepath.Join(dist, "kettle_linux_amd64"),
		"--arm64", filepath.Join(dist, "kettle_linux_arm64"), "--out", out, "--version", "9.9.9-test",
		"--revision", "test", "--epoch", "1700000000")
	cmd.Dir = filepath.Join(repo, "deploy/dist")
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cmd/image: %v\n%s", err, b)
	}
	m := indexLine.FindStringSubmatch(string(b))
	if m == nil {
		t.Fatalf("cmd/image printed no index digest:\n%s", b)
	}
	return m[1]
}

// TestImageRuns unpacks the image's amd64 root filesystem and starts its
// entrypoint as a container runtime would, without one: fresh mount, PID
// and network namespaces (unshare), the volume /data a directory of the
// test's bound in, chroot into the root filesystem as the image's user,
// the image's environment. Then: /readyz 200 inside its network namespace,
// a swarm there with a clean audit, SIGTERM drains (exit 0).
func TestImageRuns(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("unshare and chroot need root: run the tests as root (make test)")
	}
	d := dist(t)
	layoutDir := filepath.Join(t.TempDir(), "oci")
	buildImage(t, d, layoutDir)
	root, err := os.MkdirTemp("", "kettle-rootfs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	if err := os.Chmod(root, 0o755); err != nil { // the image's "/"
		t.Fatal(err)
	}
	cfg := unpack(t, layoutDir, "amd64", root)
	if cfg.User != "65532:65532" {
		t.Fatalf("image user %q, want the non-root 65532:65532", cfg.User)
	}
	volume := t.TempDir()
	os.Chmod(filepath.Dir(volume), 0o755)
	if err := os.Chown(volume, 65532, 65532); err != nil {
		t.Fatal(err)
	}
	// The runtime's part: bring up the namespace's loopback, mount the
	// volume, drop to the image's user inside its root.
	// The image's environment only (env -i), as a runtime gives it.
	script := fmt.Sprintf(`set -e
ip link set lo up
mount --bind %q %q
exec env -i %s /usr/sbin/chroot --userspec=%s %q %s`, volume, filepath.Join(root, "data"), strings.Join(cfg.Env, " "), cfg.User, root, strings.Join(append(cfg.Entrypoint, cfg.Cmd...), " "))
	srv := startProc(t, nil, "unshare", "--mount", "--pid", "--net", "--fork", "--propagation", "private", "sh", "-c", script)
	var nsenter []string
	var pid1 int
	srv.waitFor(t, "kettle serve in the image listening", time.Minute, func() bool {
		if !strings.Contains(srv.out.String(), "listening on") {
			return false
		}
		pid := serveNsPID(srv.cmd.Process.Pid)
		if pid == 0 {
			return false
		}
		pid1 = pid
		nsenter = []string{"nsenter", "--target", fmt.Sprint(pid), "--net"}
		return true
	})
	code, err := exec.Command(nsenter[0], append(nsenter[1:], "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:8080/readyz")...).CombinedOutput()
	if err != nil || string(code) != "200" {
		t.Fatalf("/readyz inside the container: %q %v\n%s", code, err, srv.out)
	}
	t.Log(swarm(t, nsenter, filepath.Join(d, "kettle_linux_amd64"), "http://127.0.0.1:8080", volume))
	// As a runtime stops a container: SIGTERM to its PID 1.
	if err := syscall.Kill(pid1, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	srv.stop(t)
	if !strings.Contains(srv.out.String(), "drain") {
		t.Errorf("no drain in the output after SIGTERM:\n%s", srv.out)
	}
}

// serveNsPID finds kettle serve among the descendants of unshare (its
// PID 1 inside the namespace).
func serveNsPID(parent int) int {
	var walk func(pid int) int
	walk = func(pid int) int {
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		for _, f := range strings.Fields(string(kids)) {
			var k int
			fmt.Sscan(f, &k)
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", k)); strings.HasSuffix(exe, "/usr/bin/kettle") {
				return k
			}
			if got := walk(k); got != 0 {
				return got
			}
		}
		return 0
	}
	return walk(parent)
}
