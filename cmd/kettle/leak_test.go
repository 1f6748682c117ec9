package main_test

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet/internal/leaktest"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// newLeakSecrets are known values given to every command of
// TestNoSecretLeaks, on the command line where a careless operator would
// put them (argv is the worst case: what is there is most likely to be
// echoed).
func newLeakSecrets() leaktest.Secrets {
	r := strings.ReplaceAll(uuid.NewString(), "-", "")
	return leaktest.Secrets{
		"operator token":  "opTOKEN" + r,
		"device secret":   "devSECRET" + r,
		"MQTT password":   "mqttPW" + r,
		"database secret": "dbPW" + r,
		"worker token":    "wrkTOKEN" + r,
	}
}

// ownSecretFile: the secrets' own files are where secrets live by design.
func ownSecretFile(p string) bool {
	switch filepath.Base(p) {
	case "operator-token", "secret", "operator-token.file", "secret.file", "worker-token.file", "mqtt-password.file":
		return true
	}
	return false
}

// getAll answers every route of the OpenAPI document (with and without the
// operator token, with a good and a bad body) and the operational routes,
// and adds each answer — status, headers, body — to c.
func getAll(t *testing.T, c leaktest.Corpus, base, op, device string) {
	t.Helper()
	res, err := http.Get(base + "/openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	c.Add("GET /openapi.json", string(b))
	var doc struct {
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	do := func(method, path, auth, body string) {
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", "Bearer "+auth)
		}
		req.Header.Set("Content-Type", "application/json")
		res, err := client.Do(req)
		if err != nil {
			c.Add(method+" "+path, err.Error())
			return
		}
		rb, _ := io.ReadAll(res.Body)
		res.Body.Close()
		var h strings.Builder
		res.Header.Write(&h)
		c.Add(method+" "+path+" ("+auth[:min(3, len(auth))]+")", res.Status+"\n"+h.String()+string(rb))
	}
	for p, ops := range doc.Paths {
		path := strings.ReplaceAll(p, "{id}", device)
		for m := range ops {
			method := strings.ToUpper(m)
			if method == "PARAMETERS" {
				continue
			}
			for _, auth := range []string{"", op, "wrong-token-0123456789"} {
				do(method, path, auth, `{"bad":`)
				do(method, path+"?limit=x&since=yesterday", auth, `{}`)
			}
		}
	}
	do("POST", "/session", "", `{"token":"wrong"}`)
}

// TestNoSecretLeaks: kettle serve on SQLite and on PostgreSQL, kettle swarm
// over a worker, kettle capacity, kettle report, kettle backup and restore
// and kettle demo, each run with known secrets given on the command line —
// the operator token, the device secret, the MQTT password, the database
// password and the worker token. Then every file they wrote, every line
// they logged, and every answer of every route (error bodies, /metrics,
// /openapi.json, pprof on --debug-addr) is searched: none holds any of them.
func TestNoSecretLeaks(t *testing.T) {
	s := newLeakSecrets()
	c := leaktest.Corpus{}
	top := t.TempDir()

	// kettle serve on SQLite, every secret on its command line, pprof on.
	dir := filepath.Join(top, "sqlite")
	os.MkdirAll(dir, 0o700)
	debug := testkit.FreeAddr(t)
	p := serve(t, dir, "sqlite:"+filepath.Join(dir, "k.db"),
		"--operator-token", s["operator token"], "--secret", s["device secret"],
		"--mqtt-password", s["MQTT password"], "--debug-addr", debug, "--access-log-sample", "1", "--log-level", "debug")
	devs := logins(t, p, 3)
	load(p, devs, time.Now().Add(-time.Hour), closedAfter(300*time.Millisecond))
	dev := uuid.NewString()
	getAll(t, c, p.url, s["operator token"], dev)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/goroutine?debug=2"} {
		res, err := http.Get("http://" + debug + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		c.Add("pprof "+path, string(b))
	}

	// The lab: a worker, the controller with every secret on its command line.
	const workerIP = "127.0.45.71"
	w, addr := startWorker(t, workerIP, s["worker token"])
	out := filepath.Join(top, "swarm")
	b, err := exec.Command(kettleBin, "swarm", "--target", p.url, "--workers", addr, "--worker-token", s["worker token"],
		"--operator-token", s["operator token"], "--secret", s["device secret"],
		"--devices", "20", "--interval", "250ms", "--duration", "3s", "--slo-p99", "0", "--sample=false", "--out", out).CombinedOutput()
	c.Add("kettle swarm --workers output", string(b))
	if err != nil {
		t.Fatalf("swarm over a worker: %v\n%s", err, b)
	}
	b, err = exec.Command(kettleBin, "report", filepath.Join(out, "results.json"), "-o", filepath.Join(out, "again.html")).CombinedOutput()
	c.Add("kettle report output", string(b))
	if err != nil {
		t.Fatalf("report: %v\n%s", err, b)
	}
	capOut := filepath.Join(top, "capacity")
	b, _ = exec.Command(kettleBin, "capacity", "--target", p.url, "--operator-token", s["operator token"], "--secret", s["device secret"],
		"--start", "20", "--step", "20", "--max", "40", "--step-duration", "2s", "--interval", "1s", "--sample=false", "--out", capOut).CombinedOutput()
	c.Add("kettle capacity output", string(b))

	// Backup and restore of the SQLite store.
	bk := filepath.Join(top, "backup", "k.db")
	b, err = exec.Command(kettleBin, "backup", "--db", "sqlite:"+filepath.Join(dir, "k.db"), "--out", bk).CombinedOutput()
	c.Add("kettle backup output", string(b))
	if err != nil {
		t.Fatalf("backup: %v\n%s", err, b)
	}
	b, _ = exec.Command(kettleBin, "restore", "--db", "sqlite:"+filepath.Join(top, "restored", "k.db"), "--from", bk).CombinedOutput()
	c.Add("kettle restore output", string(b))
	p.cmd.Process.Signal(os.Interrupt)
	<-p.done
	c.Add("kettle serve (SQLite) log", p.log.String())
	c.Add("kettle swarm worker log", w.log.String())

	// kettle serve on PostgreSQL, its password in the DSN.
	pgDSN := withPassword(t, pgtest.Start(t), s["database secret"])
	pdir := filepath.Join(top, "postgres")
	os.MkdirAll(pdir, 0o700)
	pp := serve(t, pdir, pgDSN, "--operator-token", s["operator token"], "--secret", s["device secret"], "--access-log-sample", "1")
	pdevs := logins(t, pp, 2)
	load(pp, pdevs, time.Now().Add(-time.Hour), closedAfter(200*time.Millisecond))
	getAll(t, c, pp.url, s["operator token"], uuid.NewString())
	b, _ = exec.Command(kettleBin, "backup", "--db", pgDSN, "--out", filepath.Join(top, "pgbackup", "k.dump")).CombinedOutput()
	c.Add("kettle backup (PostgreSQL) output", string(b))
	bad := strings.Replace(pgDSN, "dbname=", "port=1 dbname=", 1)
	b, _ = exec.Command(kettleBin, "backup", "--db", bad, "--out", filepath.Join(top, "pgbackup", "bad.dump")).CombinedOutput()
	c.Add("kettle backup (unreachable PostgreSQL) output", string(b))
	pp.cmd.Process.Signal(os.Interrupt)
	<-pp.done
	c.Add("kettle serve (PostgreSQL) log", pp.log.String())

	// kettle demo: its own generated secrets, searched for the same way.
	ddir := filepath.Join(top, "demo")
	b, err = exec.Command(kettleBin, "demo", "--data-dir", ddir, "--devices", "30", "--conns", "10", "--hatch-rate", "0",
		"--interval", "1s", "--duration", "3s", "--slo-p99", "0", "--sample=false", "--out", filepath.Join(top, "demo-out")).CombinedOutput()
	c.Add("kettle demo output", string(b))
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, b)
	}
	for _, name := range []string{"operator-token", "secret"} {
		v, err := os.ReadFile(filepath.Join(ddir, name))
		if err != nil {
			t.Fatal(err)
		}
		s["demo's "+name] = strings.TrimSpace(string(v))
	}

	c.Files(top, ownSecretFile)
	c.Check(t, s, 10)
}

// withPassword gives a keyword/value DSN a password (pgtest's cluster
// trusts local connections, so any password is accepted: the test is of
// where the DSN is echoed, not of authentication).
func withPassword(t *testing.T, dsn, pw string) string {
	t.Helper()
	if !regexp.MustCompile(`^host=`).MatchString(dsn) {
		t.Fatalf("pgtest DSN %q: want keyword/value", dsn)
	}
	return dsn + " password=" + pw
}

func closedAfter(d time.Duration) chan struct{} {
	ch := make(chan struct{})
	time.AfterFunc(d, func() { close(ch) })
	return ch
}
