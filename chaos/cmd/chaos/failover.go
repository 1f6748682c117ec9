package main

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// partFailover runs the high-availability tests of ha/ in their long form
// (KETTLE_HA_LONG=1): the topology of deploy/cluster.sh on 127.0.44.x, a
// swarm through HAProxy, and every fault of the issue in one run; each
// figure the test logs becomes a finding.
func partFailover(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "deploy/cluster.sh up (etcd × 3, PostgreSQL 15 × 3 under Patroni with a synchronous standby, 2 kettle serve nodes, HAProxy) on 127.0.44.x; " +
		"kettle swarm v1 (300 kettles) and v0 (100 kettles), every 2 s, through HAProxy for 260 s while: the primary's postmaster and Patroni are killed -9 and the old primary started again; " +
		"patronictl switchover; a rolling restart of both nodes (SIGTERM, drain, start); one node killed -9 and started again; the synchronous standby killed, then the other one; " +
		"probes upload and poll every 100 ms through HAProxy. Then the swarms' audits. (go test ./ha/ with KETTLE_HA_LONG=1)"}
	longTest(ctx, e, r, "./ha/", "TestHA", 20*time.Minute, func(l string) bool {
		return (strings.Contains(l, "failover_test.go") || strings.Contains(l, "phases_test.go")) && !strings.Contains(l, "--- last lines")
	})
	if !r.Pass {
		return r
	}
	r.Verdict = fmt.Sprintf("failover, switchover, rolling restart, node kill and standby loss under a swarm: audits lost=0 duplicated=0 (%d findings)", len(r.Measured))
	return r
}
