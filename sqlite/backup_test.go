package sqlite_test

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// TestBackupIsASnapshot: a backup taken while a writer commits batch after
// batch (and the merger moves staged rows) between the copy's steps holds
// exactly the batches
// committed up to one point — every batch acknowledged before Backup
// started, a prefix of the others, nothing torn — and is one checked file.
// Restored into a new file, over a crash image whose -wal holds newer
// commits, and over the source (refused while the source is open), a
// store opened on it answers as the source did at that commit.
func TestBackupIsASnapshot(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	src, out := filepath.Join(dir, "kettle.db"), filepath.Join(dir, "backups", "b.db")
	s := open(t, src, sqlite.WithMerge(150, time.Hour))
	const stepPages = 2 // many steps, commits between them
	devs := make([]kettle.DeviceID, 40)
	for i := range devs {
		devs[i] = kettle.DeviceID{byte(i * 6), byte(i), 1}
	}
	t0 := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	const perBatch = 10
	// Batch i: perBatch kettles, each one reading at t0 + i minutes.
	batch := func(i int) []kettle.Measurement {
		b := make([]kettle.Measurement, perBatch)
		for j := range b {
			b[j] = kettle.Measurement{Device: devs[(i*7+j)%len(devs)], Time: t0.Add(time.Duration(i) * time.Minute),
				ChargeMWh: float64(i), FullMWh: 1e6, RateMW: -1, AmbientC: 20, WaterC: float64(i % 90), LevelML: float64(j)}
		}
		return b
	}
	var committed atomic.Int64
	write := func(i int) {
		if _, err := s.Write(ctx, batch(i), t0.Add(time.Duration(i)*time.Minute)); err != nil {
			t.Errorf("write batch %d: %v", i, err)
			return
		}
		committed.Store(int64(i + 1))
	}
	if err := s.Register(ctx, devs, t0); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		write(i)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 50; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			write(i)
		}
	}()
	time.Sleep(50 * time.Millisecond)
	lo := committed.Load()
	var steps int
	var last [2]int64
	progress := func(done, total int64) { steps, last = steps+1, [2]int64{done, total} }
	info, err := sqlite.BackupSteps(ctx, src, out, true, progress, stepPages)
	hi := committed.Load()
	time.Sleep(50 * time.Millisecond)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("Backup: %v", err)
	}
	k := info.Measurements / perBatch
	if info.Measurements%perBatch != 0 || k < lo || k > hi || !info.Checked || info.Devices != int64(len(devs)) {
		t.Fatalf("backup holds %+v; want whole batches, %d to %d of them (committed before and after Backup), %d kettles, checked",
			info, lo, hi, len(devs))
	}
	t.Logf("batches committed: %d before Backup, %d after it returned, %d in the backup, %d in all", lo, hi, k, committed.Load())
	if steps < 2 || last[0] != last[1] || last[1] <= 0 {
		t.Errorf("progress: %d calls, the last %d of %d bytes; want one a step (2 pages), ending with all of them", steps, last[0], last[1])
	}
	for _, f := range []string{out + "-wal", out + "-shm", out + ".partial"} {
		if _, err := os.Stat(f); err == nil {
			t.Errorf("%s exists beside the backup; a backup is one file", f)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	gone := filepath.Join(dir, "backups", "cancelled.db")
	if _, err := sqlite.BackupSteps(cancelled, src, gone, true, nil, stepPages); err == nil {
		t.Errorf("Backup with its context cancelled: no error")
	}
	for _, f := range []string{gone, gone + ".partial"} {
		if _, err := os.Stat(f); err == nil {
			t.Errorf("%s exists after a cancelled backup", f)
		}
	}
	if _, err := sqlite.BackupSteps(ctx, src, out, false, nil, stepPages); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("a second Backup to %s: %v; want a refusal saying it exists", out, err)
	}

	plain := filepath.Join(dir, "plain.db")
	if db, err := sql.Open("sqlite3", plain); err == nil {
		_, err = db.Exec("CREATE TABLE t (x)")
		db.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := sqlite.BackupSteps(ctx, plain, filepath.Join(dir, "p.db"), false, nil, stepPages); err == nil || !strings.Contains(err.Error(), "not a kettle database") {
		t.Errorf("Backup of a SQLite file that is not a kettle store: %v; want a refusal", err)
	}

	// What the source held after batch k−1, computed.
	want := map[kettle.DeviceID][]kettle.Measurement{}
	for i := range int(k) {
		for _, m := range batch(i) {
			want[m.Device] = append(want[m.Device], m)
		}
	}
	verify := func(what, path string) {
		t.Helper()
		r := open(t, path)
		defer r.Close()
		st, err := r.Statistics(ctx, kettle.StatsQuery{})
		if err != nil || st.MeasurementCount != info.Measurements {
			t.Errorf("%s: statistics %+v, %v; want %d readings", what, st, err, info.Measurements)
		}
		for _, d := range devs {
			got, err := r.History(ctx, kettle.HistoryQuery{Device: d, Limit: 100000})
			if err != nil || !sameReadings(got, want[d]) {
				t.Errorf("%s: kettle %x: %d readings, %v; want %d, the batches before %d", what, d[:2], len(got), err, len(want[d]), k)
				return
			}
			ds, err := r.Device(ctx, d)
			if w := want[d]; err != nil || ds.Measurements != int64(len(w)) || ds.Latest == nil || !ds.Latest.Time.Equal(w[len(w)-1].Time) {
				t.Errorf("%s: kettle %x: state %+v, %v; want %d readings, the latest at %s", what, d[:2], ds, err, len(w), w[len(w)-1].Time)
				return
			}
		}
	}
	// A crash image of the source: its file and a -wal holding commits
	// newer than the backup (the writer went on after it).
	crash := filepath.Join(dir, "crash", "kettle.db")
	os.MkdirAll(filepath.Dir(crash), 0o755)
	for _, suffix := range []string{"", "-wal"} {
		b, err := os.ReadFile(src + suffix)
		if err == nil {
			err = os.WriteFile(crash+suffix, b, 0o644)
		}
		if err != nil || (suffix == "-wal" && len(b) == 0) {
			t.Fatalf("crash image %s: %d bytes, %v", crash+suffix, len(b), err)
		}
	}
	if img, err := sqlite.Inspect(ctx, crash, false); err != nil || img.Measurements <= info.Measurements {
		t.Fatalf("the crash image holds %d readings, %v; want more than the backup's %d", img.Measurements, err, info.Measurements)
	}
	if _, err := sqlite.Restore(ctx, out, crash); err != nil {
		t.Fatalf("Restore over a crash image: %v", err)
	}
	verify("restored over a crash image with its -wal", crash)

	fresh := filepath.Join(dir, "restored", "kettle.db")
	if _, err := sqlite.Restore(ctx, out, fresh); err != nil {
		t.Fatalf("Restore into a new file: %v", err)
	}
	verify("restored into a new file", fresh)

	if _, err := sqlite.Restore(ctx, out, src); err == nil || !strings.Contains(err.Error(), "open in another process") {
		t.Errorf("Restore over a file a store has open: %v; want a refusal", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := sqlite.Restore(ctx, out, src); err != nil {
		t.Fatalf("Restore over the source: %v", err)
	}
	verify("restored over the source", src)
}

func sameReadings(a, b []kettle.Measurement) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Device != b[i].Device || !a[i].Time.Equal(b[i].Time) || a[i].WaterC != b[i].WaterC || a[i].ChargeMWh != b[i].ChargeMWh {
			return false
		}
	}
	return true
}
