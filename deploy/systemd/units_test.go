package systemd_test

import (
	"bufio"
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

var units = []string{"kettle.service", "kettle-writer.service", "kettle-swarm-worker.service"}

// kettleBin builds the binary the units start, once per test binary.
var kettleBin = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "kettle-units-")
	if err != nil {
		return "", err
	}
	bin, err := testkit.BuildKettle(dir)
	if err != nil {
		return "", err
	}
	// The unprivileged user of DynamicUser must be able to run it.
	return bin, os.Chmod(dir, 0o755)
})

func bin(t *testing.T) string {
	t.Helper()
	b, err := kettleBin()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestVerify runs systemd-analyze verify on each unit in a root holding the
// machine's own units and the binary at /usr/bin/kettle; any complaint
// (an unknown key is only a warning to systemd) fails.
func TestVerify(t *testing.T) {
	analyze := testkit.Tool(t, "systemd", "systemd-analyze")
	root := t.TempDir()
	for _, d := range []string{"usr/bin", "etc/systemd/system", "lib/systemd"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("cp", "-r", "/lib/systemd/system", filepath.Join(root, "lib/systemd/")).CombinedOutput(); err != nil {
		t.Fatalf("copy the machine's units: %v\n%s", err, out)
	}
	// A copy, not a link: systemd resolves a link's target outside --root.
	if out, err := exec.Command("cp", bin(t), filepath.Join(root, "usr/bin/kettle")).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, u := range units {
		b, err := os.ReadFile(u)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, "etc/systemd/system", u), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, u := range units {
		out, err := exec.Command(analyze, "verify", "--root="+root, u).CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", u, err, out)
		}
	}
}

// unit is what the test reads of a unit file: the [Service] settings it
// must reproduce to start ExecStart as systemd would.
type unit struct {
	execStart   []string
	env         []string
	envFiles    []string // "-" prefix: optional
	credentials [][2]string
	stateDir    string
	hardening   map[string]string
}

func parseUnit(t *testing.T, path string) unit {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u := unit{hardening: map[string]string{}}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "[") {
			section = line
			continue
		}
		if section != "[Service]" {
			continue
		}
		k, v, _ := strings.Cut(line, "=")
		switch k {
		case "ExecStart":
			u.execStart = strings.Fields(v)
		case "Environment":
			u.env = append(u.env, v)
		case "EnvironmentFile":
			u.envFiles = append(u.envFiles, v)
		case "LoadCredential":
			id, src, _ := strings.Cut(v, ":")
			u.credentials = append(u.credentials, [2]string{id, src})
		case "StateDirectory":
			u.stateDir = v
		case "SystemCallFilter":
			u.hardening[k] += v + " "
		default:
			u.hardening[k] = v
		}
	}
	return u
}

// TestHardening: what issue 55 asks of every unit.
func TestHardening(t *testing.T) {
	want := map[string]string{
		"Type": "notify", "DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
		"ProtectHome": "yes", "PrivateTmp": "yes", "CapabilityBoundingSet": "", "Restart": "on-failure",
	}
	for _, name := range units {
		u := parseUnit(t, name)
		for k, v := range want {
			if got, ok := u.hardening[k]; !ok || got != v {
				t.Errorf("%s: %s=%q, want %q", name, k, got, v)
			}
		}
		if !strings.Contains(u.hardening["SystemCallFilter"]+" ", "@system-service ") {
			t.Errorf("%s: SystemCallFilter=@system-service missing", name)
		}
		if u.hardening["LimitNOFILE"] == "" {
			t.Errorf("%s: no LimitNOFILE", name)
		}
		if len(u.credentials) == 0 {
			t.Errorf("%s: no LoadCredential: its secret would travel in argv or the environment", name)
		}
		for _, a := range u.execStart {
			if regexp.MustCompile(`(?i)token|secret|password`).MatchString(a) {
				t.Errorf("%s: ExecStart carries a secret in argv: %q", name, a)
			}
		}
	}
}

// systemdRun starts the unit's ExecStart the way systemd would: the
// specifiers %S (state) and %d (credentials) expanded, the credentials
// copied into a directory of their own readable only by the service's
// user, the state directory made and owned by it, Environment= and
// EnvironmentFile= applied in order, an unprivileged user (DynamicUser),
// and NOTIFY_SOCKET. etc stands for /etc: the operator's files are there.
type service struct {
	cmd    *exec.Cmd
	out    *bytes.Buffer
	notify *net.UnixConn
	done   chan error
}

const dynamicUID = 61_234 // any unused uid, as DynamicUser picks

func systemdRun(t *testing.T, name, etc string) *service {
	t.Helper()
	u := parseUnit(t, name)
	// Not t.TempDir: its parent is 0700, and the service's user must
	// reach its state and credentials.
	top, err := os.MkdirTemp("", "kettle-unit-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(top) })
	if err := os.Chmod(top, 0o755); err != nil {
		t.Fatal(err)
	}
	state, creds := filepath.Join(top, "state"), filepath.Join(top, "credentials")
	for _, d := range []string{state, creds} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if u.stateDir != "" {
		sd := filepath.Join(state, u.stateDir)
		if err := os.MkdirAll(sd, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(sd, dynamicUID, dynamicUID); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(state, 0o755)
	fromEtc := func(p string) string { return filepath.Join(etc, strings.TrimPrefix(p, "/etc/kettle/")) }
	for _, c := range u.credentials {
		b, err := os.ReadFile(fromEtc(c[1]))
		if err != nil {
			t.Fatalf("LoadCredential=%s:%s: %v (systemd refuses to start the unit)", c[0], c[1], err)
		}
		if err := os.WriteFile(filepath.Join(creds, c[0]), b, 0o400); err != nil {
			t.Fatal(err)
		}
		os.Chown(filepath.Join(creds, c[0]), dynamicUID, dynamicUID)
	}
	os.Chown(creds, dynamicUID, dynamicUID)
	expand := strings.NewReplacer("%S", state, "%d", creds, "%%", "%").Replace
	env := []string{"PATH=/usr/bin:/bin", "HOME=/"}
	for _, e := range u.env {
		env = append(env, expand(e))
	}
	for _, f := range u.envFiles {
		optional := strings.HasPrefix(f, "-")
		b, err := os.ReadFile(fromEtc(strings.TrimPrefix(f, "-")))
		if err != nil {
			if optional {
				continue
			}
			t.Fatalf("EnvironmentFile=%s: %v", f, err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				env = append(env, l)
			}
		}
	}
	sock := filepath.Join(top, "notify")
	nc, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(sock, 0o777)
	env = append(env, "NOTIFY_SOCKET="+sock)

	if u.execStart[0] != "/usr/bin/kettle" {
		t.Fatalf("ExecStart %q: want /usr/bin/kettle", u.execStart[0])
	}
	cmd := exec.Command(bin(t), u.execStart[1:]...)
	cmd.Env = env
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: dynamicUID, Gid: dynamicUID}}
	s := &service{cmd: cmd, out: &bytes.Buffer{}, notify: nc, done: make(chan error, 1)}
	cmd.Stdout, cmd.Stderr = s.out, s.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		nc.Close()
	})
	return s
}

// await reads notify messages until one holds want, or the process ends.
func (s *service) await(t *testing.T, want string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	buf := make([]byte, 4096)
	for {
		// Short reads, so that a service that exits is seen at once.
		s.notify.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, err := s.notify.Read(buf)
		if err != nil {
			select {
			case e := <-s.done:
				s.done <- e
				t.Fatalf("the service exited (%v) before sending %s:\n%s", e, want, s.out)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s on NOTIFY_SOCKET within %s: %v\n%s", want, within, err, s.out)
			}
			continue
		}
		for _, l := range strings.Split(string(buf[:n]), "\n") {
			if l == want {
				return
			}
		}
	}
}

func (s *service) stop(t *testing.T) {
	t.Helper()
	s.cmd.Process.Signal(syscall.SIGTERM)
	s.await(t, "STOPPING=1", 10*time.Second)
	select {
	case err := <-s.done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, s.out)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("no exit within 60 s of SIGTERM\n%s", s.out)
	}
}

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func get(url, token string) (int, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer res.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(res.Body)
	return res.StatusCode, b.String(), nil
}

// TestServeUnit: kettle.service as systemd starts it, the operator's
// secrets from /etc/kettle through LoadCredential, its settings from
// /etc/kettle/serve.env: READY=1 once it serves, the operator token
// from the credential works, /readyz 200, SIGTERM → STOPPING=1 and exit 0,
// the state (its store) in StateDirectory.
func TestServeUnit(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("runs the service as another user, as systemd does: run the tests as root (make test)")
	}
	etc := t.TempDir()
	addr := testkit.FreeAddr(t)
	op := "operator-token-from-a-credential-0123456789"
	writeFiles(t, etc, map[string]string{
		"operator-token": op + "\n",
		"secret":         "device-secret-from-a-credential-0123456789\n",
		"serve.env":      "KETTLE_ADDR=" + addr + "\n",
	})
	s := systemdRun(t, "kettle.service", etc)
	s.await(t, "READY=1", 30*time.Second)
	if code, body, err := get("http://"+addr+"/readyz", ""); err != nil || code != 200 {
		t.Fatalf("/readyz: %d %v %s", code, err, body)
	}
	if code, body, err := get("http://"+addr+"/v1/statistics", op); err != nil || code != 200 {
		t.Fatalf("/v1/statistics with the credential's operator token: %d %v %s\n%s", code, err, body, s.out)
	}
	if code, _, _ := get("http://"+addr+"/v1/statistics", "not-the-token"); code != 401 {
		t.Fatalf("/v1/statistics with another token: %d, want 401", code)
	}
	s.stop(t)
	if strings.Contains(s.out.String(), op) {
		t.Errorf("the operator token appears in the service's output:\n%s", s.out)
	}
}

// TestSwarmWorkerUnit: kettle-swarm-worker.service, its control token from
// a credential: READY=1 once it listens, a control request without the
// token refused, STOPPING=1 and exit 0 on SIGTERM.
func TestSwarmWorkerUnit(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("runs the service as another user, as systemd does: run the tests as root (make test)")
	}
	etc := t.TempDir()
	addr := testkit.FreeAddr(t)
	writeFiles(t, etc, map[string]string{
		"worker-token":     "worker-token-from-a-credential\n",
		"swarm-worker.env": "KETTLE_LISTEN=" + addr + "\n",
	})
	s := systemdRun(t, "kettle-swarm-worker.service", etc)
	s.await(t, "READY=1", 30*time.Second)
	code, _, err := get("http://"+addr+"/status", "wrong-token-wrong-token")
	if err != nil || code != 401 && code != 403 && code != 404 {
		t.Fatalf("a control request with the wrong token: %d %v", code, err)
	}
	s.stop(t)
}
