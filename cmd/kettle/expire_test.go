package main_test

import (
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

var expired = regexp.MustCompile(`expired (\d+) readings before 2026-11-01 in \S+; (\d+) readings left`)

// TestExpireCommand: kettle expire on a seeded store (both stores) removes
// the readings before the month named, as many on each store, a server
// started on it afterwards counts the rest, a second run removes nothing,
// and bad bounds are refused with a message naming the flag.
func TestExpireCommand(t *testing.T) {
	lefts := map[string]int{}
	storesUnderTest(t, func(t *testing.T, db string) {
		out, err := exec.Command(kettleBin, "seed", "--db", db, "--devices", "20", "--days", "2", "--interval", "10m",
			"--end", "2026-11-01T06:00:00Z", "--quiet").CombinedOutput()
		if err != nil {
			t.Fatalf("kettle seed: %v\n%s", err, out)
		}
		m := seedStored.FindStringSubmatch(string(out))
		if m == nil {
			t.Fatalf("no seed summary in:\n%s", out)
		}
		total, _ := strconv.Atoi(m[2])
		run := func() (removed, left int) {
			out, err := exec.Command(kettleBin, "expire", "--db", db, "--before", "2026-11-01").CombinedOutput()
			if err != nil {
				t.Fatalf("kettle expire: %v\n%s", err, out)
			}
			m := expired.FindStringSubmatch(string(out))
			if m == nil {
				t.Fatalf("kettle expire said:\n%s", out)
			}
			removed, _ = strconv.Atoi(m[1])
			left, _ = strconv.Atoi(m[2])
			return removed, left
		}
		removed, left := run()
		// At most 20 kettles × 6 hours of November at 10 minutes are left
		// (a seeded kettle may be offline for a while).
		if left <= 0 || left > 20*36 || removed != total-left {
			t.Errorf("expired %d, %d left, of %d seeded; want 1 to %d left, the rest expired", removed, left, total, 20*36)
		}
		store := "postgres"
		if strings.HasPrefix(db, "sqlite:") {
			store = "sqlite"
		}
		lefts[store] = left
		if again, _ := run(); again != 0 {
			t.Errorf("a second kettle expire removed %d", again)
		}
		dir := t.TempDir()
		p := serve(t, dir, db)
		if n := stats(t, p, operatorToken(dir))["measurement_count"].(float64); int(n) != left {
			t.Errorf("kettle serve after kettle expire: measurement_count %v, want %d", n, left)
		}
		for _, c := range []struct {
			args []string
			want string
		}{
			{[]string{"--before", "2026-11-02T06:00:00Z"}, "--before"},
			{[]string{"--before", "soon"}, "--before"},
			{[]string{"--retention", "5h"}, "retention"},
			{[]string{"--retention", "90d", "--before", "2026-11-01"}, "give one"},
			{nil, "required"},
		} {
			out, err := exec.Command(kettleBin, append([]string{"expire", "--db", db}, c.args...)...).CombinedOutput()
			if err == nil || !strings.Contains(string(out), c.want) {
				t.Errorf("kettle expire %v: %v\n%s\nwant an error naming %q", c.args, err, out, c.want)
			}
		}
	})
	if lefts["sqlite"] != lefts["postgres"] {
		t.Errorf("readings left after the same seed and expiry: %v; want the same on both stores", lefts)
	}
}
