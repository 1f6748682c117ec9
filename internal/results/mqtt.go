package results

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// MQTTFleetBench is the benchmark whose runs the MQTT nodes per million
// kettles are rendered from (bench/mqtt-fleet.sh).
const MQTTFleetBench = "mqtt-fleet.sh"

// mqttFleetMin is the fewest connections a run must have held for its
// per-connection figures to stand for a large fleet (issue 47 measures at
// 100,000 kettles): a small rehearsal's node spreads its fixed memory over
// fewer kettles.
const mqttFleetMin = 100_000

// MQTTNodes renders the MQTT nodes per million kettles (a section of
// docs/results.md, and docs/operations.md between the markers mqtt-nodes) from the latest bench/mqtt-fleet.sh run that held at
// least 100,000 connections: the nodes' RSS per connection and CPU per
// connection scaled to 1,000,000 kettles, and the nodes that takes at the
// run's cap per node. It returns "" when no such run is recorded and an
// explanation when the run lacks a figure the text needs.
func MQTTNodes(recs []Record) string {
	var rec *Record
	var fig map[string]float64
	for i := range recs {
		r := &recs[i]
		if r.Bench != MQTTFleetBench {
			continue
		}
		f := figures(*r)
		if f["connections_at_hold_end"] < mqttFleetMin || (rec != nil && r.TimeUTC.Before(rec.TimeUTC)) {
			continue
		}
		rec, fig = r, f
	}
	if rec == nil {
		return ""
	}
	var b strings.Builder
	for _, n := range []string{"connections_at_hold_end", "nodes", "node_cap", "interval_s", "nodes_rss_per_connection", "nodes_cpu", "puback_p99"} {
		if _, ok := fig[n]; !ok {
			fmt.Fprintf(&b, "The latest %s run at %s kettles or more (%s) lacks the figure %q: rerun `DEVICES=100000 bench/mqtt-fleet.sh`.\n\n",
				MQTTFleetBench, group(mqttFleetMin), rec.TimeUTC.UTC().Format(time.RFC3339), n)
			return b.String()
		}
	}
	const million = 1_000_000
	conns, nodes, nodeCap := fig["connections_at_hold_end"], fig["nodes"], fig["node_cap"]
	kib := fig["nodes_rss_per_connection"]
	coresPerConn := fig["nodes_cpu"] / 100 / conns
	fmt.Fprintf(&b, "Rendered from the latest `%s` run at %s kettles or more (%s at `%s`, %d cores, load %s):\n\n```sh\n%s\n```\n\n",
		MQTTFleetBench, group(mqttFleetMin), rec.TimeUTC.UTC().Format("2006-01-02 15:04"), rec.Commit, rec.Machine.Cores, rec.Machine.LoadAvg, rec.Command)
	fmt.Fprintf(&b, "%s MQTT kettles on %s nodes (embedded listener, one reading every %s s each, QoS 1, PUBACK after the commit; "+
		"PUBACK p99 %s ms), scaled to %s kettles:\n\n", group(conns), num(nodes), num(fig["interval_s"]), sig(fig["puback_p99"]), group(million))
	b.WriteString("| what | measured | per 1,000,000 kettles |\n|---|--:|--:|\n")
	row := func(what, per, total string) { fmt.Fprintf(&b, "| %s | %s | %s |\n", what, per, total) }
	row("nodes' RSS (all of it, over the connections)", sig(kib)+" KiB per connection", sig(kib*million/(1<<20))+" GiB")
	row("nodes' CPU", sig(coresPerConn*1e6)+" cores per million connections", sig(coresPerConn*million)+" cores")
	perNode := math.Ceil(million / nodeCap)
	fmt.Fprintf(&b, "\nAt this run's cap of %s connections per node (`--mqtt-max-conns`, below the open-file limit of one process on the machine it ran on): "+
		"**%s nodes per million kettles**, each holding about %s MiB and %s of a core, plus one node for each node you may lose at once. "+
		"Where a process may open more files, a node holds more kettles, up to the smaller of its memory / %s KiB "+
		"and its cores × %s connections a core ([the cap per node](operations.md#the-cap-per-node)).\n\n",
		group(nodeCap), group(perNode), group(nodeCap*kib/1024), sig(nodeCap*coresPerConn), sig(kib), group(1/coresPerConn))
	return b.String()
}

func figures(r Record) map[string]float64 {
	fig := map[string]float64{}
	for _, f := range r.Figures {
		fig[f.Name] = f.Value
	}
	return fig
}
