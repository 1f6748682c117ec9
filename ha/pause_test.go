package ha_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// TestPausedPrimary (issue 53, scenario b; make chaos's pause part): the
// primary's Patroni, postmaster and every child of it stopped with SIGSTOP
// past Patroni's ttl (Jepsen's pause: a machine that neither answers nor
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
	// Steady: the probe's uploads acknowledged for a while in a row.
	ingest.waitAcked(t, time.Now(), 50, time.Minute, "uploads before the first fault")

	// cost runs fault on the primary and returns how long no upload was
	// acknowledged around it.
	cost := func(fault string) time.Duration {
		t.Helper()
		old := tp.leader()
		at := time.Now()
		tp.must(30*time.Second, fault, old)
		if fault == "pause" {
			// Every process of the member stopped, the backends too:
			// one left running commits on the nodes' open connections.
			if f := tp.must(30*time.Second, "faults"); !strings.Contains(f+"\n", "pause "+old+"\n") {
				t.Fatalf("cluster.sh pause %s: not every process of it is stopped (cluster.sh faults: %q)", old, f)
			}
		}
		back := ingest.waitOK(t, at.Add(time.Second), 2*time.Minute, "an upload after the primary was "+fault+"d")
		// The pause lasts until another member holds the leader lock and
		// commits (past the ttl: the lock expired while old was stopped),
		// so old resumes as a stale leader.
		nl := tp.waitLeaderNot(t, old, time.Minute)
		ingest.waitAcked(t, back, 20, time.Minute, "uploads to the new primary "+nl)
		switch fault {
		case "pause":
			tp.must(30*time.Second, "resume", old)
		case "kill":
			tp.must(30*time.Second, "start", old)
		}
		healed := time.Now()
		// Acknowledgements go on while the old primary is back; from
		// then on it must not take a commit as leader: the window ends
		// once it says it is not the primary and uploads went on past that.
		tp.waitRoleNot(t, old, "primary", 2*time.Minute)
		ingest.waitAcked(t, time.Now(), 20, time.Minute, "uploads after "+old+" stepped down")
		ss := ingest.between(at.Add(-time.Second), time.Now())
		gap := ackGap(ss)
		t.Logf("%s of %s: the first upload acknowledged after it %.2fs later; %.2fs without an acknowledged upload; uploads %s; new primary %s; %s back %.1fs after the %s",
			fault, old, back.Sub(at).Seconds(), gap.Seconds(), counts(ss), nl, old, healed.Sub(at).Seconds(), fault)
		figure(t, "primary_"+fault+"_no_ack_span", gap.Seconds(), "s")
		// The nodes' share: from the new primary accepting connections to
		// the first acknowledgement. Before it, no member is writable:
		// Patroni's (the ttl, and in its leader race a 2 s request to each
		// member's REST API, which a paused member neither answers nor
		// refuses: patroni/ha.py fetch_node_status, timeout=2, fixed).
		if ready, who := firstLine(tp.memberLogs(at, back.Add(time.Second)), "database system is ready to accept connections"); ready.IsZero() {
			t.Errorf("%s: no member logged that it accepts connections between the %s and the first acknowledgement (did %s go on committing?)", fault, fault, old)
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
	paused := cost("pause")
	killed := cost("kill")
	r1 := v1.results(t, run+3*time.Minute-time.Since(swarmStart))
	checkAudit(t, "v1", r1)
	t.Logf("a paused primary cost %.2fs without an acknowledged upload, a dead one %.2fs", paused.Seconds(), killed.Seconds())
	// No more time than a dead one, but for Patroni's own share: in its
	// leader race each standby asks every member it knows, the old leader
	// too, for its WAL position with a fixed 2 s timeout (patroni/ha.py
	// fetch_node_status), which a dead machine's refusal ends at once and
	// a paused one's silence does not; and a second of slack for where in
	// Patroni's loop (loop_wait 1 s) the fault fell.
	if bound := killed + leaderRaceTimeout + time.Second; paused > bound {
		t.Errorf("a paused primary cost %.2fs without an acknowledgement, a dead one %.2fs: want no more than %.2fs (+%s Patroni's leader race, +1 s)", paused.Seconds(), killed.Seconds(), bound.Seconds(), leaderRaceTimeout)
	}
}

// leaderRaceTimeout is Patroni's fixed timeout of a member's status in its
// leader race (patroni/ha.py fetch_node_status: timeout=2).
const leaderRaceTimeout = 2 * time.Second

// waitAcked waits until n uploads sent after t were acknowledged.
func (p *probe) waitAcked(t *testing.T, after time.Time, n int, limit time.Duration, what string) {
	t.Helper()
	testkit.WaitFor(t, fmt.Sprintf("%s: %d acknowledged", what, n), limit, func() bool {
		return countStatus(p.between(after, time.Now()), 200) >= n
	})
}

// waitLeaderNot waits until a member other than old holds the leader lock.
func (tp *topo) waitLeaderNot(t *testing.T, old string, limit time.Duration) string {
	t.Helper()
	var l string
	testkit.WaitFor(t, "a leader other than "+old, limit, func() bool {
		out, err := tp.cmd(10*time.Second, "leader")
		l = out
		return err == nil && l != "" && l != old
	})
	return l
}

// waitRoleNot waits until member m's own Patroni answers with a role
// other than role (its REST API: what it believes, not what etcd says).
func (tp *topo) waitRoleNot(t *testing.T, m, role string, limit time.Duration) {
	t.Helper()
	var i int
	if _, err := fmt.Sscanf(m, "pg%d", &i); err != nil {
		t.Fatalf("member %q: not pgN", m)
	}
	c := tp.client()
	testkit.WaitFor(t, m+"'s Patroni answering a role other than "+role, limit, func() bool {
		r, err := c.Get(patroni(i, "/patroni"))
		if err != nil {
			return false
		}
		defer r.Body.Close()
		var st struct{ Role string }
		return json.NewDecoder(r.Body).Decode(&st) == nil && st.Role != "" && st.Role != role
	})
}
