package main_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/http"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/server"
)

var pruned = regexp.MustCompile(`(removed|would remove \(dry run\)) (\d+) devices registered before \S+ that never reported, in \S+; (\d+) devices registered`)

// TestPruneCommand: kettle prune on a store (both stores) with kettles that
// reported and 50 registrations an hour old that never did removes those 50
// and nothing else (a dry run first removes nothing); on PostgreSQL a
// server running on the database drops them from its registry at its next
// cache refresh; bad ages are refused naming the flag.
func TestPruneCommand(t *testing.T) {
	storesUnderTest(t, func(t *testing.T, db string) {
		out, err := exec.Command(kettleBin, "seed", "--db", db, "--devices", "10", "--days", "1", "--interval", "1h", "--quiet").CombinedOutput()
		if err != nil {
			t.Fatalf("kettle seed: %v\n%s", err, out)
		}
		st, err := server.OpenStore(context.Background(), db, server.StoreOptions{PoolSize: 1}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		stale := make([]kettle.DeviceID, 50)
		for i := range stale {
			stale[i] = uuid.New()
		}
		err = st.Register(context.Background(), stale, time.Now().Add(-time.Hour))
		st.Close()
		if err != nil {
			t.Fatal(err)
		}
		var p *proc
		if !strings.HasPrefix(db, "sqlite:") {
			p = serve(t, t.TempDir(), db, "--cache-refresh", "200ms")
			if n := registeredOn(t, p); n != 60 {
				t.Fatalf("server before the prune: %v devices registered, want 60", n)
			}
		}
		run := func(args ...string) (verb string, n, left int) {
			t.Helper()
			out, err := exec.Command(kettleBin, append([]string{"prune", "--db", db}, args...)...).CombinedOutput()
			m := pruned.FindStringSubmatch(string(out))
			if err != nil || m == nil {
				t.Fatalf("kettle prune %v: %v\n%s", args, err, out)
			}
			n, _ = strconv.Atoi(m[2])
			left, _ = strconv.Atoi(m[3])
			return m[1], n, left
		}
		if verb, n, left := run("--older-than", "30m", "--dry-run"); verb != "would remove (dry run)" || n != 50 || left != 60 {
			t.Errorf("dry run: %s %d, %d left; want would remove 50, 60 left", verb, n, left)
		}
		if verb, n, left := run("--older-than", "2h"); verb != "removed" || n != 0 || left != 60 {
			t.Errorf("older than 2h: %s %d, %d left; want 0 removed", verb, n, left)
		}
		if _, n, left := run("--older-than", "30m"); n != 50 || left != 10 {
			t.Errorf("prune: %d removed, %d left; want 50, 10", n, left)
		}
		if _, n, _ := run("--older-than", "30m"); n != 0 {
			t.Errorf("a second prune removed %d", n)
		}
		if p != nil {
			testkit.WaitFor(t, "the server holding the 10 devices kettle prune left", 10*time.Second, func() bool { return registeredOn(t, p) == 10 })
		}
		for _, bad := range [][]string{{}, {"--older-than", "5m"}, {"--older-than", "soon"}} {
			out, err := exec.Command(kettleBin, append([]string{"prune", "--db", db}, bad...)...).CombinedOutput()
			if err == nil || !strings.Contains(string(out), "--older-than") {
				t.Errorf("kettle prune %v: %v\n%s; want a failure naming --older-than", bad, err, out)
			}
		}
	})
}

// registeredOn reads kettle_devices_registered from a server's /metrics.
func registeredOn(t *testing.T, p *proc) float64 {
	t.Helper()
	resp, err := http.Get(p.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "kettle_devices_registered "); ok {
			n, _ := strconv.ParseFloat(v, 64)
			return n
		}
	}
	t.Fatal("no kettle_devices_registered on /metrics")
	return 0
}
