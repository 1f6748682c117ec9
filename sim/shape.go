package sim

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/kettlefleet/kettlefleet"
)

// Stage is one point of a load shape (kettle swarm --stages): the fleet
// reaches Target kettles Duration after the previous point, linearly in
// between; the shape starts from no kettle at the run's start. A stage of
// duration 0 is a step: its kettles join (or leave) at one instant.
type Stage struct {
	Duration time.Duration `json:"duration_ns"`
	Target   int           `json:"target"`
}

// maxStages bounds a shape (a lab worker's plan carries it).
const maxStages = 1000

// Rollout switches a share of the fleet to another batch size mid-run (a
// firmware rollout): kettle g switches at At + u×Over, u its own uniform
// draw, if u < Share.
type Rollout struct {
	At    time.Duration `json:"at_ns"`
	Over  time.Duration `json:"over_ns"`
	Share float64       `json:"share"` // of the fleet, 0..1
	Batch int           `json:"batch"` // readings per upload once switched
}

// StageMark is a stage as recorded in Params: the fleet goes from From to
// To kettles between StartS and EndS (seconds since the start); the report
// marks each on its time series.
type StageMark struct {
	StartS float64 `json:"start_s"`
	EndS   float64 `json:"end_s"`
	From   int     `json:"from"`
	To     int     `json:"to"`
}

// RolloutMark is a rollout as recorded in Params.
type RolloutMark struct {
	StartS float64 `json:"start_s"`
	EndS   float64 `json:"end_s"`
	Share  float64 `json:"share"`
	Batch  int     `json:"batch"`
}

// ParseStages reads --stages: DURATION:TARGET,… (e.g. 2m:20000,5m:20000);
// a target may be a percentage of base ("30%"), for a shape that scales
// with --devices.
func ParseStages(s string, base int) ([]Stage, error) {
	var out []Stage
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		d, t, ok := strings.Cut(p, ":")
		if !ok {
			return nil, fmt.Errorf("--stages %q: want DURATION:KETTLES,… (e.g. 2m:20000,5m:20000), got %q", s, p)
		}
		dur, err := time.ParseDuration(strings.TrimSpace(d))
		if err != nil {
			return nil, fmt.Errorf("--stages %q: stage %q: duration: %w", s, p, err)
		}
		n, err := ParseTarget(t, base)
		if err != nil {
			return nil, fmt.Errorf("--stages %q: stage %q: %w", s, p, err)
		}
		out = append(out, Stage{Duration: dur, Target: n})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--stages %q: want at least one DURATION:KETTLES", s)
	}
	return out, nil
}

// ParseTarget reads a stage's fleet size: a number of kettles, or a
// percentage of base.
func ParseTarget(t string, base int) (int, error) {
	t = strings.TrimSpace(t)
	if p, ok := strings.CutSuffix(t, "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || f < 0 || math.IsInf(f, 0) {
			return 0, fmt.Errorf("target %q: want a number of kettles or a percentage ≥ 0", t)
		}
		return int(math.Round(f / 100 * float64(base))), nil
	}
	n, err := strconv.Atoi(t)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("target %q: want a number of kettles ≥ 0 or a percentage", t)
	}
	return n, nil
}

// StagesDuration is how long the stages last in all.
func StagesDuration(st []Stage) time.Duration {
	var d time.Duration
	for _, s := range st {
		d += s.Duration
	}
	return d
}

// StagesPeak is the largest fleet the stages reach.
func StagesPeak(st []Stage) int {
	n := 0
	for _, s := range st {
		n = max(n, s.Target)
	}
	return n
}

// validateShape names the problems of Stages and Rollout.
func (c *Config) validateShape() []error {
	var errs []error
	add := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if len(c.Stages) > 0 {
		if c.HatchRate > 0 {
			add("--hatch-rate %g with --stages: the stages say when kettles join; drop --hatch-rate", c.HatchRate)
		}
		if len(c.Stages) > maxStages {
			add("--stages: %d stages, want at most %d", len(c.Stages), maxStages)
		}
		for i, s := range c.Stages {
			if s.Duration < 0 || s.Target < 0 {
				add("--stages: stage %d (%s:%d): want a duration ≥ 0 and a target ≥ 0", i+1, s.Duration, s.Target)
			}
		}
		if d := StagesDuration(c.Stages); d <= 0 {
			add("--stages: the stages last 0 s; give at least one a duration")
		} else if c.Duration > 0 && c.Duration < d {
			add("--duration %s is shorter than the stages (%s): drop --duration, or make it at least that (the fleet then holds the last stage's size)", c.Duration, d)
		}
		if StagesPeak(c.Stages) == 0 {
			add("--stages: no stage has a kettle")
		}
	}
	if r := c.Rollout; r != nil {
		if c.API == "v0" {
			add("rollout: the case-study protocol (--api v0) uploads one reading per request; a batched rollout needs v1")
		}
		if r.Share <= 0 || r.Share > 1 {
			add("rollout: share %g: want a fraction of the fleet in (0, 1]", r.Share)
		}
		if r.Batch < 1 || r.Batch > kettle.MaxBatch {
			add("rollout: batch %d: want 1..%d", r.Batch, kettle.MaxBatch)
		}
		if r.At < 0 || r.Over < 0 {
			add("rollout: at %s over %s: want durations ≥ 0", r.At, r.Over)
		}
	}
	return errs
}

// shape is the fleet size over time, N(t), as points joined by lines.
// Kettle g (its index in the fleet) is in the fleet while N(t) > g: kettles
// join in index order as the fleet grows and leave the last-joined first
// as it shrinks.
type shape struct {
	t []int64   // ns since start; t[0] = 0
	n []float64 // fleet size at t[j]; n[0] = 0
}

func newShape(st []Stage) *shape {
	sh := &shape{t: []int64{0}, n: []float64{0}}
	var at int64
	for _, s := range st {
		at += int64(s.Duration)
		sh.t = append(sh.t, at)
		sh.n = append(sh.n, float64(s.Target))
	}
	return sh
}

// How a kettle joins.
const (
	joinSpread = iota // at the start, a step: its phase is its own (as --hatch-rate 0)
	joinRamp          // on a ramp: it sends now and every interval from now (as a hatch)
	joinStep          // in a step after the start: it sends now, with every other kettle of the step
)

// nextJoin is the first time ≥ from at which kettle g joins, and how; ok
// is false when it never does. g is out of the fleet just before from.
func (sh *shape) nextJoin(g int, from int64) (at int64, how int, ok bool) {
	x := float64(g)
	for j := 0; j+1 < len(sh.t); j++ {
		t0, t1, n0, n1 := sh.t[j], sh.t[j+1], sh.n[j], sh.n[j+1]
		if t1 < from {
			continue
		}
		switch {
		case t1 == t0: // a step
			if t0 >= from && n0 <= x && n1 > x {
				if t0 == 0 {
					return 0, joinSpread, true
				}
				return t0, joinStep, true
			}
		case n1 > n0 && n0 <= x && x < n1: // a ramp up crossing g
			// A crossing before from (rounding) means g is in the fleet by then.
			at := t0 + int64((x-n0)/(n1-n0)*float64(t1-t0))
			return max(at, from), joinRamp, true
		}
	}
	return 0, 0, false
}

// nextLeave is the first time > from at which kettle g, in the fleet at
// from, leaves it; ok is false when it stays to the end.
func (sh *shape) nextLeave(g int, from int64) (at int64, ok bool) {
	x := float64(g)
	for j := 0; j+1 < len(sh.t); j++ {
		t0, t1, n0, n1 := sh.t[j], sh.t[j+1], sh.n[j], sh.n[j+1]
		if t1 <= from {
			continue
		}
		switch {
		case t1 == t0:
			if n0 > x && n1 <= x {
				return t0, true
			}
		case n1 < n0 && n1 <= x && x < n0: // a ramp down crossing g
			at := t0 + int64((n0-x)/(n0-n1)*float64(t1-t0))
			return max(at, from+1), true
		}
	}
	return 0, false
}

// at is N(t), right-continuous at a step; after the last point, the last
// size.
func (sh *shape) at(t int64) float64 {
	last := len(sh.t) - 1
	if t >= sh.t[last] {
		return sh.n[last]
	}
	for j := last - 1; j >= 0; j-- {
		if t >= sh.t[j] {
			t0, t1 := sh.t[j], sh.t[j+1]
			if t1 == t0 {
				return sh.n[j+1]
			}
			return sh.n[j] + (sh.n[j+1]-sh.n[j])*float64(t-t0)/float64(t1-t0)
		}
	}
	return sh.n[0]
}

// marks are the stages as Params records them.
func stageMarks(st []Stage) []StageMark {
	var out []StageMark
	var at time.Duration
	from := 0
	for _, s := range st {
		out = append(out, StageMark{StartS: at.Seconds(), EndS: (at + s.Duration).Seconds(), From: from, To: s.Target})
		at += s.Duration
		from = s.Target
	}
	return out
}

func rolloutMark(r *Rollout) *RolloutMark {
	if r == nil {
		return nil
	}
	return &RolloutMark{StartS: r.At.Seconds(), EndS: (r.At + r.Over).Seconds(), Share: r.Share, Batch: r.Batch}
}

// Events of a shaped fleet (besides the transports' own).
const (
	evJoin  = 4
	evLeave = 5
)

// unitDraw is kettle g's own uniform draw in [0, 1) for the rollout: a
// hash of the seed and g, so that every worker of a lab draws the same.
func unitDraw(seed uint64, g int) float64 {
	z := seed ^ (uint64(g)+1)*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	return float64(z>>11) / (1 << 53)
}

// batch is how many readings kettle i buffers before an upload at ns:
// Config.Batch, or the rollout's once the kettle switched.
func (s *Swarm) batch(i int, ns int64) int {
	r := s.cfg.Rollout
	if r == nil {
		return s.cfg.Batch
	}
	u := unitDraw(s.cfg.Seed, s.fleetIndex(i))
	if u >= r.Share || ns < int64(r.At)+int64(u/r.Share*float64(r.Over)) {
		return s.cfg.Batch
	}
	return r.Batch
}

// shapeSetup schedules every kettle's first join (a shaped fleet).
func (s *Swarm) shapeSetup() {
	iv := int64(s.cfg.Interval)
	for i := range s.kettles {
		k := &s.kettles[i]
		// The kettle's own phase, for joins that do not set it (spread).
		k.phase = int64(k.rng.Float64() * float64(iv))
		if at, _, ok := s.shape.nextJoin(s.fleetIndex(i), 0); ok && at < s.endAt {
			s.heap.Push(event{at: at, k: int32(i), kind: evJoin})
		}
	}
}

// shapeFire handles the join and leave events of a shaped fleet and drops
// what a kettle out of the fleet would have done (its ticks, retries,
// reconnections); it reports whether ev goes on to the transport. Only the
// dispatcher reads and writes a kettle's active and gen.
func (s *Swarm) shapeFire(ev event, next *[]event) bool {
	k := &s.kettles[ev.k]
	i := int(ev.k)
	switch ev.kind {
	case evJoin:
		g := s.fleetIndex(i)
		_, how, _ := s.shape.nextJoin(g, ev.at)
		k.active = true
		k.gen++
		s.hatched.Add(1)
		iv := int64(s.cfg.Interval)
		first := ev.at
		k.mu.Lock()
		switch how {
		case joinRamp:
			k.phase, k.ticks = ev.at, 0
		case joinSpread:
			k.ticks = 0
			first = k.phase
		case joinStep:
			// It sends now, then on its own phase again.
			k.ticks = int32(math.Floor(float64(ev.at-k.phase) / float64(iv)))
		}
		k.mu.Unlock()
		if how == joinStep {
			s.tr.join(i, k, ev.at)
		}
		*next = append(*next, event{at: first, k: ev.k, gen: k.gen})
		if at, ok := s.shape.nextLeave(g, ev.at); ok && at < s.endAt {
			*next = append(*next, event{at: at, k: ev.k, kind: evLeave, gen: k.gen})
		}
		return false
	case evLeave:
		if !k.active || ev.gen != k.gen {
			return false
		}
		k.active = false
		s.hatched.Add(-1)
		s.tr.leave(i, k)
		if at, _, ok := s.shape.nextJoin(s.fleetIndex(i), ev.at); ok && at < s.endAt {
			*next = append(*next, event{at: at, k: ev.k, kind: evJoin})
		}
		return false
	case evTick:
		return k.active && ev.gen == k.gen
	default:
		return k.active
	}
}

// join is a kettle coming back in a step (a power cut's end): an HTTP
// kettle needs nothing more (it dials and, v0, logs in on its first send).
func (s *httpTransport) join(int, *kettleState, int64) {}

// leave is a kettle leaving the fleet (switched off, a power cut): its
// connection closes, so that it dials again when it comes back, and a v0
// kettle logs in again. Its buffered readings stay buffered; an exchange
// in flight runs to its end.
func (s *httpTransport) leave(i int, k *kettleState) {
	k.mu.Lock()
	k.loggedIn = false
	k.owed = work{}
	k.mu.Unlock()
	if s.pool.perDevice == nil || len(s.pool.perDevice) < s.cfg.Devices {
		return // shared connections, or a slot shared with other kettles
	}
	ch := s.pool.ch(i)
	select {
	case sl := <-ch:
		s.pool.discard(sl)
		ch <- sl
	default: // in use: it closes when the kettle's exchange ends (release)
		k.mu.Lock()
		k.dropConn = true
		k.mu.Unlock()
	}
}

// release gives kettle i's own connection back after an exchange, closed
// if the kettle left the fleet meanwhile.
func (s *httpTransport) release(i int, k *kettleState, sl *slot) {
	k.mu.Lock()
	if k.dropConn {
		k.dropConn = false
		if len(s.pool.perDevice) >= s.cfg.Devices {
			s.pool.discard(sl)
		}
	}
	k.mu.Unlock()
	s.pool.put(i, sl)
}

// join connects an MQTT kettle that comes back in a step, at once (the
// reconnect storm after a power cut).
func (s *mqttTransport) join(i int, k *kettleState, at int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.mq.state == mqDown {
		k.mq.attempts = 0
		s.startConnect(i, k, at)
	}
}

// leave disconnects an MQTT kettle leaving the fleet: publishes awaiting
// their PUBACK go back to the buffer unjudged (the kettle is off: it never
// learns their fate), and nothing reconnects until it joins again.
func (s *mqttTransport) leave(i int, k *kettleState) {
	k.mu.Lock()
	defer k.mu.Unlock()
	m := k.mq
	if c := m.c; c != nil {
		if m.state == mqUp {
			s.mqWrite(k, c, mqDisconnect)
		}
		c.kill()
	}
	m.gen++
	m.state, m.c = mqDown, nil
	m.pingAt, m.checkAt, m.owedAt = 0, 0, -1
	for j := range m.inflight {
		s.busy.Add(-1)
		s.pubFailed(i, k, m.inflight[j].batch, false)
		m.inflight[j] = mqPub{}
	}
	m.inflight = m.inflight[:0]
}

var mqDisconnect = mqEncode(nil, packets.NewControlPacket(packets.DISCONNECT))
