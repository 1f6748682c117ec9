package main_test

import (
	"math"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

var seedStored = regexp.MustCompile(`(\d+) readings generated, (\d+) stored, (\d+) already there`)

// TestSeedCommand runs kettle seed as a user does, on both stores: the same
// fleet and history on each, a re-run adds nothing, and a server started on
// the seeded store answers right at once: the statistics count every
// reading, every device's last-seen time is its newest reading's, the
// devices' tokens work, and both stores give the same statistics.
func TestSeedCommand(t *testing.T) {
	args := []string{"seed", "--devices", "30", "--days", "2", "--interval", "10m", "--end", "2026-11-01T06:00:00Z", "--seed", "7", "--quiet", "--chunk-rows", "1000"}
	got := map[string]map[string]any{}
	storesUnderTest(t, func(t *testing.T, db string) {
		run := func(more ...string) (gen, stored, skipped string) {
			out, err := exec.Command(kettleBin, append(append(args, "--db", db), more...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("kettle seed: %v\n%s", err, out)
			}
			m := seedStored.FindStringSubmatch(string(out))
			if m == nil {
				t.Fatalf("no summary in:\n%s", out)
			}
			if pg := !strings.HasPrefix(db, "sqlite:"); pg != strings.Contains(string(out), "finishing (") {
				t.Errorf("summary on %s has a finishing line: %v, want %v (PostgreSQL's SeedDone):\n%s", db, !pg, pg, out)
			}
			return m[1], m[2], m[3]
		}
		gen, stored, _ := run()
		want, _ := strconv.Atoi(gen)
		if gen != stored || want == 0 {
			t.Fatalf("first run: %s generated, %s stored", gen, stored)
		}
		gen2, stored2, skipped2 := run()
		if gen2 != gen || stored2 != "0" || skipped2 != gen {
			t.Fatalf("re-run: %s generated, %s stored, %s skipped; want %s, 0, %s", gen2, stored2, skipped2, gen, gen)
		}
		// A day later: the two days already there are skipped, the new
		// one stored (on PostgreSQL, days with a partition go chunk by
		// chunk, a new day is loaded whole).
		gen3, stored3, skipped3 := run("--days", "3", "--end", "2026-11-02T06:00:00Z")
		n3, _ := strconv.Atoi(gen3)
		if s3, _ := strconv.Atoi(stored3); skipped3 != gen || s3 == 0 || s3+want != n3 {
			t.Fatalf("a day later: %s generated, %s stored, %s skipped; want %s skipped and the rest stored", gen3, stored3, skipped3, gen)
		}
		want = n3

		dir := t.TempDir()
		p := serve(t, dir, db)
		op := operatorToken(dir)
		s := stats(t, p, op)
		if n := s["measurement_count"].(float64); n != float64(want) {
			t.Errorf("statistics measurement_count %v, seeded %d", n, want)
		}
		if n := s["devices_registered"].(float64); n != 30 {
			t.Errorf("devices_registered %v, want 30", n)
		}
		got[strings.SplitN(db, ":", 2)[0]] = s

		var list struct {
			Devices []struct {
				ID       string    `json:"id"`
				LastSeen time.Time `json:"last_seen"`
				Latest   struct {
					Time time.Time `json:"time"`
				} `json:"latest"`
				Measurements int `json:"measurements"`
			} `json:"devices"`
		}
		mustJSON(t, p.url+"/v1/devices?limit=100", map[string]string{"Authorization": "Bearer " + op}, &list)
		if len(list.Devices) != 30 {
			t.Fatalf("%d devices listed, want 30", len(list.Devices))
		}
		sum := 0
		for _, d := range list.Devices {
			sum += d.Measurements
			if !d.LastSeen.Equal(d.Latest.Time) {
				t.Errorf("device %s: last_seen %v, newest reading %v", d.ID, d.LastSeen, d.Latest.Time)
			}
		}
		if sum != want {
			t.Errorf("devices' measurements add up to %d, seeded %d", sum, want)
		}
		id := list.Devices[len(list.Devices)/2].ID
		out, err := exec.Command(kettleBin, "token", "--data-dir", dir, "--device", id).Output()
		if err != nil {
			t.Fatal(err)
		}
		st, b, _ := req("GET", p.url+"/v1/command", map[string]string{"Authorization": "Bearer " + strings.TrimSpace(string(out))}, "")
		if st != 200 {
			t.Errorf("GET /v1/command with the seeded device's token: %d %s", st, b)
		}
	})
	a, b := got["sqlite"], got["postgres"]
	if a == nil || b == nil {
		return
	}
	for _, k := range []string{"measurement_count", "range_measurement_count", "devices_registered", "total_battery_charge_mwh", "total_water_volume_ml", "total_potential_energy_j"} {
		x, y := a[k].(float64), b[k].(float64)
		if math.Abs(x-y) > 1e-9*math.Max(1, math.Abs(x)) {
			t.Errorf("%s: SQLite %v, PostgreSQL %v", k, x, y)
		}
	}
	ha, hb := a["temperature_by_hour"].([]any), b["temperature_by_hour"].([]any)
	if len(ha) != len(hb) || len(ha) == 0 {
		t.Fatalf("temperature_by_hour: %d hours on SQLite, %d on PostgreSQL", len(ha), len(hb))
	}
	for i := range ha {
		x, y := ha[i].(map[string]any), hb[i].(map[string]any)
		if x["count"] != y["count"] {
			t.Errorf("hour %v: count %v on SQLite, %v on PostgreSQL", x["hour"], x["count"], y["count"])
		}
		for _, k := range []string{"water_temp_c", "ambient_temp_c"} {
			mx, my := x[k].(map[string]any)["mean"].(float64), y[k].(map[string]any)["mean"].(float64)
			if math.Abs(mx-my) > 1e-9*math.Max(1, math.Abs(mx)) {
				t.Errorf("hour %v %s mean: SQLite %v, PostgreSQL %v", x["hour"], k, mx, my)
			}
		}
	}
}
