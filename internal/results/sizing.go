package results

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// SizingBench is the benchmark whose latest run the sizing table is
// rendered from (bench/sizing.sh).
const SizingBench = "sizing.sh"

// sizingFleet is the fleet the table is for.
const sizingFleet = 100_000

// Sizing renders the section "Sizing per 100,000 kettles" of
// docs/results.md from the latest bench/sizing.sh run: its per-kettle costs
// (CPU-µs per kettle and interval in kettle serve and in each PostgreSQL
// member, memory per kettle, disk and WAL per reading) scaled to 100,000
// kettles at the run's INTERVAL. It returns "" when no run is recorded and
// an explanation when the run lacks a figure the table needs.
func Sizing(recs []Record) string {
	var rec *Record
	for _, r := range Latest(recs) {
		if r.Bench == SizingBench {
			rec = &r
		}
	}
	if rec == nil {
		return ""
	}
	fig := map[string]float64{}
	for _, f := range rec.Figures {
		fig[f.Name] = f.Value
	}
	need := []string{"interval_s", "kettles", "serve_cpu_us_per_kettle_interval", "primary_cpu_us_per_kettle_interval",
		"sync_standby_cpu_us_per_kettle_interval", "async_standby_cpu_us_per_kettle_interval", "patroni_etcd_cpu_s_per_s",
		"serve_rss_bytes_per_kettle", "serve_rss_bytes_base", "disk_bytes_per_reading", "wal_bytes_per_reading"}
	var b strings.Builder
	b.WriteString("## Sizing per 100,000 kettles\n\n")
	for _, n := range need {
		if _, ok := fig[n]; !ok {
			fmt.Fprintf(&b, "The latest %s run (%s) lacks the figure %q: rerun `bench/sizing.sh`.\n\n", SizingBench, rec.TimeUTC.UTC().Format(time.RFC3339), n)
			return b.String()
		}
	}
	interval := fig["interval_s"]
	perS := sizingFleet / interval // kettle intervals (a reading and a poll) a second
	cores := func(us float64) float64 { return us * perS / 1e6 }
	day := sizingFleet * 86400 / interval // readings a day
	const gib = 1 << 30
	fmt.Fprintf(&b, "Rendered from the latest `%s` run (%s at `%s`, %d cores, load %s):\n\n```sh\n%s\n```\n\n",
		SizingBench, rec.TimeUTC.UTC().Format("2006-01-02 15:04"), rec.Commit, rec.Machine.Cores, rec.Machine.LoadAvg, rec.Command)
	fmt.Fprintf(&b, "%s kettles on one node measured; each cost is per kettle and interval (one reading and one poll) "+
		"and is scaled here to %s kettles reporting every %s s: %s readings and %s polls a second. "+
		"Method and what to add for headroom: [operations.md](operations.md#sizing-per-100000-kettles).\n\n",
		group(fig["kettles"]), group(sizingFleet), num(interval), group(perS), group(perS))
	b.WriteString("| what | per kettle (measured) | per 100,000 kettles |\n|---|--:|--:|\n")
	row := func(what, per, total string) { fmt.Fprintf(&b, "| %s | %s | %s |\n", what, per, total) }
	row("kettle serve CPU", sig(fig["serve_cpu_us_per_kettle_interval"])+" µs / interval", sig(cores(fig["serve_cpu_us_per_kettle_interval"]))+" cores")
	row("kettle serve memory (its growth with every kettle connected)", sig(fig["serve_rss_bytes_per_kettle"]/1024)+" KiB", sig((fig["serve_rss_bytes_base"]+sizingFleet*fig["serve_rss_bytes_per_kettle"])/gib)+" GiB (with the "+sig(fig["serve_rss_bytes_base"]/(1<<20))+" MiB of an idle node)")
	row("PostgreSQL primary CPU", sig(fig["primary_cpu_us_per_kettle_interval"])+" µs / interval", sig(cores(fig["primary_cpu_us_per_kettle_interval"]))+" cores")
	row("synchronous standby CPU", sig(fig["sync_standby_cpu_us_per_kettle_interval"])+" µs / interval", sig(cores(fig["sync_standby_cpu_us_per_kettle_interval"]))+" cores")
	row("asynchronous standby CPU", sig(fig["async_standby_cpu_us_per_kettle_interval"])+" µs / interval", sig(cores(fig["async_standby_cpu_us_per_kettle_interval"]))+" cores")
	row("Patroni × 3 and etcd × 3 CPU", "(not per kettle)", sig(fig["patroni_etcd_cpu_s_per_s"])+" cores")
	row("disk per member (table, indexes, rollups)", sig(fig["disk_bytes_per_reading"])+" bytes / reading", sig(fig["disk_bytes_per_reading"]*day/gib)+" GiB / day")
	row("WAL (written, sent to each standby)", sig(fig["wal_bytes_per_reading"])+" bytes / reading", sig(fig["wal_bytes_per_reading"]*day/gib)+" GiB / day")
	pu := fig["primary_cpu_us_per_kettle_interval"]
	if pu > 0 {
		fmt.Fprintf(&b, "\nOne primary's write ceiling, if its CPU is what runs out: %s readings/s per core "+
			"(%s kettles per core at %s s); past that, see [operations.md](operations.md#sizing-per-100000-kettles).\n",
			group(1e6/pu), group(1e6/pu*interval), num(interval))
	}
	b.WriteString("\n")
	return b.String()
}

// sig prints v to three significant digits.
func sig(v float64) string {
	if v == 0 {
		return "0"
	}
	s := strconv.FormatFloat(v, 'g', 3, 64)
	if strings.Contains(s, "e") {
		return group(v)
	}
	return s
}

// group prints v rounded to an integer with thousands separators.
func group(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}
