package main_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
)

// TestWorkerTokenRotation: the lab's worker token rotated as
// docs/operations.md says — between runs, a new token file on the worker
// and the controller, the worker restarted — after which a run with the new
// token is audited whole and a controller still holding the old one is
// refused, naming the flag.
func TestWorkerTokenRotation(t *testing.T) {
	dir := t.TempDir()
	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"))
	write := func(name, token string) string {
		t.Helper()
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	oldFile, newFile := write("old-worker-token", "lab-token-before-0123456789"), write("new-worker-token", "lab-token-after-9876543210")
	run := func(addr, tokenFile string) (string, error) {
		out, err := exec.Command(kettleBin, "swarm", "--target", p.url, "--data-dir", dir, "--workers", addr, "--worker-token-file", tokenFile,
			"--devices", "10", "--interval", "250ms", "--jitter", "20ms", "--duration", "1s",
			"--slo-p99", "0", "--sample=false", "--report=false", "--out", t.TempDir()).CombinedOutput()
		return string(out), err
	}
	audited := regexp.MustCompile(`audit: acked=[1-9]\d* stored=\d+ lost=0 duplicated=0`)
	const ip = "127.0.45.81"
	w, addr := startWorkerWith(t, ip, "--token-file", oldFile)
	if out, err := run(addr, oldFile); err != nil || !audited.MatchString(out) {
		t.Fatalf("a run before the rotation: %v\n%s", err, out)
	}

	// The rotation: the worker restarted on the new file.
	w.cmd.Process.Signal(syscall.SIGTERM)
	if err := <-w.done; err != nil {
		t.Fatalf("the worker's exit on SIGTERM: %v", err)
	}
	_, addr = startWorkerWith(t, ip, "--token-file", newFile)
	if out, err := run(addr, oldFile); err == nil || !strings.Contains(out, "--worker-token") {
		t.Fatalf("a controller with the old token after the rotation: %v, want refused naming --worker-token\n%s", err, out)
	}
	if out, err := run(addr, newFile); err != nil || !audited.MatchString(out) {
		t.Fatalf("a run with the new token: %v\n%s", err, out)
	}
}
