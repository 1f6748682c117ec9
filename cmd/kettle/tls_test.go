package main_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
	"github.com/kettlefleet/kettlefleet/sim"
)

// serveTLS starts kettle serve on SQLite in dir with data as its data
// directory and a self-signed certificate valid for a month (--tls-cert),
// and returns it with the certificate's file.
func serveTLS(t *testing.T, dir, data string, extra ...string) (*proc, string) {
	t.Helper()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	tlscerttest.Write(t, certFile, keyFile, time.Now().Add(30*24*time.Hour))
	return serve(t, data, "sqlite:"+filepath.Join(dir, "k.db"), append([]string{"--tls-cert", certFile, "--tls-key", keyFile}, extra...)...), certFile
}

// TestSwarmOverTLS: kettle swarm against kettle serve --tls-cert, the
// server's certificate trusted through --ca: every acknowledged reading
// stored (the audit), the handshakes counted, resumed or not as
// --tls-resume says, the server sampled through its https /metrics; a swarm
// that does not trust the certificate fails with the reason.
func TestSwarmOverTLS(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	p, certFile := serveTLS(t, dir, data, "--mqtt-addr", "127.0.0.1:0")
	if !strings.HasPrefix(p.url, "https://") {
		t.Fatalf("kettle serve --tls-cert listens on %s", p.url)
	}

	swarm := func(out string, extra ...string) (string, error) {
		args := append([]string{"swarm", "--target", p.url, "--data-dir", data, "--devices", "100", "--interval", "1s",
			"--duration", "5s", "--slo-p99", "5s", "--out", out, "--report=false"}, extra...)
		b, err := exec.Command(kettleBin, args...).CombinedOutput()
		return string(b), err
	}
	tally := regexp.MustCompile(`tls: (\d+) handshakes, (\d+) of them resumed`)
	for _, resume := range []bool{true, false} {
		out := filepath.Join(dir, "run-resume-"+map[bool]string{true: "on", false: "off"}[resume])
		log, err := swarm(out, "--ca", certFile, "--tls-resume="+map[bool]string{true: "true", false: "false"}[resume])
		if err != nil {
			t.Fatalf("swarm (resume %v): %v\n%s", resume, err, log)
		}
		m := regexp.MustCompile(`audit: acked=(\d+) stored=(\d+) lost=0 duplicated=0`).FindStringSubmatch(log)
		if m == nil || m[1] != m[2] || m[1] == "0" {
			t.Errorf("swarm (resume %v): no clean audit\n%s", resume, log)
		}
		h := tally.FindStringSubmatch(log)
		switch {
		case h == nil || h[1] != "100":
			t.Errorf("swarm (resume %v): want 100 handshakes (one a kettle)\n%s", resume, log)
		case resume && h[2] == "0", !resume && h[2] != "0":
			t.Errorf("swarm (resume %v): %s of %s handshakes resumed", resume, h[2], h[1])
		}
		b, err := os.ReadFile(filepath.Join(out, "results.json"))
		if err != nil {
			t.Fatal(err)
		}
		var res sim.Results
		if err := json.Unmarshal(b, &res); err != nil {
			t.Fatal(err)
		}
		if !res.Params.TLS || res.Params.TLSResume != resume || res.Totals.TLSHandshakes != 100 {
			t.Errorf("results.json (resume %v): params %+v, %d handshakes", resume, res.Params, res.Totals.TLSHandshakes)
		}
		scraped := 0
		if res.System != nil {
			for _, s := range res.System.Samples {
				if s.Server != nil && s.Server.Up {
					scraped++
				}
			}
		}
		if scraped == 0 {
			t.Errorf("results.json (resume %v): the server's /metrics were not scraped over https", resume)
		}
	}

	// MQTT kettles over TLS, to the listener the banner names.
	m := regexp.MustCompile(`MQTT over TLS on (\S+)`).FindStringSubmatch(p.log.String())
	if m == nil {
		t.Fatalf("the banner names no MQTT listener over TLS:\n%s", p.log)
	}
	log, err := swarm(filepath.Join(dir, "mqtt"), "--ca", certFile, "--protocol", "mqtt", "--mqtt-target", m[1], "--devices", "50")
	if err != nil {
		t.Fatalf("swarm over MQTT with TLS: %v\n%s", err, log)
	}
	if a := regexp.MustCompile(`audit: acked=(\d+) stored=(\d+) lost=0 duplicated=0`).FindStringSubmatch(log); a == nil || a[1] != a[2] || a[1] == "0" {
		t.Errorf("swarm over MQTT with TLS: no clean audit\n%s", log)
	}
	if h := tally.FindStringSubmatch(log); h == nil || h[1] != "50" {
		t.Errorf("swarm over MQTT with TLS: want 50 handshakes\n%s", log)
	}

	// Not trusted: the swarm says why and fails.
	other := filepath.Join(dir, "other.pem")
	tlscerttest.Write(t, other, "", time.Now().Add(time.Hour))
	log, err = swarm(filepath.Join(dir, "untrusted"), "--ca", other)
	if err == nil || !strings.Contains(log, "certificate signed by unknown authority") {
		t.Errorf("a swarm that distrusts the certificate: %v\n%s", err, log)
	}
	// --ca for a plain target is a mistake, said before anything runs.
	b, err := exec.Command(kettleBin, "swarm", "--target", "http://127.0.0.1:1", "--ca", certFile).CombinedOutput()
	if err == nil || !strings.Contains(string(b), "is not https") {
		t.Errorf("--ca with an http target: %v\n%s", err, b)
	}
}

// TestSwarmWorkersOverTLS: kettle swarm --workers against kettle serve
// --tls-cert. Only the controller is given --ca; the workers trust the
// server's certificate from their plans, every kettle's connection is a TLS
// handshake, and the merged audit is clean.
func TestSwarmWorkersOverTLS(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	p, certFile := serveTLS(t, dir, data)
	const token = "tls-lab-token-0123456789"
	var addrs []string
	for i := range 2 {
		_, a := startWorker(t, fmt.Sprintf("127.0.45.%d", 31+i), token)
		addrs = append(addrs, a)
	}
	lab := func(extra ...string) (string, error) {
		args := append([]string{"swarm", "--target", p.url, "--data-dir", data,
			"--workers", strings.Join(addrs, ","), "--worker-token", token,
			"--devices", "40", "--interval", "500ms", "--duration", "3s", "--slo-p99", "5s",
			"--sample=false", "--report=false", "--out", filepath.Join(dir, "out")}, extra...)
		b, err := exec.Command(kettleBin, args...).CombinedOutput()
		return string(b), err
	}
	log, err := lab("--ca", certFile)
	if err != nil {
		t.Fatalf("lab over TLS: %v\n%s", err, log)
	}
	if m := regexp.MustCompile(`audit: acked=(\d+) stored=(\d+) lost=0 duplicated=0`).FindStringSubmatch(log); m == nil || m[1] != m[2] || m[1] == "0" {
		t.Errorf("lab over TLS: no clean audit\n%s", log)
	}
	if !strings.Contains(log, "tls: 40 handshakes") {
		t.Errorf("lab over TLS: want 40 handshakes (one a kettle)\n%s", log)
	}
	// Without --ca the workers check the certificate against the system's
	// roots, which do not hold this self-signed one.
	log, err = lab()
	if err == nil || !strings.Contains(log, "certificate") {
		t.Errorf("lab over TLS without --ca: %v, want a failure naming the certificate\n%s", err, log)
	}
}
