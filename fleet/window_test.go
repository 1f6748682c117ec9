package fleet_test

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// TestCommitWindow: on a real SQLite file under synctest's clock, a quiet
// fleet's readings are acknowledged at once, each in its own commit; at a
// busy fleet's rate readings share commits, and none waits past
// --batch-wait (the bubble's clock stands still while a commit runs, so
// any latency is the window's).
func TestCommitWindow(t *testing.T) {
	const bound = 10 * time.Millisecond
	f := func(gap time.Duration, n int, wantShared bool) {
		t.Helper()
		synctest.Test(t, func(t *testing.T) {
			st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "k.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			var commits atomic.Int64
			svc, err := fleet.New(context.Background(), st, fleet.Config{BatchWait: bound}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil,
				fleet.Hooks{Batch: func(int, int, time.Duration, error) { commits.Add(1) }})
			if err != nil {
				t.Fatal(err)
			}
			defer svc.Close()
			base := time.Now().Add(-time.Hour).UTC()
			var (
				wg      sync.WaitGroup
				mu      sync.Mutex
				slowest time.Duration
			)
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					start := time.Now()
					if _, _, err := svc.Ingest(context.Background(), []kettle.Measurement{reading(uuid.New(), base, 500)}); err != nil {
						t.Error(err)
					}
					mu.Lock()
					slowest = max(slowest, time.Since(start))
					mu.Unlock()
				}()
				time.Sleep(gap) // the bubble's clock: the fleet's cadence
			}
			wg.Wait()
			c := commits.Load()
			t.Logf("%d readings %s apart: %d commits, slowest acknowledged after %s", n, gap, c, slowest)
			if wantShared {
				if c > int64(n)/3 {
					t.Errorf("%d readings %s apart took %d commits: want them shared (a third or fewer)", n, gap, c)
				}
				if slowest > bound {
					t.Errorf("a reading waited %s, past --batch-wait %s", slowest, bound)
				}
			} else if c != int64(n) || slowest != 0 {
				t.Errorf("%d readings %s apart: %d commits, slowest after %s; want one commit each, at once", n, gap, c, slowest)
			}
		})
	}
	f(50*time.Millisecond, 40, false) // 20/s: nothing to share within 10 ms
	f(time.Millisecond, 400, true)    // 1,000/s
}
