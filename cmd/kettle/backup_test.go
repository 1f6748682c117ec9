package main_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/pgtest"
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
	devs := logins(t, p, 6)
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
	prom := filepath.Join(dir, "kettle_backup.prom")
	began := time.Now()
	out, err := exec.Command(kettleBin, "backup", "--db", db, "--metrics-file", prom).CombinedOutput()
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
	privateBackup(t, file)
	n, _ := strconv.Atoi(m[2])
	if filepath.Dir(file) != filepath.Join(dir, "backups") || n < len(before) || n > len(before)+len(during) || m[3] != "6" {
		t.Errorf("backup %s holds %s readings of %s kettles; want it in %s/backups, %d to %d readings (acknowledged before it and by its end), 6 kettles",
			file, m[2], m[3], dir, len(before), len(before)+len(during))
	}
	t.Logf("acknowledged: %d before the backup, %d around it; the backup holds %d", len(before), len(during), n)
	// --metrics-file: the backup's gauges, for node_exporter.
	gauges := map[string]float64{}
	text, err := os.ReadFile(prom)
	for _, line := range strings.Split(string(text), "\n") {
		if f := strings.Fields(line); len(f) == 2 && !strings.HasPrefix(line, "#") {
			gauges[f[0]], _ = strconv.ParseFloat(f[1], 64)
		}
	}
	st, serr := os.Stat(file)
	at := gauges["kettle_backup_last_success_timestamp_seconds"]
	if err != nil || serr != nil || gauges["kettle_backup_last_measurements"] != float64(n) || gauges["kettle_backup_last_size_bytes"] != float64(st.Size()) ||
		at < float64(began.Unix()) || at > float64(time.Now().Unix()+1) || gauges["kettle_backup_last_duration_seconds"] <= 0 {
		t.Errorf("--metrics-file %s (%v): %v; want the backup's time, duration, %d readings and its file's size", prom, err, gauges, n)
	}

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
	refused("127.0.0.1:1", "backup", "--db", "postgres://kettle:secret@127.0.0.1:1/kettle")
	refused("--from is required", "restore", "--db", db)
	refused("is not a database", "restore", "--db", "sqlite:"+filepath.Join(dir, "new.db"), "--from", filepath.Join(dir, "operator-token"))
	if out, err := exec.Command(kettleBin, "backup", "--db", "postgres://kettle:secret@127.0.0.1:1/kettle").CombinedOutput(); strings.Contains(string(out), "secret") {
		t.Errorf("kettle backup: %v; the PostgreSQL password is in the message:\n%s", err, out)
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

// TestPostgresBackupAndRestore: kettle backup of a PostgreSQL database
// while kettle serve takes uploads (pg_dump of the snapshot it holds), then
// kettle restore into an empty database (refused into one with tables). A
// server on the copy holds every reading acknowledged before the backup
// and exactly the count the backup reported, and takes new readings (its
// migrations are seen as applied, its partitions are in place).
func TestPostgresBackupAndRestore(t *testing.T) {
	src, dst := pgtest.Start(t), pgtest.Start(t)
	dir := t.TempDir()
	p := serve(t, dir, src)
	op := operatorToken(dir)
	devs := logins(t, p, 4)
	start := time.Now().Add(-40 * 24 * time.Hour) // last month's partition too
	stop := make(chan struct{})
	res := make(chan []reading)
	go func() { res <- load(p, devs, start, stop) }()
	time.Sleep(500 * time.Millisecond)
	close(stop)
	before := <-res

	stop = make(chan struct{})
	go func() { res <- load(p, devs, start.Add(time.Hour), stop) }()
	time.Sleep(200 * time.Millisecond)
	file := filepath.Join(dir, "kettle.dump")
	out, err := exec.Command(kettleBin, "backup", "--db", src, "--out", file).CombinedOutput()
	close(stop)
	during := <-res
	if err != nil {
		t.Fatalf("kettle backup: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`backed up PostgreSQL database \S+ to \S+ in \S+: (\d+) readings of 4 kettles, [\d.]+ MB \((\d+) tables' data; pg_restore --list ok\)`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("kettle backup said:\n%s", out)
	}
	privateBackup(t, file)
	n, _ := strconv.Atoi(m[1])
	if n < len(before) || n > len(before)+len(during) || m[2] == "0" {
		t.Errorf("the backup holds %d readings; want %d to %d (acknowledged before it and by its end)", n, len(before), len(before)+len(during))
	}
	t.Logf("acknowledged: %d before the backup, %d around it; the backup holds %d in %s tables", len(before), len(during), n, m[2])
	p.cmd.Process.Signal(syscall.SIGTERM)
	if err := <-p.done; err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}

	if out, err := exec.Command(kettleBin, "restore", "--db", src, "--from", file).CombinedOutput(); err == nil || !strings.Contains(string(out), "empty database") {
		t.Errorf("kettle restore into the database the backup came from: %v\n%s\nwant a refusal", err, out)
	}
	out, err = exec.Command(kettleBin, "restore", "--db", dst, "--from", file).CombinedOutput()
	if err != nil || !strings.Contains(string(out), fmt.Sprintf(": %d readings of 4 kettles", n)) {
		t.Fatalf("kettle restore: %v\n%s", err, out)
	}
	p2 := serve(t, dir, dst)
	stored := audit(t, p2, op, devs, before)
	if c := stats(t, p2, op)["measurement_count"].(float64); stored != n || int(c) != n {
		t.Errorf("restored database: history holds %d, measurement_count %v; the backup said %d", stored, c, n)
	}
	body := fmt.Sprintf(`{"time":%q,"charge_now":40,"charge_full":100,"charge_rate":-1,"ambient_temp":20,"water_temp":70,"water_level":300}`,
		time.Now().UTC().Format(time.RFC3339Nano))
	if st, b, err := req("POST", p2.url+"/measurement", map[string]string{"servant-auth-cookie": devs[0]}, body); err != nil || st != 200 {
		t.Errorf("an upload to the restored database: %d %v %s", st, err, b)
	}
	if c := stats(t, p2, op)["measurement_count"].(float64); int(c) != n+1 {
		t.Errorf("after one more upload: measurement_count %v, want %d", c, n+1)
	}
}

// TestBackupKeep: kettle backup --dir D --keep N leaves N backups in D, the
// new one among them, removing the oldest by the time in their names; it
// touches nothing else there (other files, a backup being written, the
// other store's backups, a directory named like a backup), and nothing at
// all when the backup fails. --keep with an --out it would never count, or
// beside --dir, is refused before anything is written.
func TestBackupKeep(t *testing.T) {
	dir := t.TempDir()
	db := "sqlite:" + filepath.Join(dir, "kettle.db")
	if out, err := exec.Command(kettleBin, "seed", "--db", db, "--devices", "3", "--days", "1", "--interval", "1h").CombinedOutput(); err != nil {
		t.Fatalf("kettle seed: %v\n%s", err, out)
	}
	bdir := filepath.Join(dir, "nightly")
	os.Mkdir(bdir, 0o755)
	old := []string{"kettle-20260101T000000Z.db", "kettle-20260102T000000Z.db", "kettle-20260103T000000Z.db",
		"kettle-20990101T000000Z.db"} // a clock once set forward: newest by name
	others := []string{"kettle-20250101T000000Z.dump", "kettle-20250101T000000Z.db.partial", "kettle-latest.db", "notes.txt", "kettle-20250101T000000Z.db~"}
	for _, name := range append(slices.Clone(old), others...) {
		os.WriteFile(filepath.Join(bdir, name), []byte(name), 0o644)
	}
	os.Mkdir(filepath.Join(bdir, "kettle-20250102T000000Z.db"), 0o755)
	ls := func() []string {
		t.Helper()
		entries, _ := os.ReadDir(bdir)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		return names
	}
	before := ls()

	refused := func(want string, args ...string) {
		t.Helper()
		out, err := exec.Command(kettleBin, append([]string{"backup", "--db"}, args...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), want) {
			t.Errorf("kettle backup --db %v: %v\n%s\nwant a refusal saying %q", args, err, out, want)
		}
		if got := ls(); !slices.Equal(got, before) {
			t.Errorf("kettle backup --db %v, refused, changed %s: %v, was %v", args, bdir, got, before)
		}
	}
	refused("use --dir DIR instead of --out", db, "--keep", "2", "--out", filepath.Join(bdir, "kettle.db"))
	refused("--out and --dir", db, "--dir", bdir, "--out", filepath.Join(bdir, "x.db"))
	refused("--keep -1", db, "--dir", bdir, "--keep", "-1")
	refused("no database file there", "sqlite:"+filepath.Join(dir, "missing.db"), "--dir", bdir, "--keep", "1")
	refused("127.0.0.1:1", "postgres://kettle@127.0.0.1:1/kettle", "--dir", bdir, "--keep", "1")
	never := filepath.Join(dir, "never")
	refused("127.0.0.1:1", "postgres://kettle@127.0.0.1:1/kettle", "--dir", never)
	if _, err := os.Stat(never); err == nil {
		t.Errorf("a backup that could not reach its database created %s", never)
	}

	out, err := exec.Command(kettleBin, "backup", "--db", db, "--dir", bdir, "--keep", "3", "--check=false").CombinedOutput()
	m := regexp.MustCompile(`backed up \S+ to (\S+) in .*\nremoved 2 older backups \(--keep 3; 3 left in (\S+)\): kettle-20260101T000000Z.db kettle-20260102T000000Z.db\n$`).FindStringSubmatch(string(out))
	if err != nil || m == nil || filepath.Dir(m[1]) != bdir || m[2] != bdir {
		t.Fatalf("kettle backup --dir %s --keep 3: %v\n%s", bdir, err, out)
	}
	want := slices.Sorted(slices.Values(append([]string{filepath.Base(m[1]), "kettle-20250102T000000Z.db", old[2], old[3]}, others...)))
	if got := ls(); !slices.Equal(got, want) {
		t.Errorf("after --keep 3: %s holds\n%v\nwant\n%v", bdir, got, want)
	}
	// --keep 1: the new backup is kept even though a name sorts after it.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second))) // a new name
	out, err = exec.Command(kettleBin, "backup", "--db", db, "--dir", bdir, "--keep", "1", "--check=false").CombinedOutput()
	m2 := regexp.MustCompile(`backed up \S+ to (\S+) in `).FindStringSubmatch(string(out))
	if err != nil || m2 == nil || !strings.Contains(string(out), "removed 3 older backups (--keep 1; 1 left in ") {
		t.Fatalf("kettle backup --keep 1: %v\n%s", err, out)
	}
	want = slices.Sorted(slices.Values(append([]string{filepath.Base(m2[1]), "kettle-20250102T000000Z.db"}, others...)))
	if got := ls(); !slices.Equal(got, want) {
		t.Errorf("after --keep 1: %s holds\n%v\nwant\n%v", bdir, got, want)
	}
}

// privateBackup: a backup holds the v0 kettles' credentials: 0600, in a
// directory only its owner enters when kettle backup made it.
func privateBackup(t *testing.T, file string) {
	t.Helper()
	st, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("backup %s has mode %v, want 0600", file, st.Mode().Perm())
	}
	if d, err := os.Stat(filepath.Dir(file)); err == nil && filepath.Base(filepath.Dir(file)) == "backups" && d.Mode().Perm() != 0o700 {
		t.Errorf("backup directory %s has mode %v, want 0700", filepath.Dir(file), d.Mode().Perm())
	}
}
