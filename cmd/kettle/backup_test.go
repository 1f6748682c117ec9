package main_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

var backedUp = regexp.MustCompile(`backed up \S+ to (\S+) in \S+: (\d+) readings of (\d+) kettles, [\d.]+ MB \(counts agree, quick_check ok\)`)

// TestBackupAndRestore, as an operator does it: kettle backup while kettle
// serve takes uploads; kettle restore refused while the server runs and
// over an existing store without --replace; then, the server stopped, the
// store restored: a server on it holds every reading acknowledged before
// the backup started, the backup's count, and answers as the backup said.
func TestBackupAndRestore(t *testing.T) {
	dir := t.TempDir()
	dbPath := filepath.Join(dir, "kettle.db")
	db := "sqlite:" + dbPath
	p := serve(t, dir, db)
	op := operatorToken(dir)
	var devs []string
	for range 6 {
		_, b, err := req("POST", p.url+"/login", nil, `{"username":"k"}`)
		if err != nil {
			t.Fatal(err)
		}
		var u struct{ Username string }
		json.Unmarshal(b, &u)
		devs = append(devs, u.Username)
	}
	start := time.Now().Add(-time.Hour)
	stop := make(chan struct{})
	res := make(chan []reading)
	go func() { res <- load(p, devs, start, stop) }()
	time.Sleep(500 * time.Millisecond)
	close(stop)
	before := <-res // all acknowledged before the backup starts

	stop = make(chan struct{})
	go func() { res <- load(p, devs, start.Add(30*time.Minute), stop) }()
	time.Sleep(200 * time.Millisecond)
	out, err := exec.Command(kettleBin, "backup", "--db", db).CombinedOutput()
	time.Sleep(200 * time.Millisecond)
	close(stop)
	during := <-res
	if err != nil {
		t.Fatalf("kettle backup: %v\n%s", err, out)
	}
	m := backedUp.FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("kettle backup said:\n%s", out)
	}
	file := m[1]
	n, _ := strconv.Atoi(m[2])
	if filepath.Dir(file) != filepath.Join(dir, "backups") || n < len(before) || n > len(before)+len(during) || m[3] != "6" {
		t.Errorf("backup %s holds %s readings of %s kettles; want it in %s/backups, %d to %d readings (acknowledged before it and by its end), 6 kettles",
			file, m[2], m[3], dir, len(before), len(before)+len(during))
	}
	t.Logf("acknowledged: %d before the backup, %d around it; the backup holds %d", len(before), len(during), n)

	refused := func(want string, args ...string) {
		t.Helper()
		out, err := exec.Command(kettleBin, args...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), want) {
			t.Errorf("kettle %v: %v\n%s\nwant a refusal saying %q", args, err, out, want)
		}
	}
	refused("open in another process", "restore", "--db", db, "--from", file, "--replace")
	refused("--replace", "restore", "--db", db, "--from", file)
	refused("exists", "backup", "--db", db, "--out", file)
	refused("pg_dump", "backup", "--db", "postgres://kettle:secret@127.0.0.1:1/kettle")
	refused("--from is required", "restore", "--db", db)
	refused("is not a database", "restore", "--db", "sqlite:"+filepath.Join(dir, "new.db"), "--from", filepath.Join(dir, "operator-token"))
	if out, err := exec.Command(kettleBin, "backup", "--db", db, "--out", filepath.Join(dir, "x.db")).CombinedOutput(); err != nil || strings.Contains(string(out), "pg_dump") {
		t.Errorf("a second backup beside the server: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "secret") {
		t.Errorf("the PostgreSQL password is in the message")
	}

	p.cmd.Process.Signal(syscall.SIGTERM)
	if err := <-p.done; err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
	out, err = exec.Command(kettleBin, "restore", "--db", db, "--from", file, "--replace").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "restored "+dbPath+" from "+file) || !strings.Contains(string(out), ": "+m[2]+" readings of 6 kettles") {
		t.Fatalf("kettle restore: %v\n%s", err, out)
	}
	if _, err := os.Stat(dbPath + "-wal"); err == nil {
		t.Errorf("a -wal file is left beside the restored store")
	}
	p2 := serve(t, dir, db)
	stored := audit(t, p2, op, devs, before)
	if st := stats(t, p2, op); stored != n || int(st["measurement_count"].(float64)) != n {
		t.Errorf("restored store: history holds %d, measurement_count %v; the backup said %d", stored, st["measurement_count"], n)
	}
}
