package report_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

func f(v float64) *float64 { return &v }

// TestPeriodicWork: the store's counters are differenced over the samples
// from the judged start on (scrapes that failed or carry none are skipped),
// and a step with none of the store's periodic work says so.
func TestPeriodicWork(t *testing.T) {
	t0 := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	pg := func(s int, cps, bufs, wal, fpi float64) sysstat.Sample {
		return sysstat.Sample{Time: t0.Add(time.Duration(s) * time.Second), Server: &sysstat.ServerGauges{Up: true,
			PGCheckpoints: f(cps), PGCheckpointBuffers: f(bufs), PGWALBytes: f(wal), PGWALFullPageImages: f(fpi), PGCheckpointTimeoutS: f(1800)}}
	}
	sys := &sysstat.Series{Samples: []sysstat.Sample{
		pg(0, 5, 0, 0, 0), // warmup: left out
		pg(10, 7, 100, 1<<20, 10),
		{Time: t0.Add(15 * time.Second), Server: &sysstat.ServerGauges{Up: false}},
		pg(20, 8, 300, 5<<20, 1010),
		pg(40, 9, 700, 11<<20, 2010),
	}}
	p := report.PeriodicWork(sys, t0.Add(10*time.Second))
	if p == nil || p.Store != "postgres" || p.Checkpoints != 2 || p.CheckpointBuffers != 600 || p.WALBytes != 10<<20 || p.FullPageImages != 2000 || p.JudgedS != 30 || p.CheckpointTimeoutS != 1800 {
		t.Fatalf("postgres: %+v", p)
	}
	if got, want := p.Text(), "PostgreSQL: 2 checkpoints begun (checkpoint_timeout 30m0s), 600 buffers written by checkpoints, WAL 10 MiB, 2000 full-page images"; got != want {
		t.Errorf("text %q, want %q", got, want)
	}
	if c := p.Caveat(); c != "" {
		t.Errorf("caveat with 2 checkpoints inside: %q", c)
	}
	// With the WAL segment gauges: 3 switches with none ready (created),
	// then 2 into files a checkpoint recycled (not).
	seg := func(s *sysstat.Sample, n, ready float64) {
		s.Server.PGWALSegment, s.Server.PGWALSegmentsReady = f(n), f(ready)
	}
	seg(&sys.Samples[0], 10, 0)
	seg(&sys.Samples[1], 11, 0)
	seg(&sys.Samples[3], 14, 0)
	seg(&sys.Samples[4], 16, 4)
	if got, want := report.PeriodicWork(sys, t0.Add(10*time.Second)).Text(), "PostgreSQL: 2 checkpoints begun (checkpoint_timeout 30m0s), 600 buffers written by checkpoints, WAL 10 MiB, 2000 full-page images, 3 new WAL segment files"; got != want {
		t.Errorf("text %q, want %q", got, want)
	}
	for i := range sys.Samples {
		if g := sys.Samples[i].Server; g.Up {
			g.PGWALSegment, g.PGWALSegmentsReady = nil, nil
		}
	}
	// None begun inside, but one begun before still writing: its work is
	// in the step.
	sys.Samples[4] = pg(40, 7, 700, 11<<20, 2010)
	if c := report.PeriodicWork(sys, t0.Add(10*time.Second)).Caveat(); c != "" {
		t.Errorf("caveat with a checkpoint writing inside: %q", c)
	}
	sys.Samples[3], sys.Samples[4] = pg(20, 7, 100, 5<<20, 1010), pg(40, 7, 100, 11<<20, 2010)
	if c := report.PeriodicWork(sys, t0.Add(10*time.Second)).Caveat(); !strings.HasPrefix(c, "no PostgreSQL checkpoint fell inside the 30 s judged (checkpoint_timeout 30m0s)") {
		t.Errorf("caveat without a checkpoint: %q", c)
	}

	lite := func(s int, merges float64) sysstat.Sample {
		return sysstat.Sample{Time: t0.Add(time.Duration(s) * time.Second), Server: &sysstat.ServerGauges{Up: true, SQLiteMerges: f(merges)}}
	}
	sys = &sysstat.Series{Samples: []sysstat.Sample{lite(0, 0), lite(10, 64), lite(30, 128)}}
	if p := report.PeriodicWork(sys, t0.Add(5*time.Second)); p == nil || p.Store != "sqlite" || p.Merges != 64 || p.Caveat() != "" || p.Text() != "SQLite: 64 merges of staged rows" {
		t.Errorf("sqlite: %+v", p)
	}
	if c := report.PeriodicWork(sys, t0.Add(20*time.Second)).Caveat(); !strings.HasPrefix(c, "no merge of the embedded store's staged rows fell inside the 0 s judged") {
		t.Errorf("sqlite caveat: %q", c)
	}
	if p := report.PeriodicWork(&sysstat.Series{Samples: []sysstat.Sample{{Time: t0, Server: &sysstat.ServerGauges{Up: true}}}}, t0); p != nil || p.Caveat() != "" || p.Text() != "" {
		t.Errorf("no store counters: %+v", p)
	}
}
