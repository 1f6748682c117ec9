package results

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "write docs/results.md, the README's headline table, docs/operations.md's MQTT nodes per million kettles and the figures docs/performance.md cites from bench/results.jsonl (make results)")

// TestRenderedResultsCurrent fails when docs/results.md or the README's
// headline table differ from what bench/results.jsonl renders to.
func TestRenderedResultsCurrent(t *testing.T) {
	root := filepath.Join("..", "..")
	f, err := os.Open(filepath.Join(root, "bench", "results.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := Read(f)
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	wantReadme, err := Splice(string(readme), "results", Table(recs))
	if err != nil {
		t.Fatalf("README.md: %v", err)
	}
	ops, err := os.ReadFile(filepath.Join(root, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	wantOps, err := Splice(string(ops), "mqtt-nodes", MQTTNodes(recs))
	if err != nil {
		t.Fatalf("docs/operations.md: %v", err)
	}
	perf, err := os.ReadFile(filepath.Join(root, "docs", "performance.md"))
	if err != nil {
		t.Fatal(err)
	}
	wantPerf, err := Cite(string(perf), recs, "../bench/results.jsonl")
	if err != nil {
		t.Fatalf("docs/performance.md: %v", err)
	}
	files := map[string]string{
		filepath.Join(root, "docs", "performance.md"): wantPerf,
		filepath.Join(root, "docs", "results.md"):     Page(recs),
		filepath.Join(root, "README.md"):              wantReadme,
		filepath.Join(root, "docs", "operations.md"):  wantOps,
	}
	for path, want := range files {
		if *update {
			if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("%s is not what bench/results.jsonl renders to: run `make results`", path)
		}
	}
}

func TestRead(t *testing.T) {
	f := func(line, wantErr string) {
		t.Helper()
		_, err := Read(strings.NewReader(line))
		switch {
		case wantErr == "" && err != nil:
			t.Errorf("Read(%s): %v", line, err)
		case wantErr != "" && (err == nil || !strings.Contains(err.Error(), wantErr)):
			t.Errorf("Read(%s): %v; want an error with %q", line, err, wantErr)
		}
	}
	ok := `{"bench":"ingest.sh","commit":"abc1234","time_utc":"2026-11-27T18:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1.0 1.0 1.0"},"command":"bench/ingest.sh","figures":[{"name":"kettle serve","value":100,"unit":"req/s"}],"ceiling":{"name":"bare","value":200,"unit":"req/s"},"ratio":0.5}`
	f(ok, "")
	f(ok+"\n\n"+ok, "")
	f(`{"bench":"x"`, "line 1")
	f(strings.Replace(ok, `"bench":"ingest.sh"`, `"bench":""`, 1), `"bench"`)
	f(strings.Replace(ok, `"command":"bench/ingest.sh"`, `"command":""`, 1), `"command"`)
	f(strings.Replace(ok, `[{"name":"kettle serve","value":100,"unit":"req/s"}]`, `[]`, 1), `"figures"`)
	f(strings.Replace(ok, `"unit":"req/s"}]`, `"unit":""}]`, 1), `"figures[0]"`)
	f(strings.Replace(ok, `"ratio":0.5`, `"ratio":0.5,"extra":1`, 1), "extra")
	f(ok+"\n"+strings.Replace(ok, `"value":100`, `"value":"fast"`, 1), "line 2")
}

func TestLatestAndHeadline(t *testing.T) {
	log := `{"bench":"b.sh","commit":"1","time_utc":"2026-11-27T18:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/b.sh","figures":[{"name":"p99","value":12.5,"unit":"ms"}]}
{"bench":"a.sh","commit":"2","time_utc":"2026-11-27T17:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/a.sh","figures":[{"name":"kettle","value":90,"unit":"req/s"}],"ceiling":{"name":"bare","value":100,"unit":"req/s"},"ratio":0.9}
{"bench":"b.sh","commit":"3","time_utc":"2026-11-27T19:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/b.sh","figures":[{"name":"p99","value":11,"unit":"ms"}]}`
	recs, err := Read(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	l := Latest(recs)
	if len(l) != 2 || l[0].Bench != "a.sh" || l[1].Commit != "3" {
		t.Fatalf("Latest: %+v; want a.sh, then b.sh's run at commit 3", l)
	}
	if h := Headline(l[0]); h != "kettle 90 req/s = 0.9 × bare (100 req/s)" {
		t.Errorf("Headline with a ratio: %q", h)
	}
	if h := Headline(l[1]); h != "p99 11 ms" {
		t.Errorf("Headline without: %q", h)
	}
	// A ratio that is not the first figure's to the ceiling (locust-vs-swarm.sh:
	// Locust's CPU per request over the swarm's).
	other := Record{Figures: []Figure{{Name: "offered", Value: 1500, Unit: "req/s"}, {Name: "swarm", Value: 70, Unit: "us"}, {Name: "locust", Value: 420, Unit: "us"}},
		Ceiling: &Figure{Name: "target", Value: 140, Unit: "us"}, Ratio: new(6.0)}
	if h := Headline(other); h != "swarm 70 us; locust 420 us; ceiling target 140 us; ratio 6" {
		t.Errorf("Headline with another ratio: %q", h)
	}
	// A benchmark's headline is the figure it exists for: ha-sync.sh's upload
	// p99 with a synchronous standby, then with an asynchronous one, then its
	// rates, in readings a second (its older records say "s").
	ha, err := Read(strings.NewReader(`{"bench":"ha-sync.sh","commit":"1","time_utc":"2026-11-27T18:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/ha-sync.sh","figures":[{"name":"sync_single_acked_per_s","value":499,"unit":"s"},{"name":"sync_single_upload_p99_ms","value":30,"unit":"ms"},{"name":"async_single_upload_p99_ms","value":20,"unit":"ms"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if h := Headline(ha[0]); h != "sync_single_upload_p99_ms 30 ms; async_single_upload_p99_ms 20 ms; sync_single_acked_per_s 499 readings/s" {
		t.Errorf("ha-sync.sh's headline: %q", h)
	}
	for bench, names := range headlines {
		if _, err := os.Stat(filepath.Join("..", "..", "bench", bench)); err != nil || len(names) == 0 {
			t.Errorf("headlines[%q]: no such benchmark, or no figures named (%v)", bench, err)
		}
	}
	page := Page(recs)
	if !strings.Contains(page, "| 2026-11-27 19:00 | b.sh | `3`") || strings.Index(page, "19:00 | b.sh") > strings.Index(page, "18:00 | b.sh") {
		t.Errorf("history not newest first:\n%s", page)
	}
	if _, err := Splice("a\n<!-- end results -->\n<!-- begin results -->\n", "results", "x"); err == nil {
		t.Error("Splice with the markers out of order: no error")
	}
}

// TestRecord writes a run as the bench scripts do (a figures file,
// Collect, Append) and reads it back: the writer and the renderer agree on
// the record's shape, and a figure the run did not measure fails the record.
func TestRecord(t *testing.T) {
	log := filepath.Join(t.TempDir(), "results.jsonl")
	figs := "figure kettle serve=1234.5:req/s\nfigure from a name=with=7.5:ms\nceiling bare=2000:req/s\nratio 0.25\n"
	rec, err := Collect(strings.NewReader(figs), "x.sh", "N=1 bench/x.sh", ".")
	if err != nil {
		t.Fatal(err)
	}
	if err := Append(log, rec); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := Read(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 {
		t.Fatalf("%d records, want 1", len(recs))
	}
	r := recs[0]
	if r.Bench != "x.sh" || r.Command != "N=1 bench/x.sh" || r.Commit == "" || r.Machine.Cores < 1 || r.Machine.LoadAvg == "" ||
		len(r.Figures) != 2 || r.Figures[0] != (Figure{"kettle serve", 1234.5, "req/s"}) || r.Figures[1] != (Figure{"from a name=with", 7.5, "ms"}) ||
		r.Ceiling == nil || *r.Ceiling != (Figure{"bare", 2000, "req/s"}) || r.Ratio == nil || *r.Ratio != 0.25 {
		t.Errorf("record read back: %+v", r)
	}

	bad := func(figs, want string) {
		t.Helper()
		_, err := Collect(strings.NewReader(figs), "x.sh", "bench/x.sh", ".")
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Collect(%q) = %v, want an error with %q", figs, err, want)
		}
	}
	bad("figure not printed=:ms\n", `"not printed": value "" is not a number`)
	bad("figure nan=NaN:ms\n", `value "NaN" is not a number`)
	bad("figure no unit=3\n", "want NAME=VALUE:UNIT")
	bad("ratio x\nfigure a=1:s\n", `ratio "x"`)
	bad("printed something else\n", "not a figure, ceiling or ratio line")
	bad("", "a run without figures is not recorded")
}

// TestCite renders a document's citations from the log and refuses one
// that names a line of another benchmark or a figure the record lacks.
func TestCite(t *testing.T) {
	log := `{"bench":"a.sh","commit":"1","time_utc":"2026-11-27T18:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/a.sh","figures":[{"name":"kettle","value":90,"unit":"req/s"}],"ceiling":{"name":"bare","value":100,"unit":"req/s"},"ratio":0.9}

{"bench":"b.sh","commit":"2","time_utc":"2026-11-27T19:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1"},"command":"bench/b.sh","figures":[{"name":"p99, worst","value":12.5,"unit":"ms"}]}`
	recs, err := Read(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	f := func(doc, want, wantErr string) {
		t.Helper()
		got, err := Cite(doc, recs, "log.jsonl")
		if wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), wantErr) {
				t.Errorf("Cite(%q): error %v, want one with %q", doc, err, wantErr)
			}
			return
		}
		if err != nil || got != want {
			t.Errorf("Cite(%q) = %q, %v; want %q", doc, got, err, want)
		}
	}
	f(`holds <!--fig a.sh:1 "kettle"-->old<!--/fig--> of <!--fig a.sh:1 "bare"--><!--/fig-->, <!--fig a.sh:1 "ratio"--><!--/fig-->`,
		`holds <!--fig a.sh:1 "kettle"-->[90 req/s](log.jsonl#L1)<!--/fig--> of <!--fig a.sh:1 "bare"-->[100 req/s](log.jsonl#L1)<!--/fig-->, <!--fig a.sh:1 "ratio"-->[0.9×](log.jsonl#L1)<!--/fig-->`, "")
	f(`<!--fig b.sh:3 "p99, worst"--><!--/fig-->`, `<!--fig b.sh:3 "p99, worst"-->[12.5 ms](log.jsonl#L3)<!--/fig-->`, "")
	f(`<!--fig a.sh:3 "p99, worst"--><!--/fig-->`, "", "line 3 of the log is not a run of a.sh")
	f(`<!--fig b.sh:2 "p99"--><!--/fig-->`, "", "line 2 of the log is not a run of b.sh")
	f(`<!--fig b.sh:3 "p50"--><!--/fig-->`, "", "the record has no such figure")
}

// TestFiguresOf reads the figures of what the scripts run: a swarm's
// results.json, RESULT lines, a JSON path, the swarm's progress windows.
func TestFiguresOf(t *testing.T) {
	swarm := `{"totals":{"endpoints":{"measurement":{"p99_ms":12.5,"per_second":100},"command":{"p99_ms":1,"per_second":99}},"errors":2},"audit":{"lost":0,"duplicated":1}}`
	got, err := SwarmFigures(strings.NewReader(swarm), "fleet")
	want := []string{"figure fleet command p99=1:ms", "figure fleet command req/s=99:req/s", "figure fleet measurement p99=12.5:ms",
		"figure fleet measurement req/s=100:req/s", "figure fleet errors=2:requests", "figure fleet audit lost=0:readings", "figure fleet audit duplicated=1:readings"}
	if err != nil || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("SwarmFigures = %q, %v; want %q", got, err, want)
	}
	got, err = ResultFigures(strings.NewReader("noise\nRESULT ingest rows_per_s=812.5 p99_ms=3 errors=0 mode=v1\n"), "")
	want = []string{"figure ingest rows_per_s=812.5:rows/s", "figure ingest p99_ms=3:ms", "figure ingest errors=0:count"}
	if err != nil || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("ResultFigures = %q, %v; want %q", got, err, want)
	}
	var doc any = map[string]any{"holds": 40000.0, "steps": []any{map[string]any{"p99": 2.5}}}
	jf := func(spec, want string, wantErr bool) {
		t.Helper()
		line, _, err := JSONFigure(doc, spec)
		if line != want || (err != nil) != wantErr {
			t.Errorf("JSONFigure(%q) = %q, %v; want %q (error %v)", spec, line, err, want, wantErr)
		}
	}
	jf("holds=.holds:kettles", "figure holds=40000:kettles", false)
	jf("first p99=.steps.0.p99:ms", "figure first p99=2.5:ms", false)
	jf("breaks=.breaks_at:kettles", "", true)
	jf("breaks=.breaks_at?:kettles", "", false)
	log := "[   5s] kettles 10/10 | measurement 2/s p50 1.0ms p99 9.0ms | command 2/s p50 0.5ms p99 1.0ms\n" +
		"[  10s] kettles 10/10 | measurement 2/s p50 3.0ms p99 4.0ms | command 2/s p50 0.5ms p99 7.0ms\n" +
		"[  15s] kettles 10/10 | measurement 2/s p50 2.0ms p99 5.0ms | command 2/s p50 0.5ms p99 1.0ms\n"
	p99, p50, n, err := Windows(strings.NewReader(log), "measurement", 10, -1)
	if err != nil || p99 != 5 || p50 != 2.5 || n != 2 {
		t.Errorf("Windows(measurement, from 10 s) = %v %v %d %v; want 5 2.5 2", p99, p50, n, err)
	}
}

func TestSizing(t *testing.T) {
	rec := func(figs string) []Record {
		t.Helper()
		recs, err := Read(strings.NewReader(`{"bench":"sizing.sh","commit":"abc","time_utc":"2026-11-27T22:00:00Z","machine":{"cores":2,"cpu_model":"x","loadavg":"1 1 1"},"command":"bench/sizing.sh","figures":[` + figs + `]}`))
		if err != nil {
			t.Fatal(err)
		}
		return recs
	}
	all := `{"name":"interval_s","value":30,"unit":"s"},{"name":"kettles","value":2000,"unit":"kettles"},` +
		`{"name":"serve_cpu_us_per_kettle_interval","value":120,"unit":"µs"},{"name":"primary_cpu_us_per_kettle_interval","value":200,"unit":"µs"},` +
		`{"name":"sync_standby_cpu_us_per_kettle_interval","value":30,"unit":"µs"},{"name":"async_standby_cpu_us_per_kettle_interval","value":25,"unit":"µs"},` +
		`{"name":"patroni_etcd_cpu_s_per_s","value":0.05,"unit":"cores"},{"name":"serve_rss_bytes_per_kettle","value":2048,"unit":"bytes"},` +
		`{"name":"serve_rss_bytes_base","value":52428800,"unit":"bytes"},{"name":"disk_bytes_per_reading","value":150,"unit":"bytes"},` +
		`{"name":"wal_bytes_per_reading","value":400,"unit":"bytes"}`
	f := func(recs []Record, want ...string) {
		t.Helper()
		got := Sizing(recs)
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("Sizing lacks %q:\n%s", w, got)
			}
		}
		if len(want) == 0 && got != "" {
			t.Errorf("Sizing without a sizing.sh run: %q, want nothing", got)
		}
	}
	f(nil)
	// 100,000 kettles every 30 s: 3,333 intervals/s; 120 µs each is 0.4 cores.
	f(rec(all), "3,333 readings", "| kettle serve CPU | 120 µs / interval | 0.4 cores |", "| PostgreSQL primary CPU | 200 µs / interval | 0.667 cores |",
		"| kettle serve memory (its growth with every kettle connected) | 2 KiB | 0.24 GiB", "40.2 GiB / day", "5,000 readings/s per core", "150,000 kettles per core", "GiB / day")
	f(rec(`{"name":"interval_s","value":30,"unit":"s"}`), `lacks the figure "kettles"`)
	if !strings.Contains(Page(rec(all)), "## Sizing per 100,000 kettles") {
		t.Error("docs/results.md has no sizing section")
	}
}

func TestMQTTNodes(t *testing.T) {
	rec := func(when, figs string) string {
		return `{"bench":"mqtt-fleet.sh","commit":"abc","time_utc":"` + when + `","machine":{"cores":2,"cpu_model":"x","loadavg":"1 1 1"},"command":"bench/mqtt-fleet.sh","figures":[` + figs + `]}` + "\n"
	}
	f := func(log string, want ...string) {
		t.Helper()
		recs, err := Read(strings.NewReader(log))
		if err != nil {
			t.Fatal(err)
		}
		got := MQTTNodes(recs)
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("MQTTNodes lacks %q:\n%s", w, got)
			}
		}
		if len(want) == 0 && got != "" {
			t.Errorf("MQTTNodes without a run at 100,000: %q, want nothing", got)
		}
	}
	all := `{"name":"connections_at_hold_end","value":100000,"unit":"connections"},{"name":"nodes","value":6,"unit":"nodes"},` +
		`{"name":"node_cap","value":17500,"unit":"connections"},{"name":"interval_s","value":30,"unit":"s"},` +
		`{"name":"nodes_rss_per_connection","value":8,"unit":"KiB"},{"name":"nodes_cpu","value":70,"unit":"% of a core"},{"name":"puback_p99","value":90,"unit":"ms"}`
	small := `{"name":"connections_at_hold_end","value":16000,"unit":"connections"},{"name":"nodes_rss_per_connection","value":1,"unit":"KiB"}`
	f("")
	f(rec("2026-11-28T00:00:00Z", small))
	// 8 KiB × 1,000,000 = 7.63 GiB; 0.7 cores over 100,000 → 7 per million;
	// 1,000,000 / 17,500 → 58 nodes of 137 MiB and 0.122 cores; a core
	// holds 100,000 / 0.7 connections.
	f(rec("2026-11-28T00:00:00Z", all), "100,000 MQTT kettles on 6 nodes", "PUBACK p99 90 ms", "| 8 KiB per connection | 7.63 GiB |",
		"| 7 cores per million connections | 7 cores |", "**58 nodes per million kettles**", "137 MiB and 0.122 of a core",
		"142,857 connections a core")
	// A later small rehearsal does not replace the 100,000-kettle run.
	f(rec("2026-11-28T00:00:00Z", all)+rec("2026-11-28T01:00:00Z", small), "**58 nodes per million kettles**")
	f(rec("2026-11-28T00:00:00Z", `{"name":"connections_at_hold_end","value":100000,"unit":"connections"}`), `lacks the figure "nodes"`)
}
