package main

import (
	"context"
	"strings"
	"time"
)

// Faults of issue 53 on the Patroni topology, each a long test of ha/ that
// deploy/cluster.sh's topology runs (KETTLE_HA_LONG=1): the figures and the
// lines the test logs become the part's findings.

// partPause (scenario b): the primary paused with SIGSTOP past Patroni's
// ttl and resumed, then the new primary killed -9, in one run.
func partPause(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "deploy/cluster.sh up (etcd × 3, Patroni × 3 with a synchronous standby, 2 kettle serve nodes, HAProxy) on 127.0.44.x; kettle swarm v1 (200 kettles every 2 s) and a probe uploading every 100 ms through HAProxy; " +
		"the primary's Patroni, postmaster and backends stopped with SIGSTOP for 30 s (past the 20 s ttl) and continued; three healthy members again; then the new primary killed -9 and started again. " +
		"Judged: the longest time without an acknowledged upload around each fault (a pause may cost no more than a kill, +1 s), and the swarm's audit (a commit the resumed stale leader took would be rewound away: lost > 0). (go test ./ha/ -run TestPausedPrimary, KETTLE_HA_LONG=1)"}
	haTestPart(ctx, e, r, "TestPausedPrimary", 20*time.Minute, "pause_test.go")
	if r.Pass {
		r.Verdict = "paused primary (30 s, past the ttl) against a dead one: " + headline(r, "primary_pause_no_ack_span", "primary_kill_no_ack_span", "primary_pause_promoted_to_first_ack")
	}
	return r
}

// partLogFailover (scenario f): with --log, a kill -9 of the primary and a
// planned switchover under the fleet.
func partLogFailover(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true, Done: "deploy/cluster.sh up with both nodes as kettle serve --log fronts of deploy/kafka's three brokers and one writer (--role writer) on the multi-host DSN; kettle swarm v1 (300 kettles every 2 s) and 10 probe kettles uploading every 100 ms through HAProxy; " +
		"the Patroni primary killed -9 and started again, three healthy members, then patronictl switchover. Judged: every answer 200 (0 non-200: the failover is the writer's lag, not the kettles' refusals), the audit after the writer drained the log. (go test ./ha/ -run TestLogFailover, KETTLE_HA_LONG=1)"}
	haTestPart(ctx, e, r, "TestLogFailover", 20*time.Minute, "logfailover_test.go")
	if r.Pass {
		r.Verdict = "kill -9 of the primary and a switchover behind the readings log: " + headline(r, "log_run_kettle_errors", "log_failover_probe_non200", "log_switchover_probe_non200", "v1_lost")
	}
	return r
}

// haTestPart runs one long ha/ test and copies its figures and its own
// file's log lines into r; a failed test fails r.
func haTestPart(ctx context.Context, e *env, r *Result, test string, limit time.Duration, file string) {
	longTest(ctx, e, r, "./ha/", test, limit, func(l string) bool {
		return strings.HasPrefix(l, file+":") && !strings.Contains(l, "timeline (from")
	})
}

// headline joins the findings of r that report the named figures.
func headline(r *Result, figures ...string) string {
	var out []string
	for _, f := range figures {
		for _, m := range r.Measured {
			if strings.HasPrefix(m, f+": ") {
				out = append(out, m)
			}
		}
	}
	return strings.Join(out, "; ")
}
