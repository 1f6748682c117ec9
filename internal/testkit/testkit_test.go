package testkit_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// TestFreeAddr: the address is on loopback and free to listen on.
func TestFreeAddr(t *testing.T) {
	addr := testkit.FreeAddr(t)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	l.Close()
	if host, _, _ := net.SplitHostPort(addr); host != "127.0.0.1" {
		t.Fatalf("FreeAddr = %s, want 127.0.0.1:port", addr)
	}
}

// TestWaitFor: it returns as soon as the condition holds, polling again
// while it does not.
func TestWaitFor(t *testing.T) {
	n := 0
	testkit.WaitFor(t, "the third poll", time.Minute, func() bool { n++; return n == 3 })
	if n != 3 {
		t.Fatalf("polled %d times, want 3", n)
	}
}

// TestPoll: cond is checked at once, then once an interval; past the limit
// Poll gives up and says so (in a synctest bubble: the clock is fake).
func TestPoll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, start := 0, time.Now()
		if !testkit.Poll(time.Minute, time.Second, func() bool { n++; return n == 3 }) || n != 3 || time.Since(start) != 2*time.Second {
			t.Errorf("held on the third check: polled %d times over %s, want 3 over 2s", n, time.Since(start))
		}
		n, start = 0, time.Now()
		if testkit.Poll(10*time.Second, time.Second, func() bool { n++; return false }) || time.Since(start) != 11*time.Second || n != 12 {
			t.Errorf("never held: polled %d times over %s, want 12 over 11s and false", n, time.Since(start))
		}
	})
}

// TestAnswers200: 200 is true; another status or no server is false.
func TestAnswers200(t *testing.T) {
	status := http.StatusOK
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(status) }))
	defer srv.Close()
	if !testkit.Answers200(nil, srv.URL) {
		t.Error("200: false")
	}
	status = http.StatusServiceUnavailable
	if testkit.Answers200(srv.Client(), srv.URL) {
		t.Error("503: true")
	}
	if testkit.Answers200(nil, "http://"+testkit.FreeAddr(t)) {
		t.Error("no server: true")
	}
}

// TestStart: the process's output is read while it runs, and it is stopped
// when the (sub)test ends.
func TestStart(t *testing.T) {
	sh := testkit.Tool(t, "dash", "sh")
	var pid string
	t.Run("run", func(t *testing.T) {
		out := testkit.Start(t, sh, "-c", "echo pid $$; exec sleep 60")
		testkit.WaitFor(t, "its first line", 10*time.Second, func() bool { return strings.Contains(out.String(), "\n") })
		pid = strings.Fields(out.String())[1]
	})
	if _, err := os.Stat("/proc/" + pid); !os.IsNotExist(err) {
		t.Fatalf("process %s still there after its test ended: %v", pid, err)
	}
}
