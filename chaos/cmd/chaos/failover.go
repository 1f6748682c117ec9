package main

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"time"
)

var figureRE = regexp.MustCompile(`figure: (\S+) = (\S+) (\S+)`)

// partFailover runs the high-availability tests of ha/ in their long form
// (KETTLE_HA_LONG=1): the topology of deploy/cluster.sh on 127.0.44.x, a
// swarm through HAProxy, and every fault of the issue in one run; each
// figure the test logs becomes a finding.
func partFailover(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "deploy/cluster.sh up (etcd × 3, PostgreSQL 15 × 3 under Patroni with a synchronous standby, 2 kettle serve nodes, HAProxy) on 127.0.44.x; " +
		"kettle swarm v1 (300 kettles) and v0 (100 kettles), every 2 s, through HAProxy for 260 s while: the primary's postmaster and Patroni are killed -9 and the old primary started again; " +
		"patronictl switchover; a rolling restart of both nodes (SIGTERM, drain, start); one node killed -9 and started again; the synchronous standby killed, then the other one; " +
		"probes upload and poll every 100 ms through HAProxy. Then the swarms' audits. (go test ./ha/ with KETTLE_HA_LONG=1)"}
	os.Setenv("KETTLE_HA_LONG", "1")
	defer os.Unsetenv("KETTLE_HA_LONG")
	out, err := goTest(ctx, e, 20*time.Minute, "-count=1", "-v", "-timeout", "19m", "-run", "^TestHA$", "./ha/")
	for _, line := range strings.Split(out, "\n") {
		if m := figureRE.FindStringSubmatch(line); m != nil {
			r.measure("%s: %s %s", m[1], m[2], m[3])
		} else if strings.Contains(line, "failover_test.go") || strings.Contains(line, "phases_test.go") {
			if l := strings.TrimSpace(line); !strings.Contains(l, "--- last lines") {
				r.measure("%s", l)
			}
		}
	}
	if err != nil {
		return r.fail("go test ./ha/: %v %s", err, failureExcerpt(out))
	}
	r.Verdict = fmt.Sprintf("failover, switchover, rolling restart, node kill and standby loss under a swarm: audits lost=0 duplicated=0 (%d findings)", len(r.Measured))
	return r
}
