// Package sysstat samples the machine and the processes under test once a
// second while a load test runs: CPU, memory, threads and descriptors of the
// server, of PostgreSQL and of the simulator; machine CPU, run queue and
// pressure stall information; disk utilisation, await and queue size;
// network bytes; and the server's own saturation gauges, scraped from its
// /metrics. The series goes into the run's results.json, where the report
// reads it to find the first resource that saturated (the USE method).
//
// Everything is read from /proc with prometheus/procfs; a file the kernel
// does not have (PSI on older kernels) is recorded as missing, never an error.
package sysstat

import (
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// WriteFile writes the series as JSON (kettle serve --sample keeps its
// own; kettle report --system attaches it to a swarm's results).
func (s *Series) WriteFile(path string) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write system samples: %w", err)
	}
	return nil
}

// ReadFile reads a series written by WriteFile.
func ReadFile(path string) (*Series, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var s Series
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return &s, nil
}

// Process roles: the keys of Sample.Procs.
const (
	RoleServer    = "server"
	RolePostgres  = "postgres"
	RoleSimulator = "simulator"
)

// Series is what a sampler recorded: the section "system" of results.json.
type Series struct {
	IntervalS float64   `json:"interval_s"`
	CPUs      int       `json:"cpus"` // online CPUs: machine CPU % runs to 100×CPUs
	Start     time.Time `json:"start"`
	// Roles maps a role to what was sampled for it, e.g. "pid 4242 (kettle)",
	// "all processes named postgres", "same process as the server".
	Roles map[string]string `json:"roles"`
	// SameProcess is true when the server runs inside the simulator's process
	// (kettle demo): that one process is recorded under RoleServer only.
	SameProcess bool `json:"same_process,omitempty"`
	// Missing lists what this machine could not provide, e.g. "psi" (kernel
	// without /proc/pressure) or "metrics" (the server's /metrics never answered).
	Missing []string `json:"missing,omitempty"`
	// MemTotalBytes is the machine's memory.
	MemTotalBytes int64    `json:"mem_total_bytes"`
	Samples       []Sample `json:"samples"`
}

// Sample is one second. Rates and percentages are over the interval since
// the previous sample; CPU percentages count one core as 100.
type Sample struct {
	Time time.Time `json:"time"`
	// Procs by role; a role with no live process is absent.
	Procs map[string]*Proc `json:"procs,omitempty"`
	CPU   MachineCPU       `json:"cpu"`
	// ProcsRunning is the run queue (procs_running in /proc/stat), runnable
	// threads including those on a CPU; ProcsBlocked those waiting for I/O.
	ProcsRunning int     `json:"procs_running"`
	ProcsBlocked int     `json:"procs_blocked"`
	Load1        float64 `json:"load1"`
	// PSI by resource (cpu, io, memory): nil when the kernel has none.
	PSI               map[string]*PSI  `json:"psi,omitempty"`
	MemAvailableBytes int64            `json:"mem_available_bytes"`
	Disks             map[string]*Disk `json:"disks,omitempty"`
	Net               Net              `json:"net"`
	// Server is the scrape of the server's /metrics; nil when not scraped.
	Server *ServerGauges `json:"server,omitempty"`
}

// Proc is one role's processes, summed.
type Proc struct {
	Count    int     `json:"count"`   // processes
	CPUPct   float64 `json:"cpu_pct"` // 100 = one core busy
	RSSBytes int64   `json:"rss_bytes"`
	Threads  int     `json:"threads"`
	FDs      int     `json:"fds"`
}

// MachineCPU is the whole machine's CPU time by state, in percent where the
// machine total is 100×CPUs (200 on two cores).
type MachineCPU struct {
	User   float64 `json:"user"`   // user + nice
	System float64 `json:"system"` // system + irq + softirq
	Iowait float64 `json:"iowait"`
	Steal  float64 `json:"steal"`
	Idle   float64 `json:"idle"`
}

// Busy is the CPU in use (user + system + steal), same scale.
func (c MachineCPU) Busy() float64 { return c.User + c.System + c.Steal }

// PSI is pressure stall information for one resource.
type PSI struct {
	// SomePct is the share of the interval in which some task stalled on the
	// resource (from the total counter, exact); FullPct all non-idle tasks.
	SomePct float64 `json:"some_pct"`
	FullPct float64 `json:"full_pct,omitempty"`
	// SomeAvg10 is the kernel's own 10 s average.
	SomeAvg10 float64 `json:"some_avg10"`
}

// Disk is one block device (whole disks, no partitions).
type Disk struct {
	UtilPct    float64 `json:"util_pct"`   // time the device was busy
	AwaitMs    float64 `json:"await_ms"`   // mean time per completed I/O, queueing included
	QueueSize  float64 `json:"queue_size"` // mean I/Os in flight (aqu-sz)
	ReadBps    float64 `json:"read_bps"`
	WriteBps   float64 `json:"write_bps"`
	IOPS       float64 `json:"iops"`
	InProgress int     `json:"in_progress"`
}

// Net is bytes per second received + transmitted.
type Net struct {
	LoopbackBps float64 `json:"loopback_bps"`
	TotalBps    float64 `json:"total_bps"` // every interface, loopback included
}

// ServerGauges are the saturation signals scraped from kettle serve's
// /metrics. Pointers are nil when the server does not expose the metric
// (the pool exists only with PostgreSQL).
type ServerGauges struct {
	Up                bool     `json:"up"` // the scrape succeeded
	QueueRows         *float64 `json:"queue_rows,omitempty"`
	QueueCapacityRows *float64 `json:"queue_capacity_rows,omitempty"`
	RejectedPerS      *float64 `json:"rejected_per_s,omitempty"` // readings refused 503, all reasons
	ConnsOpen         *float64 `json:"conns_open,omitempty"`
	ConnsRefusedPerS  *float64 `json:"conns_refused_per_s,omitempty"`
	InFlight          *float64 `json:"in_flight,omitempty"`
	RowsStoredPerS    *float64 `json:"rows_stored_per_s,omitempty"`
	StoreErrorsPerS   *float64 `json:"store_errors_per_s,omitempty"`
	PoolMaxConns      *float64 `json:"pool_max_conns,omitempty"`
	PoolAcquiredConns *float64 `json:"pool_acquired_conns,omitempty"`
	PoolWaitSecPerS   *float64 `json:"pool_wait_s_per_s,omitempty"` // mean acquirers waiting
	PoolEmptyPerS     *float64 `json:"pool_empty_acquires_per_s,omitempty"`
	SQLiteBusyPerS    *float64 `json:"sqlite_busy_per_s,omitempty"`
	// SQLiteMergeSecPerS is the share of the interval the embedded store's
	// writer spent merging staged rows (ingest batches wait meanwhile).
	SQLiteMergeSecPerS *float64 `json:"sqlite_merge_s_per_s,omitempty"`
	HeapBytes          *float64 `json:"heap_bytes,omitempty"`
	// HeapLiveBytes is the Go heap the server's last collection kept
	// (go_gc_heap_live_bytes): unlike RSS and HeapBytes it does not include
	// the garbage a collector target such as GOGC=400 lets pile up.
	HeapLiveBytes *float64 `json:"heap_live_bytes,omitempty"`
	Goroutines    *float64 `json:"goroutines,omitempty"`
	// CommitMeanMs is the mean ingest transaction time over the interval.
	CommitMeanMs *float64 `json:"commit_mean_ms,omitempty"`
	// The store's periodic work, as counters since the server started
	// (SQLite's merges) or since the database's statistics were reset
	// (PostgreSQL's checkpoints, WAL): a run's share is the difference
	// between two samples.
	SQLiteMerges         *float64 `json:"sqlite_merges,omitempty"`
	PGCheckpoints        *float64 `json:"pg_checkpoints,omitempty"`        // counted as each begins
	PGCheckpointBuffers  *float64 `json:"pg_checkpoint_buffers,omitempty"` // written by checkpoints, counted as they go
	PGWALBytes           *float64 `json:"pg_wal_bytes,omitempty"`
	PGWALFullPageImages  *float64 `json:"pg_wal_fpi,omitempty"`
	PGCheckpointTimeoutS *float64 `json:"pg_checkpoint_timeout_s,omitempty"`
	// PostgreSQL's WAL segment file being written and the files ready
	// after it (gauges; absent where the role may not list pg_wal).
	PGWALSegment       *float64 `json:"pg_wal_segment,omitempty"`
	PGWALSegmentsReady *float64 `json:"pg_wal_segments_ready,omitempty"`
}
