package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/blackhole"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestStoreBlackhole: with PostgreSQL unreachable (a proxy that stops
// forwarding, not a clean shutdown), every upload is answered 503 +
// Retry-After within twice --store-timeout, polls and the dashboard keep
// answering, /readyz says 503; once the proxy forwards again the kettles'
// retries are stored: no acknowledged reading lost, none stored twice.
func TestStoreBlackhole(t *testing.T) {
	dsn := pgtest.Start(t)
	bh, via := blackhole.ForDSN(t, dsn)
	const timeout = time.Second
	srv := start(t, via, func(c *server.Config) {
		c.Ingest = fleet.Config{StoreTimeout: timeout}
		c.Store.PoolSize = 4
	})
	hc := &http.Client{Timeout: 30 * time.Second}

	type reading struct {
		dev kettle.DeviceID
		at  time.Time
	}
	const kettles = 16
	var (
		mu      sync.Mutex
		acked   []reading
		slowest time.Duration // of the 503s
		refused atomic.Int64
		bad     []string
		blocked atomic.Bool
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		if len(bad) < 20 {
			bad = append(bad, fmt.Sprintf(format, args...))
		}
		mu.Unlock()
	}
	base := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	for k := range kettles {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := uuid.New()
			tok := kettle.DeviceToken(srv.Secret(), dev)
			var pending []time.Time // refused: sent again, as a kettle does
			next := base.Add(time.Duration(k) * time.Microsecond)
			for i := 0; ; i++ {
				stopping := false
				select {
				case <-stop:
					stopping = true
				default:
				}
				if stopping && len(pending) == 0 {
					return
				}
				if !stopping {
					pending = append(pending, next)
					next = next.Add(time.Second)
				}
				var body strings.Builder
				body.WriteByte('[')
				for j, at := range pending {
					if j > 0 {
						body.WriteByte(',')
					}
					body.WriteString(v1Body(at, 1, 2, 3, 20, 60, 500))
				}
				body.WriteByte(']')
				req, _ := http.NewRequest("POST", srv.URL()+"/v1/measurements", strings.NewReader(body.String()))
				req.Header.Set("Authorization", "Bearer "+tok)
				req.Header.Set("Content-Type", "application/json")
				sent := time.Now()
				res, err := hc.Do(req)
				took := time.Since(sent)
				if err != nil {
					fail("upload: %v", err)
					return
				}
				b, _ := io.ReadAll(res.Body)
				res.Body.Close()
				switch res.StatusCode {
				case 200:
					mu.Lock()
					for _, at := range pending {
						acked = append(acked, reading{dev, at})
					}
					mu.Unlock()
					pending = pending[:0]
				case 503:
					refused.Add(1)
					if ra, err := strconv.Atoi(res.Header.Get("Retry-After")); err != nil || ra < 1 {
						fail("503 without a Retry-After: %q", res.Header.Get("Retry-After"))
					}
					mu.Lock()
					slowest = max(slowest, took)
					mu.Unlock()
					if internalText.Match(b) {
						fail("503 body carries internal text: %s", b)
					}
				default:
					fail("upload → %d %s", res.StatusCode, b)
					return
				}
				if took > 2*timeout {
					fail("upload answered %d after %s, more than 2 × --store-timeout %s (blackhole %v)", res.StatusCode, took.Round(time.Millisecond), timeout, blocked.Load())
				}
				time.Sleep(50 * time.Millisecond)
			}
		}()
	}

	get := func(path, tok string) (int, time.Duration) {
		req, _ := http.NewRequest("GET", srv.URL()+path, nil)
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		sent := time.Now()
		res, err := hc.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		return res.StatusCode, time.Since(sent)
	}
	// ackedMore waits until n more readings than at the call are acknowledged.
	ackedMore := func(n int, what string) {
		t.Helper()
		mu.Lock()
		want := len(acked) + n
		mu.Unlock()
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			mu.Lock()
			got := len(acked)
			mu.Unlock()
			if got >= want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d readings acknowledged in 30 s, want %d: %v", what, got, want, bad)
			}
		}
	}
	ackedMore(2*kettles, "before the blackhole")
	if refused.Load() != 0 {
		t.Fatalf("%d uploads refused before the blackhole: %v", refused.Load(), bad)
	}

	// The blackhole lasts until the kettles have been refused twice each
	// (on average: their retries carry more than one reading) and /readyz
	// has said so. A poll or the dashboard that waited on the store could
	// not answer before the store's timeout; from memory they answer
	// sooner, whatever the load.
	bh.Block(true)
	blocked.Store(true)
	began := time.Now()
	pollTok := kettle.DeviceToken(srv.Secret(), uuid.New())
	readyz503 := false
	for deadline := time.Now().Add(60 * time.Second); refused.Load() < 2*kettles || !readyz503; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 60 s of blackhole: %d uploads refused (want %d), /readyz 503 %v", refused.Load(), 2*kettles, readyz503)
		}
		if s, took := get("/v1/command", pollTok); s != 200 || took >= timeout {
			t.Errorf("poll during the blackhole → %d in %s; want 200 from memory, before --store-timeout %s", s, took, timeout)
		}
		if s, took := get("/", ""); s != 200 || took >= timeout {
			t.Errorf("dashboard during the blackhole → %d in %s; want 200 before --store-timeout %s", s, took, timeout)
		}
		if s, took := get("/readyz", ""); s == 503 && took <= 2*timeout {
			readyz503 = true
		} else if s != 503 {
			t.Errorf("/readyz during the blackhole → %d in %s; want 503", s, took)
		}
	}
	refusedIn, lasted := refused.Load(), time.Since(began)
	bh.Block(false)
	blocked.Store(false)
	ackedMore(kettles, "after the blackhole")
	close(stop)
	wg.Wait()

	if !readyz503 {
		t.Error("/readyz never answered 503 during the blackhole")
	}
	if refusedIn == 0 {
		t.Fatal("no upload refused during the blackhole: the proxy did not cut the store off")
	}
	for _, b := range bad {
		t.Error(b)
	}

	// The store, read directly (not through the proxy): every acknowledged
	// reading is there, once.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := postgres.Open(ctx, dsn, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	want := map[kettle.DeviceID]map[time.Time]bool{}
	for _, r := range acked {
		if want[r.dev] == nil {
			want[r.dev] = map[time.Time]bool{}
		}
		want[r.dev][r.at.UTC()] = true
	}
	lost, twice, stored := 0, 0, 0
	for dev, times := range want {
		ms, err := st.History(ctx, kettle.HistoryQuery{Device: dev, Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		seen := map[time.Time]int{}
		for _, m := range ms {
			seen[m.Time.UTC()]++
		}
		for at := range times {
			if seen[at] == 0 {
				lost++
			}
		}
		for _, n := range seen {
			stored++
			if n > 1 {
				twice++
			}
		}
	}
	stats, err := st.Statistics(ctx, kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("acknowledged %d readings of %d kettles; %d uploads refused (%d during the %s blackhole), the slowest 503 in %s (--store-timeout %s); stored %d distinct, measurement_count %d; lost %d, stored twice %d",
		len(acked), len(want), refused.Load(), refusedIn, lasted.Round(time.Millisecond), slowest.Round(time.Millisecond), timeout, stored, stats.MeasurementCount, lost, twice)
	if lost != 0 || twice != 0 || stats.MeasurementCount != int64(stored) {
		t.Errorf("lost %d acknowledged readings, %d stored twice, measurement_count %d for %d distinct readings; want 0, 0 and equal", lost, twice, stats.MeasurementCount, stored)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal("checking the store took over a minute")
	}
}
