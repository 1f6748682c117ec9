package sysstat

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/procfs"
	"github.com/prometheus/procfs/blockdevice"
)

// Config says what to sample.
type Config struct {
	// ServerPID is the server process; 0: none (PostgreSQL and the machine
	// are still sampled).
	ServerPID int
	// SimulatorPID is the load generator; 0: this process; -1: none (kettle
	// serve sampling itself).
	SimulatorPID int
	// MetricsURL is the server's /metrics, scraped every interval for its
	// saturation gauges; empty: not scraped.
	MetricsURL string
	// PostgresName is the process name (comm) of PostgreSQL's processes,
	// all of which are summed; default "postgres".
	PostgresName string
	// PostgresPID narrows PostgreSQL to one cluster: its postmaster and the
	// postmaster's children (on a machine with several clusters). -1: do not
	// sample PostgreSQL (an embedded-store run).
	PostgresPID int
	Interval    time.Duration // default 1 s
	// ProcRoot and SysRoot are where procfs and sysfs are mounted (tests).
	ProcRoot, SysRoot string
	// Client scrapes MetricsURL; nil: a client with a timeout below Interval.
	Client *http.Client
}

// Sampler samples once per interval on a goroutine it owns until Close or
// the context given to Start ends.
type Sampler struct {
	cfg    Config
	fs     procfs.FS
	bfs    *blockdevice.FS
	scr    *scraper
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	series Series

	// previous readings, for deltas (owned by the sampling goroutine)
	prevAt    time.Time
	prevCPU   *procfs.CPUStat
	prevProc  map[int]float64 // pid → CPU seconds
	prevDisk  map[string]blockdevice.IOStats
	prevNet   map[string]uint64
	prevPSI   map[string][2]uint64
	warnedPSI bool
	scraped   bool
}

// Start begins sampling. The first sample is taken after one interval (a
// rate needs two readings).
func Start(ctx context.Context, cfg Config) (*Sampler, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.PostgresName == "" {
		cfg.PostgresName = "postgres"
	}
	if cfg.ProcRoot == "" {
		cfg.ProcRoot = procfs.DefaultMountPoint
	}
	if cfg.SysRoot == "" {
		cfg.SysRoot = "/sys"
	}
	if cfg.SimulatorPID == 0 {
		cfg.SimulatorPID = os.Getpid()
	}
	fs, err := procfs.NewFS(cfg.ProcRoot)
	if err != nil {
		return nil, fmt.Errorf("sysstat: open %s: %w", cfg.ProcRoot, err)
	}
	s := &Sampler{cfg: cfg, fs: fs, done: make(chan struct{}),
		prevProc: map[int]float64{}, prevDisk: map[string]blockdevice.IOStats{}, prevNet: map[string]uint64{}, prevPSI: map[string][2]uint64{}}
	if bfs, err := blockdevice.NewFS(cfg.ProcRoot, cfg.SysRoot); err == nil {
		s.bfs = &bfs
	}
	if cfg.MetricsURL != "" {
		c := cfg.Client
		if c == nil {
			c = &http.Client{Timeout: cfg.Interval * 8 / 10}
		}
		s.scr = &scraper{url: cfg.MetricsURL, client: c}
	}
	s.series = Series{IntervalS: cfg.Interval.Seconds(), CPUs: runtime.NumCPU(), Start: time.Now(), Roles: map[string]string{}}
	if st, err := fs.Stat(); err == nil && len(st.CPU) > 0 {
		s.series.CPUs = len(st.CPU)
	}
	if mi, err := fs.Meminfo(); err == nil && mi.MemTotal != nil {
		s.series.MemTotalBytes = int64(*mi.MemTotal) * 1024
	}
	s.describeRoles()
	if s.scr == nil {
		s.missing("metrics (no server /metrics URL given)")
	}
	s.sample(time.Now(), false) // baseline
	ctx, s.cancel = context.WithCancel(ctx)
	go s.loop(ctx)
	return s, nil
}

func (s *Sampler) describeRoles() {
	r := s.series.Roles
	name := func(pid int) string {
		if p, err := s.fs.Proc(pid); err == nil {
			if c, err := p.Comm(); err == nil {
				return fmt.Sprintf("pid %d (%s)", pid, c)
			}
		}
		return fmt.Sprintf("pid %d (not running)", pid)
	}
	if s.cfg.ServerPID > 0 {
		r[RoleServer] = name(s.cfg.ServerPID)
	} else {
		r[RoleServer] = "not sampled (no server pid)"
	}
	switch {
	case s.cfg.PostgresPID < 0:
		r[RolePostgres] = "not sampled (no PostgreSQL in this run)"
	case s.cfg.PostgresPID > 0:
		r[RolePostgres] = fmt.Sprintf("postmaster pid %d and its children, summed", s.cfg.PostgresPID)
	default:
		r[RolePostgres] = fmt.Sprintf("all processes named %q on the machine, summed", s.cfg.PostgresName)
	}
	if s.cfg.SimulatorPID < 0 {
		r[RoleSimulator] = "none"
	} else if s.cfg.SimulatorPID == s.cfg.ServerPID {
		s.series.SameProcess = true
		r[RoleSimulator] = "same process as the server: recorded once, under server"
	} else {
		r[RoleSimulator] = name(s.cfg.SimulatorPID)
	}
}

func (s *Sampler) missing(what string) {
	for _, m := range s.series.Missing {
		if m == what {
			return
		}
	}
	s.series.Missing = append(s.series.Missing, what)
}

func (s *Sampler) loop(ctx context.Context) {
	defer close(s.done)
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.sample(now, true)
		}
	}
}

// Close stops sampling and returns the series.
func (s *Sampler) Close() *Series {
	s.cancel()
	<-s.done
	return s.Series()
}

// Series returns a copy of what has been sampled so far.
func (s *Sampler) Series() *Series {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.series
	c.Samples = append([]Sample(nil), s.series.Samples...)
	c.Missing = append([]string(nil), s.series.Missing...)
	if !s.scraped && s.scr != nil && len(c.Samples) > 0 {
		c.Missing = append(c.Missing, "metrics (the server's /metrics never answered)")
	}
	return &c
}

// Since returns a copy of the samples taken after t (the live view asks
// for the last few seconds each second, not the whole run).
func (s *Sampler) Since(t time.Time) (cpus int, samples []Sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := s.series.Samples
	i := sort.Search(len(all), func(i int) bool { return all[i].Time.After(t) })
	return s.series.CPUs, append([]Sample(nil), all[i:]...)
}

// sample reads everything once; keep records it (false: baseline only).
func (s *Sampler) sample(now time.Time, keep bool) {
	dt := now.Sub(s.prevAt).Seconds()
	s.prevAt = now
	smp := Sample{Time: now, Procs: map[string]*Proc{}}

	if st, err := s.fs.Stat(); err == nil {
		c := st.CPUTotal
		if p := s.prevCPU; p != nil {
			total := (c.User + c.Nice + c.System + c.IRQ + c.SoftIRQ + c.Idle + c.Iowait + c.Steal) -
				(p.User + p.Nice + p.System + p.IRQ + p.SoftIRQ + p.Idle + p.Iowait + p.Steal)
			if total > 0 {
				scale := 100 * float64(s.series.CPUs) / total
				smp.CPU = MachineCPU{
					User:   (c.User + c.Nice - p.User - p.Nice) * scale,
					System: (c.System + c.IRQ + c.SoftIRQ - p.System - p.IRQ - p.SoftIRQ) * scale,
					Iowait: (c.Iowait - p.Iowait) * scale,
					Steal:  (c.Steal - p.Steal) * scale,
					Idle:   (c.Idle - p.Idle) * scale,
				}
			}
		}
		s.prevCPU = &c
		smp.ProcsRunning, smp.ProcsBlocked = int(st.ProcessesRunning), int(st.ProcessesBlocked)
	}
	if la, err := s.fs.LoadAvg(); err == nil {
		smp.Load1 = la.Load1
	}
	if mi, err := s.fs.Meminfo(); err == nil && mi.MemAvailable != nil {
		smp.MemAvailableBytes = int64(*mi.MemAvailable) * 1024
	}
	s.sampleProcs(&smp, dt)
	s.samplePSI(&smp, dt)
	s.sampleDisks(&smp, dt)
	s.sampleNet(&smp, dt)
	if s.scr != nil {
		smp.Server = s.scr.scrape(now)
		if smp.Server.Up {
			s.scraped = true
		}
	}
	if !keep {
		return
	}
	s.mu.Lock()
	s.series.Samples = append(s.series.Samples, smp)
	s.mu.Unlock()
}

// sampleProcs sums the processes of each role. PostgreSQL is found by name
// at every sample: backends come and go.
func (s *Sampler) sampleProcs(smp *Sample, dt float64) {
	cur := map[int]float64{}
	add := func(role string, pid int) {
		p, err := s.fs.Proc(pid)
		if err != nil {
			return
		}
		st, err := p.Stat()
		if err != nil {
			return
		}
		r := smp.Procs[role]
		if r == nil {
			r = &Proc{}
			smp.Procs[role] = r
		}
		cpu := st.CPUTime()
		cur[pid] = cpu
		if prev, ok := s.prevProc[pid]; ok && dt > 0 {
			r.CPUPct += (cpu - prev) / dt * 100
		}
		r.Count++
		r.RSSBytes += int64(st.ResidentMemory())
		r.Threads += st.NumThreads
		if n, err := p.FileDescriptorsLen(); err == nil {
			r.FDs += n
		}
	}
	if s.cfg.ServerPID > 0 {
		add(RoleServer, s.cfg.ServerPID)
	}
	if s.cfg.SimulatorPID > 0 && s.cfg.SimulatorPID != s.cfg.ServerPID {
		add(RoleSimulator, s.cfg.SimulatorPID)
	}
	if s.cfg.PostgresPID >= 0 {
		for _, pid := range s.pidsNamed(s.cfg.PostgresName) {
			if pid != s.cfg.ServerPID && pid != s.cfg.SimulatorPID {
				add(RolePostgres, pid)
			}
		}
	}
	s.prevProc = cur
}

// pidsNamed lists the processes whose comm is name (a cheap scan: one small
// read per process), or with PostgresPID the postmaster and its children.
func (s *Sampler) pidsNamed(name string) []int {
	if pm := s.cfg.PostgresPID; pm > 0 {
		pids := []int{pm}
		if procs, err := s.fs.AllProcs(); err == nil {
			for _, p := range procs {
				if st, err := p.Stat(); err == nil && st.PPID == pm {
					pids = append(pids, p.PID)
				}
			}
		}
		return pids
	}
	ents, err := os.ReadDir(s.cfg.ProcRoot)
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.cfg.ProcRoot, e.Name(), "comm"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (s *Sampler) samplePSI(smp *Sample, dt float64) {
	for _, res := range []string{"cpu", "io", "memory"} {
		ps, err := s.fs.PSIStatsForResource(res)
		if err != nil || ps.Some == nil {
			if !s.warnedPSI {
				s.mu.Lock()
				s.missing("psi (no /proc/pressure on this kernel)")
				s.mu.Unlock()
				s.warnedPSI = true
			}
			continue
		}
		var full uint64
		if ps.Full != nil {
			full = ps.Full.Total
		}
		cur := [2]uint64{ps.Some.Total, full}
		p := &PSI{SomeAvg10: ps.Some.Avg10}
		if prev, ok := s.prevPSI[res]; ok && dt > 0 {
			// Totals are µs stalled.
			p.SomePct = float64(cur[0]-prev[0]) / (dt * 1e6) * 100
			p.FullPct = float64(cur[1]-prev[1]) / (dt * 1e6) * 100
		}
		s.prevPSI[res] = cur
		if smp.PSI == nil {
			smp.PSI = map[string]*PSI{}
		}
		smp.PSI[res] = p
	}
}

func (s *Sampler) sampleDisks(smp *Sample, dt float64) {
	if s.bfs == nil {
		return
	}
	ds, err := s.bfs.ProcDiskstats()
	if err != nil {
		return
	}
	for _, d := range ds {
		n := d.DeviceName
		if strings.HasPrefix(n, "loop") || strings.HasPrefix(n, "ram") || strings.HasPrefix(n, "zram") {
			continue
		}
		// Whole disks only: partitions would count twice.
		if _, err := os.Stat(filepath.Join(s.cfg.SysRoot, "block", n)); err != nil {
			continue
		}
		cur := d.IOStats
		prev, ok := s.prevDisk[n]
		s.prevDisk[n] = cur
		if !ok || dt <= 0 {
			continue
		}
		ms := dt * 1000
		ios := float64(cur.ReadIOs + cur.WriteIOs - prev.ReadIOs - prev.WriteIOs)
		dk := &Disk{
			UtilPct:    min(100, float64(cur.IOsTotalTicks-prev.IOsTotalTicks)/ms*100),
			QueueSize:  float64(cur.WeightedIOTicks-prev.WeightedIOTicks) / ms,
			ReadBps:    float64(cur.ReadSectors-prev.ReadSectors) * 512 / dt,
			WriteBps:   float64(cur.WriteSectors-prev.WriteSectors) * 512 / dt,
			IOPS:       ios / dt,
			InProgress: int(cur.IOsInProgress),
		}
		if ios > 0 {
			dk.AwaitMs = float64(cur.ReadTicks+cur.WriteTicks-prev.ReadTicks-prev.WriteTicks) / ios
		}
		if smp.Disks == nil {
			smp.Disks = map[string]*Disk{}
		}
		smp.Disks[n] = dk
	}
}

func (s *Sampler) sampleNet(smp *Sample, dt float64) {
	nd, err := s.fs.NetDev()
	if err != nil {
		return
	}
	for name, l := range nd {
		cur := l.RxBytes + l.TxBytes
		prev, ok := s.prevNet[name]
		s.prevNet[name] = cur
		if !ok || dt <= 0 || cur < prev {
			continue
		}
		bps := float64(cur-prev) / dt
		smp.Net.TotalBps += bps
		if name == "lo" {
			smp.Net.LoopbackBps += bps
		}
	}
}

// ErrNoListener is returned by FindListener when no process listens there.
var ErrNoListener = errors.New("no process found listening")
