package main

import (
	"context"
	"fmt"
	"strings"
	"time"
)

func init() {
	parts = append(parts, part{"machines", "10m. The topology on machines of its own: a partition, a pause, a full disk and latency on its links (deploy's TestMachines)", partMachines})
}

// partMachines runs deploy's TestMachines (KETTLE_HA_LONG=1): every member
// of deploy/cluster.sh in a network namespace of its own, the primary
// isolated and replaced, then healed; pause, disk and latency verbs.
func partMachines(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "deploy/cluster.sh up in netns mode (etcd × 3, PostgreSQL × 3 under Patroni, a node, HAProxy, each in a network namespace on a bridge, data on its own filesystem); " +
		"the primary isolated (a new leader must appear), healed; a member paused and resumed; a disk filled and freed; latency on a link; down leaves nothing. (go test ./deploy/ -run TestMachines with KETTLE_HA_LONG=1)"}
	longTest(ctx, e, r, "./deploy/", "TestMachines", 15*time.Minute, nil)
	if !r.Pass {
		return r
	}
	r.Verdict = "the topology on machines: partition, heal, pause, disk and latency verbs took effect and down left nothing"
	return r
}

func init() {
	parts = append(parts, part{"bench-smoke", "11. Every benchmark script in its smoke mode, those that bring up the HA topology or Kafka included (bench's TestBenchSmoke)", partBenchSmoke})
}

// partBenchSmoke runs bench's TestBenchSmoke with KETTLE_HA_LONG=1: every
// script, the heavy ones make test skips included, must start and record.
func partBenchSmoke(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "every bench/*.sh with SMOKE=1 (tiny sizes): each must exit 0 and record one run of itself; ha-sync.sh, sizing.sh and log-vs-direct.sh, which make test skips, included. (go test ./bench/ -run TestBenchSmoke with KETTLE_HA_LONG=1)"}
	n := 0
	longTest(ctx, e, r, "./bench/", "TestBenchSmoke", 20*time.Minute, func(l string) bool {
		if strings.Contains(l, "figures") && strings.Contains(l, ".sh in ") {
			n++
			return true
		}
		return false
	})
	if !r.Pass {
		return r
	}
	r.Verdict = fmt.Sprintf("%d benchmark scripts started and recorded in smoke mode", n)
	return r
}
