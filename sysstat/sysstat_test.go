package sysstat_test

import (
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/servertest"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// TestSamplerAgainstServer samples a real kettle serve running in this
// process, as kettle demo does: the process is recorded once, the server's
// gauges are scraped, and the listener is found from its port.
func TestSamplerAgainstServer(t *testing.T) {
	srv, _ := servertest.SQLite(t)
	_, port, _ := net.SplitHostPort(srv.Addr())
	p, _ := strconv.Atoi(port)
	pid, err := sysstat.FindListener("", p)
	if err != nil || pid != os.Getpid() {
		t.Fatalf("FindListener(%d) = %d, %v; want this process %d", p, pid, err, os.Getpid())
	}

	s, err := sysstat.Start(t.Context(), sysstat.Config{ServerPID: pid, MetricsURL: srv.URL() + "/metrics", Interval: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC() // the server is this process: a collection has set its live heap
	time.Sleep(1100 * time.Millisecond)
	ser := s.Close()
	if len(ser.Samples) < 2 {
		t.Fatalf("%d samples in 1.1 s at 300 ms", len(ser.Samples))
	}
	if !ser.SameProcess || ser.CPUs < 1 || ser.MemTotalBytes <= 0 {
		t.Errorf("series header: same=%v cpus=%d mem=%d", ser.SameProcess, ser.CPUs, ser.MemTotalBytes)
	}
	last := ser.Samples[len(ser.Samples)-1]
	sp := last.Procs[sysstat.RoleServer]
	if sp == nil || sp.RSSBytes <= 0 || sp.Threads <= 0 || sp.FDs <= 0 || sp.Count != 1 {
		t.Fatalf("server process sample: %+v", sp)
	}
	if last.Procs[sysstat.RoleSimulator] != nil {
		t.Error("the simulator is the server's process: it must be recorded once")
	}
	if b := last.CPU.Busy() + last.CPU.Idle + last.CPU.Iowait; b < 50*float64(ser.CPUs) || b > 110*float64(ser.CPUs) {
		t.Errorf("machine CPU states sum to %.0f %%, want about %d", b, 100*ser.CPUs)
	}
	g := last.Server
	if g == nil || !g.Up || g.QueueCapacityRows == nil || *g.QueueCapacityRows <= 0 || g.ConnsOpen == nil || g.RejectedPerS == nil {
		t.Fatalf("server gauges: %+v", g)
	}
	// The live heap the report judges memory growth on (go_gc_heap_live_bytes).
	if g.HeapLiveBytes == nil || *g.HeapLiveBytes <= 0 || g.HeapBytes == nil || *g.HeapLiveBytes > 4**g.HeapBytes {
		t.Errorf("server live heap: %v (heap %v)", g.HeapLiveBytes, g.HeapBytes)
	}
	if _, err := os.Stat("/proc/pressure/cpu"); err == nil && last.PSI["cpu"] == nil {
		t.Error("PSI present on this kernel but not sampled")
	}
	t.Logf("last sample: cpu %+v run queue %d server %+v disks %d net lo %.0f B/s", last.CPU, last.ProcsRunning, *sp, len(last.Disks), last.Net.LoopbackBps)
}

// TestSamplerServerDown: a server that does not answer is recorded as down,
// and the sampler neither fails nor blocks past its interval.
func TestSamplerServerDown(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	start := time.Now()
	s, err := sysstat.Start(t.Context(), sysstat.Config{MetricsURL: "http://" + addr + "/metrics", Interval: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(700 * time.Millisecond)
	ser := s.Close()
	if time.Since(start) > 3*time.Second {
		t.Errorf("sampler took %v to stop", time.Since(start))
	}
	if len(ser.Samples) == 0 || ser.Samples[0].Server == nil || ser.Samples[0].Server.Up {
		t.Fatalf("want samples with server down, got %+v", ser.Samples)
	}
	if !strings.Contains(strings.Join(ser.Missing, ";"), "never answered") {
		t.Errorf("missing = %q", ser.Missing)
	}
	if ser.Roles[sysstat.RoleServer] == "" || ser.Samples[0].Procs[sysstat.RoleSimulator] == nil {
		t.Errorf("roles %v, procs %v", ser.Roles, ser.Samples[0].Procs)
	}
}

func TestParseMetrics(t *testing.T) {
	f := func(text string, want map[string]float64) {
		t.Helper()
		got, err := sysstat.ParseMetrics(strings.NewReader(text))
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s = %v, want %v (all: %v)", k, got[k], v, got)
			}
		}
	}
	f("# TYPE kettle_ingest_queue_rows gauge\nkettle_ingest_queue_rows 12\n", map[string]float64{"kettle_ingest_queue_rows": 12})
	f("# TYPE kettle_ingest_rejected_total counter\nkettle_ingest_rejected_total{reason=\"queue_full\"} 3\nkettle_ingest_rejected_total{reason=\"store_error\"} 4\n",
		map[string]float64{"kettle_ingest_rejected_total": 7})
	f("# TYPE c histogram\nc_bucket{le=\"1\"} 2\nc_bucket{le=\"+Inf\"} 3\nc_sum 1.5\nc_count 3\n", map[string]float64{"c_sum": 1.5, "c_count": 3})
	if _, err := sysstat.ParseMetrics(strings.NewReader("not { metrics")); err == nil {
		t.Error("garbage parsed")
	}
}

func TestFindListenerNone(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	p := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	if _, err := sysstat.FindListener("", p); err == nil {
		t.Error("found a listener on a closed port")
	}
}
