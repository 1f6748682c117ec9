package main_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/liar"
	"github.com/kettlefleet/kettlefleet/internal/servertest"
)

// TestSwarmAuditCanFail runs the kettle binary against a real server behind
// a proxy that lies, and checks the audit catches each lie with its exit
// status: acknowledged but not stored → 3 naming the reading, stored twice
// → 4; no operator token → "audit: skipped" and 1 unless --audit=false.
func TestSwarmAuditCanFail(t *testing.T) {
	srv, _ := servertest.SQLite(t)
	secret := string(srv.Secret())

	// run runs kettle swarm through p and returns its exit status and output.
	run := func(p *liar.Proxy, extra ...string) (int, string) {
		t.Helper()
		return runKettle(t, append([]string{"swarm", "--target", p.URL(), "--secret", secret,
			"--devices", "5", "--interval", "200ms", "--jitter", "20ms", "--duration", "2s",
			"--slo-p99", "0", "--max-error-rate", "-1", "--sample=false", "--report=false"}, extra...)...)
	}
	op := "--operator-token=" + srv.OperatorToken()
	f := func(p *liar.Proxy, extra []string, wantCode int, wantText ...string) string {
		t.Helper()
		code, out := run(liar.Start(t, srv.URL(), p), extra...)
		if code != wantCode {
			t.Errorf("%v: exit %d, want %d\n%s", extra, code, wantCode, out)
		}
		for _, w := range wantText {
			if !strings.Contains(out, w) {
				t.Errorf("%v: output lacks %q\n%s", extra, w, out)
			}
		}
		return out
	}

	// An honest server behind the proxy: clean audit, exit 0.
	f(&liar.Proxy{}, []string{op}, 0, "audit: acked=", "lost=0 duplicated=0")

	// The third upload is acknowledged and dropped: exit 3, and the failure
	// line names the device and device time that were lost.
	lose := &liar.Proxy{Lose: func(_ string, n int64) bool { return n == 3 }}
	out := f(lose, []string{op}, 3, "lost=1 ", "audit failed: 1 acknowledged readings lost")
	if l := lose.Lost(); len(l) != 1 {
		t.Errorf("proxy dropped %d readings, want 1", len(l))
	} else if id, ok := kettle.VerifyDeviceToken(srv.Secret(), l[0].Token); !ok ||
		!strings.Contains(out, id.String()+" "+l[0].Time.UTC().Format(time.RFC3339Nano)) {
		t.Errorf("the failure does not name the lost reading %s %s:\n%s", id, l[0].Time.UTC().Format(time.RFC3339Nano), out)
	}

	// One reading listed twice by the history: exit 4.
	dbl := &liar.Proxy{Double: true}
	f(dbl, []string{op}, 4, "duplicated=1 ", "audit failed: 1 acknowledged readings stored more than once")
	if len(dbl.Doubled()) != 1 {
		t.Errorf("proxy doubled %v", dbl.Doubled())
	}

	// No operator token: the audit cannot run, and the run does not pass.
	f(&liar.Proxy{}, nil, 1, "audit: skipped (no operator token", "kettle swarm: audit: skipped")
	out = f(&liar.Proxy{}, []string{"--audit=false"}, 0)
	if strings.Contains(out, "audit:") {
		t.Errorf("--audit=false still speaks of the audit:\n%s", out)
	}
}
