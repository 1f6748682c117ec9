package main_test

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
)

// TestSwarmWorkersOverTLSChannel: the lab's control channel over TLS with
// mutual authentication — a worker with --tls-cert and --client-ca, the
// controller verifying it with --worker-ca and presenting --worker-cert.
// The run completes with a clean audit; without the client certificate the
// worker refuses the controller; a worker listening off loopback without
// TLS refuses to start, and a controller refuses plain HTTP to a worker
// off loopback, each naming the flag.
func TestSwarmWorkersOverTLSChannel(t *testing.T) {
	dir := t.TempDir()
	wCert, wKey := filepath.Join(dir, "worker.pem"), filepath.Join(dir, "worker-key.pem")
	cCert, cKey := filepath.Join(dir, "ctl.pem"), filepath.Join(dir, "ctl-key.pem")
	tlscerttest.Write(t, wCert, wKey, time.Now().Add(time.Hour))
	tlscerttest.Write(t, cCert, cKey, time.Now().Add(time.Hour))
	const token = "tls-lab-token-0123456789"

	_, addr := startWorkerWith(t, "127.0.0.1", "--token", token, "--tls-cert", wCert, "--tls-key", wKey, "--client-ca", cCert)

	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"))
	run := func(extra ...string) (string, error) {
		args := append([]string{"swarm", "--target", p.url, "--data-dir", dir, "--workers", addr, "--worker-token", token,
			"--devices", "20", "--interval", "250ms", "--jitter", "20ms", "--duration", "3s",
			"--slo-p99", "0", "--sample=false", "--report=false", "--out", t.TempDir()}, extra...)
		out, err := exec.Command(kettleBin, args...).CombinedOutput()
		return string(out), err
	}
	out, err := run("--worker-ca", wCert, "--worker-cert", cCert, "--worker-key", cKey)
	if err != nil || !regexp.MustCompile(`audit: acked=[1-9]\d* stored=\d+ lost=0 duplicated=0`).MatchString(out) {
		t.Fatalf("over mutual TLS: %v\n%s", err, out)
	}
	if out, err := run("--worker-ca", wCert); err == nil || !strings.Contains(out, "certificate") {
		t.Fatalf("without the controller's certificate: %v, want a refusal\n%s", err, out)
	}
	if out, err := run(); err == nil {
		t.Fatalf("plain HTTP to a TLS worker: ran\n%s", out)
	}

	out2, err := exec.Command(kettleBin, "swarm", "worker", "--listen", "0.0.0.0:0", "--token", token).CombinedOutput()
	if err == nil || !strings.Contains(string(out2), "--tls-cert") {
		t.Fatalf("a worker off loopback without TLS: %v, want a refusal naming --tls-cert\n%s", err, out2)
	}
	out3, err := exec.Command(kettleBin, "swarm", "--target", p.url, "--data-dir", dir, "--workers", "192.0.2.1:7070",
		"--worker-token", token, "--devices", "10", "--duration", "2s", "--sample=false", "--report=false").CombinedOutput()
	if err == nil || !strings.Contains(string(out3), "--worker-ca") {
		t.Fatalf("plain HTTP to a worker off loopback: %v, want a refusal naming --worker-ca\n%s", err, out3)
	}
}
