package ha_test

import (
	"testing"
	"time"
)

// TestPausedPrimary (issue 53, scenario b; make chaos's pause part): the
// primary's Patroni, postmaster and backends stopped with SIGSTOP past
// Patroni's ttl (Jepsen's pause: a machine that neither answers nor
// refuses, whose sockets stay open), then continued; then, in the same
// run and harness, the new primary killed -9 (its machine dies). A paused
// primary must cost the kettles no more time without an acknowledgement
// than a dead one, and never acknowledge as a stale leader once resumed:
// a commit it took after it lost the lock is on no standby and would be
// rewound away, so the audit (lost=0) judges it.
func TestPausedPrimary(t *testing.T) {
	if !long {
		t.Skip("KETTLE_HA_LONG: a pause past Patroni's ttl and a kill, each with the old primary's rejoin (about 4 minutes; make chaos's pause part)")
	}
	tp := up(t, 2)
	const run = 240 * time.Second
	v1 := tp.swarm("v1", 200, run)
	swarmStart := time.Now()
	dev := newProbeDevice(tp.readFile("secret"))
	ingest := startProbe(100*time.Millisecond, 20*time.Second, dev.reading(time.Now().Add(-time.Hour)))
	defer ingest.close()
	time.Sleep(10 * time.Second)

	// cost runs fault on the primary and returns how long no upload was
	// acknowledged around it.
	cost := func(fault string, hold time.Duration) time.Duration {
		t.Helper()
		old := tp.leader()
		at := time.Now()
		tp.must(30*time.Second, fault, old)
		back := ingest.waitOK(t, at.Add(time.Second), 2*time.Minute, "an upload after the primary was "+fault+"d")
		if rest := hold - time.Since(at); rest > 0 {
			time.Sleep(rest) // a pause lasts hold whether or not a standby took over
		}
		switch fault {
		case "pause":
			tp.must(30*time.Second, "resume", old)
		case "kill":
			tp.must(30*time.Second, "start", old)
		}
		healed := time.Now()
		// Acknowledgements go on while the old primary is back; from
		// then on it must not take a commit as leader.
		time.Sleep(5 * time.Second)
		ss := ingest.between(at.Add(-time.Second), time.Now())
		gap := ackGap(ss)
		nl := tp.leader()
		t.Logf("%s of %s: the first upload acknowledged after it %.2fs later; %.2fs without an acknowledged upload; uploads %s; new primary %s; %s back %.1fs after the %s",
			fault, old, back.Sub(at).Seconds(), gap.Seconds(), counts(ss), nl, old, healed.Sub(at).Seconds(), fault)
		figure(t, "primary_"+fault+"_no_ack_span", gap.Seconds(), "s")
		if nl == old {
			t.Errorf("%s: %s is the leader again after the %s (no failover happened)", fault, old, fault)
		}
		// The nodes' share: from the new primary accepting connections to
		// the first acknowledgement. Before it, no member is writable:
		// Patroni's (the ttl, and in its leader race a 2 s request to each
		// member's REST API, which a paused member neither answers nor
		// refuses: patroni/ha.py fetch_node_status, timeout=2, fixed).
		if ready, who := firstLine(tp.memberLogs(at, back.Add(time.Second)), "database system is ready to accept connections"); ready.IsZero() {
			t.Errorf("%s: no member logged that it accepts connections between the %s and the first acknowledgement", fault, fault)
		} else {
			share := back.Sub(ready)
			t.Logf("%s: %s accepted connections %.2fs after the %s; the first upload was acknowledged %.2fs after that", fault, who, ready.Sub(at).Seconds(), fault, share.Seconds())
			figure(t, "primary_"+fault+"_promoted_to_first_ack", share.Seconds(), "s")
			if share > time.Second {
				t.Errorf("%s: the first upload was acknowledged %.2fs after the new primary accepted connections, want ≤ 1 s (the nodes' share)", fault, share.Seconds())
			}
		}
		tp.timeline(t, fault, at.Add(-time.Second), back.Add(2*time.Second), ingest.between(at.Add(-time.Second), back.Add(2*time.Second)))
		rejoin := tp.waitHealthy(3 * time.Minute)
		t.Logf("%s: %s rejoined; three healthy members %.1fs later", fault, old, rejoin.Seconds())
		return gap
	}
	// 30 s: past the ttl (20 s), so a standby takes over while the old
	// primary is stopped, and it resumes to find itself a stale leader.
	paused := cost("pause", 30*time.Second)
	killed := cost("kill", 0)
	r1 := v1.results(t, run+3*time.Minute-time.Since(swarmStart))
	checkAudit(t, "v1", r1)
	t.Logf("a paused primary cost %.2fs without an acknowledged upload, a dead one %.2fs", paused.Seconds(), killed.Seconds())
	// The bound: no more time than a dead one; a second of slack
	// for where in Patroni's loop the fault fell.
	if paused > killed+time.Second {
		t.Errorf("a paused primary cost %.2fs without an acknowledgement, a dead one %.2fs: want no more (+1 s)", paused.Seconds(), killed.Seconds())
	}
}
