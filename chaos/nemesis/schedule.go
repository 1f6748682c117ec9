// Package nemesis is make chaos's seeded fault schedule, the runner that
// injects and heals it through deploy/cluster.sh's verbs, and the checker
// that judges the run afterwards (Jepsen's nemesis and checker, for the
// topology of deploy/).
//
// The schedule is a pure function of the seed, the run's duration, the
// faults asked for and the topology: the same four give the same faults at
// the same offsets, so a failing run's seed reproduces it.
package nemesis

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Kinds of fault the schedule draws from (the --faults list).
const (
	Partition = "partition" // network partitions: one member isolated, the primary cut off, halves, a bridge, one-way
	Pause     = "pause"     // SIGSTOP … SIGCONT of a member's processes
	Kill      = "kill"      // kill -9 of a member, started again at the heal
	Disk      = "disk"      // a member's data filesystem filled, then freed
	Clock     = "clock"     // a node's clock an hour ahead or behind
	Slow      = "slow"      // a member's link limited by tc tbf
	Toxic     = "toxic"     // latency, jitter or resets on a link by Toxiproxy
)

// Kinds lists every kind in the order the help text shows them.
var Kinds = []string{Partition, Pause, Kill, Disk, Clock, Slow, Toxic}

// Symbolic members, resolved when the fault starts (the primary moves).
const (
	Primary  = "@primary"  // the Patroni leader
	Sync     = "@sync"     // the synchronous standby
	Standbys = "@standbys" // both standbys, comma-separated
)

// Topology is what the schedule may aim at.
type Topology struct {
	Nodes   int  // kettle serve nodes (kettle1…N)
	Log     bool // the readings log: kafka1-3 and the writer run
	Workers bool // the lab's swarm workers run on machines of their own
	// TTL is Patroni's leader ttl: pauses are drawn both shorter and longer.
	TTL time.Duration
}

func (t Topology) nodes() []string {
	var ns []string
	for i := 1; i <= t.Nodes; i++ {
		ns = append(ns, fmt.Sprintf("kettle%d", i))
	}
	return ns
}

var etcds = []string{"etcd1", "etcd2", "etcd3"}

// Fault is one scheduled fault: injected at Start, healed at End (offsets
// from the start of the run).
type Fault struct {
	Kind  string        `json:"kind"`
	Name  string        `json:"name"` // what it is, for a reader
	Start time.Duration `json:"start_ns"`
	End   time.Duration `json:"end_ns"`
	// Inject and Heal are deploy/cluster.sh's arguments; symbolic members
	// (Primary, Sync, Standbys) are resolved at injection and the heal uses
	// the members the injection resolved.
	Inject []string `json:"inject"`
	Heal   []string `json:"heal"`
	// Holds are the resources the fault occupies: two faults that hold the
	// same one never overlap (cluster.sh heal ends every partition at once;
	// a member is not paused and killed at the same time).
	Holds []string `json:"holds"`
}

// Schedule is a run's faults, ordered by Start.
type Schedule struct {
	Seed     uint64        `json:"seed"`
	Duration time.Duration `json:"duration_ns"`
	Kinds    []string      `json:"kinds"`
	Topology Topology      `json:"topology"`
	// HealedBy is when the last fault must be healed: the rest of the run
	// is recovery, so the checker sees a settled system.
	HealedBy time.Duration `json:"healed_by_ns"`
	Faults   []Fault       `json:"faults"`
}

// ParseKinds checks a comma-separated --faults list ("all": every kind).
func ParseKinds(s string) ([]string, error) {
	if s == "all" {
		return slices.Clone(Kinds), nil
	}
	var out []string
	for _, k := range strings.Split(s, ",") {
		k = strings.TrimSpace(k)
		if k == "" {
			continue
		}
		if !slices.Contains(Kinds, k) {
			return nil, fmt.Errorf("--faults: unknown fault %q (one or more of %s, or all)", k, strings.Join(Kinds, ","))
		}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--faults: empty (one or more of %s, or all)", strings.Join(Kinds, ","))
	}
	return out, nil
}

// Warmup and recovery bound the faults inside a run: none in the first
// tenth (at most 30 s: the fleet reaches its steady state first), none in
// the last fifth (at least 30 s, at most 2 min: the cluster catches up,
// standbys rejoin and the swarm's retries land before the audit).
func window(d time.Duration) (from, to time.Duration) {
	from = min(d/10, 30*time.Second)
	rec := max(min(d/5, 2*time.Minute), 30*time.Second)
	return from, d - rec
}

// MaxOverlap is how many faults may be in force at once.
const MaxOverlap = 2

// Generate draws the schedule. It is deterministic: a function of its
// arguments only.
func Generate(seed uint64, d time.Duration, kinds []string, topo Topology) (*Schedule, error) {
	if len(kinds) == 0 {
		return nil, fmt.Errorf("no fault kinds")
	}
	for _, k := range kinds {
		if !slices.Contains(Kinds, k) {
			return nil, fmt.Errorf("unknown fault kind %q", k)
		}
	}
	if topo.TTL <= 0 {
		topo.TTL = 20 * time.Second
	}
	from, to := window(d)
	if to-from < 20*time.Second {
		return nil, fmt.Errorf("--duration %s leaves %s for faults; give at least 90s", d, to-from)
	}
	// The seed and everything else the schedule depends on feed the
	// generator, so a different fault list or topology is a different
	// schedule, still reproducible.
	h := fnv.New64a()
	fmt.Fprintf(h, "%d|%s|%+v", d, strings.Join(kinds, ","), topo)
	rng := rand.New(rand.NewPCG(seed, h.Sum64()))
	s := &Schedule{Seed: seed, Duration: d, Kinds: slices.Clone(kinds), Topology: topo, HealedBy: to}

	t := from
	for tries := 0; to-t >= 5*time.Second && tries < 1000; tries++ {
		kind := kinds[rng.IntN(len(kinds))]
		f, ok := draw(rng, kind, topo)
		if !ok {
			continue
		}
		f.Start = t
		f.End = min(t+f.End, to)
		if !s.fits(f) {
			// It would clash with a fault still in force: after the
			// earliest of those ends.
			t = s.nextFree(t)
			continue
		}
		s.Faults = append(s.Faults, f)
		if rng.Float64() < 0.35 {
			// The next fault starts while this one is in force.
			t += time.Duration(rng.Int64N(int64(f.End-f.Start)))/time.Second*time.Second + time.Second
		} else {
			t = f.End + time.Duration(5+rng.IntN(16))*time.Second
		}
	}
	slices.SortStableFunc(s.Faults, func(a, b Fault) int { return int(a.Start - b.Start) })
	return s, nil
}

// fits reports whether f may start: fewer than MaxOverlap faults in force
// at its start and none holding what it holds during its span.
func (s *Schedule) fits(f Fault) bool {
	n := 0
	for _, g := range s.Faults {
		if g.Start < f.End && f.Start < g.End {
			if g.Start <= f.Start && f.Start < g.End {
				n++
			}
			for _, r := range f.Holds {
				if slices.Contains(g.Holds, r) {
					return false
				}
			}
		}
	}
	return n < MaxOverlap
}

// nextFree is the earliest end after t of the faults in force at t.
func (s *Schedule) nextFree(t time.Duration) time.Duration {
	next := t + time.Second
	first := true
	for _, g := range s.Faults {
		if g.End > t && (first || g.End < next) {
			next, first = g.End, false
		}
	}
	return next
}

func pick[T any](rng *rand.Rand, xs []T) T { return xs[rng.IntN(len(xs))] }

func secs(rng *rand.Rand, lo, hi int) time.Duration {
	return time.Duration(lo+rng.IntN(hi-lo+1)) * time.Second
}

// draw is one fault of kind; its End holds its length until placed.
func draw(rng *rand.Rand, kind string, topo Topology) (Fault, bool) {
	nodes := topo.nodes()
	// pg holds every database member: a symbolic target may be any of them.
	const pg = "pg"
	switch kind {
	case Partition:
		members := append(append(slices.Clone(etcds), "pg1", "pg2", "pg3"), nodes...)
		f := Fault{Kind: Partition, End: secs(rng, 10, 40), Holds: []string{"net"}}
		switch shape := rng.IntN(5); shape {
		case 0: // one member isolated
			m := pick(rng, append(append(slices.Clone(etcds), Primary, Sync), nodes...))
			f.Name, f.Inject, f.Heal = "isolate "+m, []string{"isolate", m}, []string{"unisolate", m}
		case 1: // the primary cut from etcd and its standbys; the nodes still reach it
			f.Name = "primary cut from etcd and both standbys (nodes still reach it)"
			f.Inject = []string{"partition", Primary, strings.Join(etcds, ",") + "," + Standbys}
			f.Heal = []string{"unpartition", Primary, strings.Join(etcds, ",") + "," + Standbys}
		case 2, 3: // halves, or halves with one member seeing both (a bridge)
			rest := slices.Clone(members)
			rng.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
			var bridge string
			if shape == 3 {
				bridge, rest = rest[0], rest[1:]
			}
			cut := len(rest) / 2
			a, b := slices.Clone(rest[:cut]), slices.Clone(rest[cut:])
			slices.Sort(a)
			slices.Sort(b)
			f.Name = fmt.Sprintf("halves %s | %s", strings.Join(a, ","), strings.Join(b, ","))
			if bridge != "" {
				f.Name += " (" + bridge + " sees both)"
			}
			f.Inject = []string{"partition", strings.Join(a, ","), strings.Join(b, ",")}
			f.Heal = []string{"unpartition", strings.Join(a, ","), strings.Join(b, ",")}
		case 4: // one way
			from := pick(rng, append([]string{Primary}, nodes...))
			to := pick(rng, append(slices.Clone(etcds), Sync))
			f.Name = fmt.Sprintf("one-way: %s cannot reach %s", from, to)
			f.Inject = []string{"partition-oneway", from, to}
			f.Heal = []string{"unpartition-oneway", from, to}
		}
		return f, true
	case Pause:
		// Shorter and longer than Patroni's ttl: a blip, and a stale leader.
		ttl := int(topo.TTL / time.Second)
		d := secs(rng, 5, max(ttl/2, 6))
		if rng.IntN(2) == 1 {
			d = secs(rng, ttl+5, ttl+20)
		}
		m := pick(rng, append([]string{Primary, Sync}, nodes...))
		hold := m
		if strings.HasPrefix(m, "@") {
			hold = pg
		}
		return Fault{Kind: Pause, Name: fmt.Sprintf("pause %s %s", m, d), End: d, Inject: []string{"pause", m}, Heal: []string{"resume", m}, Holds: []string{hold}}, true
	case Kill:
		ms := append([]string{Primary, Sync, pick(rng, etcds)}, nodes...)
		if topo.Log {
			ms = append(ms, pick(rng, []string{"kafka1", "kafka2", "kafka3"}), "writer")
		}
		m := pick(rng, ms)
		hold := m
		if strings.HasPrefix(m, "@") {
			hold = pg
		}
		return Fault{Kind: Kill, Name: "kill -9 " + m, End: secs(rng, 5, 30), Inject: []string{"kill", m}, Heal: []string{"start", m}, Holds: []string{hold}}, true
	case Disk:
		ms := []string{Primary}
		if topo.Log {
			ms = append(ms, pick(rng, []string{"kafka1", "kafka2", "kafka3"}))
		}
		m := pick(rng, ms)
		hold := m
		if m == Primary {
			hold = pg
		}
		what := "the primary's WAL disk full"
		if m != Primary {
			what = m + "'s log disk full"
		}
		return Fault{Kind: Disk, Name: what, End: secs(rng, 10, 30), Inject: []string{"fill-disk", m}, Heal: []string{"free-disk", m}, Holds: []string{hold, "disk"}}, true
	case Clock:
		if len(nodes) == 0 {
			return Fault{}, false
		}
		m := pick(rng, nodes)
		jump := pick(rng, []string{"+1h", "-1h"})
		return Fault{Kind: Clock, Name: fmt.Sprintf("%s's clock %s", m, jump), End: secs(rng, 20, 45), Inject: []string{"clock", m, jump}, Heal: []string{"clock", m, "0"}, Holds: []string{m}}, true
	case Slow:
		m := pick(rng, append([]string{Primary, Sync, "haproxy"}, nodes...))
		rate := pick(rng, []string{"1mbit", "256kbit"})
		hold := "tbf:" + m
		return Fault{Kind: Slow, Name: fmt.Sprintf("%s's link at %s", m, rate), End: secs(rng, 10, 30), Inject: []string{"slow", m, rate}, Heal: []string{"unslow", m}, Holds: []string{hold}}, true
	case Toxic:
		// cluster.sh's links: lb (balancer→node), db (node→database),
		// repl (database→database), kafka (front→Kafka).
		links := []string{"lb", "db", "repl"}
		if topo.Log {
			links = append(links, "kafka")
		}
		link := pick(rng, links)
		f := Fault{Kind: Toxic, End: secs(rng, 10, 30), Heal: []string{"untoxic", link}, Holds: []string{"toxic:" + link}}
		if rng.IntN(3) == 0 {
			f.Name, f.Inject = link+": connections reset", []string{"toxic", link, "reset"}
		} else {
			ms, jit := 50+rng.IntN(400), 10+rng.IntN(100)
			f.Name = fmt.Sprintf("%s: +%d ms ± %d ms", link, ms, jit)
			f.Inject = []string{"toxic", link, "latency", fmt.Sprint(ms), fmt.Sprint(jit)}
		}
		return f, true
	}
	return Fault{}, false
}

// String is the schedule as printed before the run starts.
func (s *Schedule) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "nemesis schedule: seed %d, duration %s, faults %s, %d kettle nodes, log %v; every fault healed by +%s\n",
		s.Seed, s.Duration, strings.Join(s.Kinds, ","), s.Topology.Nodes, s.Topology.Log, clock(s.HealedBy))
	for _, f := range s.Faults {
		fmt.Fprintf(&b, "  +%s → +%s  %-9s %s  [cluster.sh %s; heal: %s]\n", clock(f.Start), clock(f.End), f.Kind, f.Name,
			strings.Join(f.Inject, " "), strings.Join(f.Heal, " "))
	}
	return b.String()
}

func clock(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%02d:%02d", int(d/time.Minute), int(d%time.Minute/time.Second))
}
