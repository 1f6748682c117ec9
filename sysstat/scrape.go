package sysstat

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// maxScrapeBytes bounds one /metrics page: a server gone wrong must not make
// the sampler grow without limit.
const maxScrapeBytes = 8 << 20

// scraper reads the server's /metrics and turns counters into rates.
type scraper struct {
	url    string
	client *http.Client
	prevAt time.Time
	prev   map[string]float64
}

// Counters whose rates we record (summed over their labels).
const (
	mRejected     = "kettle_ingest_rejected_total"
	mConnsRefused = "kettle_http_connections_refused_total"
	mStored       = "kettle_ingest_rows_stored_total"
	mStoreErrors  = "kettle_store_errors_total"
	mPoolWait     = "kettle_pg_pool_acquire_wait_seconds_total"
	mPoolEmpty    = "kettle_pg_pool_empty_acquires_total"
	mSQLiteBusy   = "kettle_sqlite_busy_retries_total"
	mSQLiteMerge  = "kettle_sqlite_merge_seconds_total"
	mCommitSum    = "kettle_ingest_commit_seconds_sum"
	mCommitCount  = "kettle_ingest_commit_seconds_count"
)

func (s *scraper) scrape(now time.Time) *ServerGauges {
	g := &ServerGauges{}
	res, err := s.client.Get(s.url)
	if err != nil {
		return g
	}
	defer res.Body.Close()
	if res.StatusCode != 200 {
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, maxScrapeBytes))
		return g
	}
	vals, err := ParseMetrics(io.LimitReader(res.Body, maxScrapeBytes))
	if err != nil {
		return g
	}
	g.Up = true
	gauge := func(name string) *float64 {
		if v, ok := vals[name]; ok {
			return &v
		}
		return nil
	}
	g.QueueRows = gauge("kettle_ingest_queue_rows")
	g.QueueCapacityRows = gauge("kettle_ingest_queue_capacity_rows")
	g.ConnsOpen = gauge("kettle_http_connections_open")
	g.InFlight = gauge("kettle_http_requests_in_flight")
	g.PoolMaxConns = gauge("kettle_pg_pool_max_conns")
	g.PoolAcquiredConns = gauge("kettle_pg_pool_acquired_conns")
	g.HeapBytes = gauge("go_memstats_heap_alloc_bytes")
	g.HeapLiveBytes = gauge("go_gc_heap_live_bytes")
	g.Goroutines = gauge("go_goroutines")
	g.SQLiteMerges = gauge("kettle_sqlite_merges_total")
	g.PGCheckpoints = gauge("kettle_pg_checkpoints_total")
	g.PGWALBytes = gauge("kettle_pg_wal_bytes_total")
	g.PGWALFullPageImages = gauge("kettle_pg_wal_full_page_images_total")
	g.PGCheckpointTimeoutS = gauge("kettle_pg_checkpoint_timeout_seconds")
	g.PGCheckpointBuffers = gauge("kettle_pg_checkpoint_buffers_written_total")
	g.PGWALSegment = gauge("kettle_pg_wal_segment")
	g.PGWALSegmentsReady = gauge("kettle_pg_wal_segments_ready")

	dt := now.Sub(s.prevAt).Seconds()
	rate := func(name string) *float64 {
		v, ok := vals[name]
		if !ok {
			return nil
		}
		p, had := s.prev[name]
		if !had || dt <= 0 || v < p { // first scrape or a restart
			return nil
		}
		r := (v - p) / dt
		return &r
	}
	g.RejectedPerS = rate(mRejected)
	g.ConnsRefusedPerS = rate(mConnsRefused)
	g.RowsStoredPerS = rate(mStored)
	g.StoreErrorsPerS = rate(mStoreErrors)
	g.PoolWaitSecPerS = rate(mPoolWait)
	g.PoolEmptyPerS = rate(mPoolEmpty)
	g.SQLiteBusyPerS = rate(mSQLiteBusy)
	g.SQLiteMergeSecPerS = rate(mSQLiteMerge)
	if n, had := s.prev[mCommitCount]; had {
		if dn := vals[mCommitCount] - n; dn > 0 {
			m := (vals[mCommitSum] - s.prev[mCommitSum]) / dn * 1000
			g.CommitMeanMs = &m
		}
	}
	s.prev, s.prevAt = vals, now
	return g
}

// ParseMetrics reads the Prometheus text format and returns every counter,
// gauge and untyped value summed over its label sets, and every histogram's
// NAME_sum and NAME_count.
func ParseMetrics(r io.Reader) (map[string]float64, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parse metrics: %w", err)
	}
	out := make(map[string]float64, len(fams))
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				out[name] += m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[name] += m.GetGauge().GetValue()
			case dto.MetricType_UNTYPED:
				out[name] += m.GetUntyped().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[name+"_sum"] += m.GetHistogram().GetSampleSum()
				out[name+"_count"] += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out, nil
}

// FindListener returns the pid of the process listening on TCP port (IPv4 or
// IPv6), by matching the socket's inode in /proc/net/tcp{,6} with the
// descriptors in /proc/PID/fd. Other users' processes need privileges to see.
func FindListener(procRoot string, port int) (int, error) {
	if procRoot == "" {
		procRoot = "/proc"
	}
	inodes := map[string]bool{}
	for _, f := range []string{"net/tcp", "net/tcp6"} {
		fh, err := os.Open(filepath.Join(procRoot, f))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			fs := strings.Fields(sc.Text())
			if len(fs) < 10 || fs[3] != "0A" { // 0A = LISTEN
				continue
			}
			i := strings.LastIndexByte(fs[1], ':')
			if i < 0 {
				continue
			}
			if p, err := strconv.ParseUint(fs[1][i+1:], 16, 16); err == nil && int(p) == port {
				inodes["socket:["+fs[9]+"]"] = true
			}
		}
		fh.Close()
	}
	if len(inodes) == 0 {
		return 0, fmt.Errorf("%w on port %d (/proc/net/tcp)", ErrNoListener, port)
	}
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join(procRoot, e.Name(), "fd")
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join(dir, fd.Name())); err == nil && inodes[l] {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("%w on port %d: a socket listens but no visible process owns it (another user's? pass --server-pid)", ErrNoListener, port)
}
