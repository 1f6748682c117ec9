package report

import (
	"fmt"
	"math"
	"time"

	"github.com/kettlefleet/kettlefleet/sysstat"
)

// Capacity is a kettle capacity run: the fleet stepped up until the SLO
// broke. The page shows the steps as a chart and the breaking step (or the
// last one) in full.
type Capacity struct {
	Command      string  `json:"command"`
	SLOP99Ms     float64 `json:"slo_p99_ms"`
	MaxErrorRate float64 `json:"max_error_rate"`
	// Holds is the largest step that met the SLO (0: none did).
	Holds int `json:"holds"`
	// BreaksAt is the first step that did not (0: none broke up to the max).
	BreaksAt int    `json:"breaks_at,omitempty"`
	Line     string `json:"line"` // what kettle capacity printed
	// Caveat says what the holding step's figure leaves out: the store's
	// periodic work when none of it fell inside that step's judged seconds.
	Caveat string `json:"caveat,omitempty"`
	Steps  []Step `json:"steps"`
}

// Step is one fleet size, measured after its ramp.
type Step struct {
	Kettles     int     `json:"kettles"`
	OfferedPerS float64 `json:"offered_per_s"`
	DonePerS    float64 `json:"completed_per_s"`
	P50Ms       float64 `json:"p50_ms"`
	P99Ms       float64 `json:"p99_ms"` // worst endpoint, steady state
	ErrorRate   float64 `json:"error_rate"`
	MaxLagMs    float64 `json:"max_lag_ms"`
	Held        bool    `json:"held"`
	Why         string  `json:"why,omitempty"` // why it broke
	Verdict     Verdict `json:"verdict"`
	Results     string  `json:"results,omitempty"` // its results.json
	// Periodic is the store's periodic work inside the judged seconds (nil:
	// the server exported none, or was not scraped).
	Periodic *Periodic `json:"periodic,omitempty"`
}

// Periodic is a store's periodic work inside a step's judged seconds, from
// the server's /metrics: the embedded store's merges of staged rows, or
// PostgreSQL's checkpoints (begun, and the buffers they wrote: one begun
// before the step still writes in it) and the WAL they make heavier
// (full-page images).
// A step shorter than their period may hold none of it, and then its figure
// leaves their cost out.
type Periodic struct {
	Store              string  `json:"store"` // "sqlite" or "postgres"
	JudgedS            float64 `json:"judged_s"`
	Merges             int64   `json:"sqlite_merges,omitempty"`
	Checkpoints        int64   `json:"pg_checkpoints,omitempty"` // begun
	CheckpointBuffers  int64   `json:"pg_checkpoint_buffers,omitempty"`
	WALBytes           int64   `json:"pg_wal_bytes,omitempty"`
	FullPageImages     int64   `json:"pg_wal_fpi,omitempty"`
	CheckpointTimeoutS float64 `json:"pg_checkpoint_timeout_s,omitempty"`
	// New WAL segment files (none ready to recycle: each zero-filled while
	// commits waited); nil where the server does not export the gauges.
	SegmentsCreated *int64 `json:"pg_wal_segments_created,omitempty"`
}

// segmentsCreated is how many new WAL segment files PostgreSQL created
// between two samples: segment switches beyond the files that were ready,
// when none is ready after (otherwise a checkpoint recycled files meanwhile,
// and the count is unknown: taken as none). False without the gauges.
func segmentsCreated(prev, cur *sysstat.ServerGauges) (float64, bool) {
	c, o, r, pr := cur.PGWALSegment, prev.PGWALSegment, cur.PGWALSegmentsReady, prev.PGWALSegmentsReady
	if c == nil || o == nil || r == nil || pr == nil || *c < *o {
		return 0, false
	}
	if *r != 0 {
		return 0, true
	}
	return math.Max(0, *c-*o-*pr), true
}

// PeriodicWork is the store's periodic work between the first and the last
// sample at or after from that carry its counters (nil: none do).
func PeriodicWork(sys *sysstat.Series, from time.Time) *Periodic {
	if sys == nil {
		return nil
	}
	var first, last *sysstat.Sample
	segs, segsKnown := 0.0, false
	for i := range sys.Samples {
		s := &sys.Samples[i]
		if s.Time.Before(from) || s.Server == nil || !s.Server.Up {
			continue
		}
		if g := s.Server; g.SQLiteMerges == nil && g.PGCheckpoints == nil {
			continue
		}
		if first == nil {
			first = s
		} else if n, ok := segmentsCreated(last.Server, s.Server); ok {
			segs, segsKnown = segs+n, true
		}
		last = s
	}
	if first == nil {
		return nil
	}
	a, b := first.Server, last.Server
	diff := func(x, y *float64) int64 {
		if x == nil || y == nil {
			return 0
		}
		return int64(*y - *x)
	}
	p := &Periodic{JudgedS: last.Time.Sub(first.Time).Seconds()}
	if b.PGCheckpoints != nil {
		p.Store = "postgres"
		p.Checkpoints = diff(a.PGCheckpoints, b.PGCheckpoints)
		p.CheckpointBuffers = diff(a.PGCheckpointBuffers, b.PGCheckpointBuffers)
		p.WALBytes = diff(a.PGWALBytes, b.PGWALBytes)
		p.FullPageImages = diff(a.PGWALFullPageImages, b.PGWALFullPageImages)
		if b.PGCheckpointTimeoutS != nil {
			p.CheckpointTimeoutS = *b.PGCheckpointTimeoutS
		}
		if segsKnown {
			n := int64(segs)
			p.SegmentsCreated = &n
		}
	} else {
		p.Store = "sqlite"
		p.Merges = diff(a.SQLiteMerges, b.SQLiteMerges)
	}
	return p
}

// Text is the periodic work in a few words.
func (p *Periodic) Text() string {
	if p == nil {
		return ""
	}
	if p.Store == "postgres" {
		segs := ""
		if p.SegmentsCreated != nil {
			segs = ", " + count(*p.SegmentsCreated, "new WAL segment file")
		}
		return fmt.Sprintf("PostgreSQL: %s begun (checkpoint_timeout %s), %d buffers written by checkpoints, WAL %.0f MiB, %d full-page images%s",
			count(p.Checkpoints, "checkpoint"), time.Duration(p.CheckpointTimeoutS*float64(time.Second)), p.CheckpointBuffers, float64(p.WALBytes)/(1<<20), p.FullPageImages, segs)
	}
	return fmt.Sprintf("SQLite: %s of staged rows", count(p.Merges, "merge"))
}

// count is "1 merge", "2 merges".
func count(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// Caveat says what a figure measured over these seconds leaves out, or "".
func (p *Periodic) Caveat() string {
	switch {
	case p == nil:
		return ""
	case p.Store == "postgres" && p.Checkpoints == 0 && p.CheckpointBuffers == 0:
		return fmt.Sprintf("no PostgreSQL checkpoint fell inside the %.0f s judged (checkpoint_timeout %s), so the figure leaves out their cost: run steps longer than checkpoint_timeout, or lower it",
			p.JudgedS, time.Duration(p.CheckpointTimeoutS*float64(time.Second)))
	case p.Store == "sqlite" && p.Merges == 0:
		return fmt.Sprintf("no merge of the embedded store's staged rows fell inside the %.0f s judged, so the figure leaves out their cost: run longer steps", p.JudgedS)
	}
	return ""
}
