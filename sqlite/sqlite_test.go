package sqlite_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
	"github.com/kettlefleet/kettlefleet/storetest"
)

// open opens a store on a fresh file in t.TempDir(), in a subdirectory
// that does not exist yet (Open creates it).
func open(t testing.TB, path string, opts ...sqlite.Option) *sqlite.Store {
	t.Helper()
	s, err := sqlite.Open(context.Background(), path, opts...)
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	return s
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) (kettle.Store, func(t *testing.T) kettle.Store) {
		path := filepath.Join(t.TempDir(), "data", "kettle.db")
		cur := open(t, path)
		t.Cleanup(func() {
			if err := cur.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
		return cur, func(t *testing.T) kettle.Store {
			if err := cur.Close(); err != nil {
				t.Fatalf("Close before reopen: %v", err)
			}
			cur = open(t, path)
			return cur
		}
	})
}

// TestReopenMigrates checks that opening an existing database applies no
// migration twice and keeps the data.
func TestReopenMigrates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kettle.db")
	ctx := context.Background()
	for i := range 3 {
		s := open(t, path)
		if err := s.Register(ctx, []kettle.DeviceID{{byte(i + 1)}}, time.Unix(0, 0)); err != nil {
			t.Fatal(err)
		}
		st, err := s.Statistics(ctx, kettle.StatsQuery{})
		if err != nil {
			t.Fatal(err)
		}
		if st.DevicesRegistered != int64(i+1) {
			t.Errorf("open %d: %d devices, want %d", i, st.DevicesRegistered, i+1)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
}

// TestBusyRetry holds the write lock from another connection (as another
// process would) for longer than the busy timeout: Write must wait, retry,
// count the retries and then succeed.
func TestBusyRetry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kettle.db")
	s := open(t, path, sqlite.WithBusyTimeout(20*time.Millisecond))
	defer s.Close()
	other, err := sql.Open("sqlite3", "file:"+path+"?_txlock=immediate&_busy_timeout=0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	tx, err := other.Begin()
	if err != nil {
		t.Fatalf("other writer: %v", err)
	}
	released := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		tx.Rollback()
		close(released)
	}()
	m := kettle.Measurement{Device: kettle.DeviceID{1}, Time: time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC), LevelML: 1}
	dup, err := s.Write(context.Background(), []kettle.Measurement{m}, m.Time)
	<-released
	if err != nil || len(dup) != 1 || dup[0] {
		t.Fatalf("Write while locked = %v, %v; want it to retry and succeed", dup, err)
	}
	if s.BusyRetries() == 0 {
		t.Errorf("BusyRetries = 0 after waiting for another writer")
	}

	// Locked for longer than all retries: EUnavailable, not a hang.
	s2 := open(t, path, sqlite.WithBusyTimeout(5*time.Millisecond), sqlite.WithMaxBusyRetries(2))
	defer s2.Close()
	tx, err = other.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = s2.Write(context.Background(), []kettle.Measurement{m}, m.Time)
	if kettle.ErrorCode(err) != kettle.EUnavailable {
		t.Errorf("Write while locked for good: %v (code %q), want code %q", err, kettle.ErrorCode(err), kettle.EUnavailable)
	}
}

func BenchmarkWrite(b *testing.B) {
	for _, size := range []int{1, 100, 1000} {
		b.Run("batch="+strconv.Itoa(size), func(b *testing.B) {
			s := open(b, filepath.Join(b.TempDir(), "kettle.db"))
			defer s.Close()
			storetest.WriteBenchmark(b, s, size)
		})
	}
}
