package nemesis

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

var topo3 = Topology{Nodes: 2, Log: true, TTL: 20 * time.Second}

func TestScheduleIsAFunctionOfTheSeed(t *testing.T) {
	gen := func(seed uint64, d time.Duration, kinds []string, tp Topology) *Schedule {
		t.Helper()
		s, err := Generate(seed, d, kinds, tp)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b := gen(7, 10*time.Minute, Kinds, topo3), gen(7, 10*time.Minute, Kinds, topo3)
	if !reflect.DeepEqual(a, b) || a.String() != b.String() {
		t.Errorf("seed 7 twice gave two schedules:\n%s\n%s", a, b)
	}
	if c := gen(8, 10*time.Minute, Kinds, topo3); c.String() == a.String() {
		t.Errorf("seeds 7 and 8 gave the same schedule:\n%s", a)
	}
	if c := gen(7, 10*time.Minute, []string{Kill, Pause}, topo3); c.String() == a.String() {
		t.Errorf("another fault list gave the same schedule")
	}
	// Every seed: faults of the kinds asked for, each healed before the
	// recovery, no more than MaxOverlap at once, none sharing what it holds
	// with one in force.
	for seed := uint64(0); seed < 200; seed++ {
		for _, d := range []time.Duration{2 * time.Minute, 10 * time.Minute} {
			s := gen(seed, d, Kinds, topo3)
			check(t, s)
		}
	}
	s := gen(1, 10*time.Minute, []string{Pause}, topo3)
	var short, long bool
	for seed := uint64(0); seed < 20; seed++ {
		for _, f := range gen(seed, 10*time.Minute, []string{Pause}, topo3).Faults {
			short = short || f.End-f.Start < topo3.TTL
			long = long || f.End-f.Start > topo3.TTL
		}
	}
	if !short || !long {
		t.Errorf("pauses: want some shorter and some longer than the ttl %s (short %v, long %v)\n%s", topo3.TTL, short, long, s)
	}
}

func check(t *testing.T, s *Schedule) {
	t.Helper()
	if len(s.Faults) == 0 {
		t.Fatalf("seed %d: no faults\n%s", s.Seed, s)
	}
	kinds := map[string]bool{}
	for i, f := range s.Faults {
		kinds[f.Kind] = true
		if !slices.Contains(s.Kinds, f.Kind) {
			t.Errorf("seed %d: fault %q of a kind not asked for", s.Seed, f.Name)
		}
		if f.Start < 0 || f.End <= f.Start || f.End > s.HealedBy || s.HealedBy >= s.Duration {
			t.Errorf("seed %d: fault %q %s→%s not healed by %s of %s", s.Seed, f.Name, f.Start, f.End, s.HealedBy, s.Duration)
		}
		if len(f.Heal) == 0 || len(f.Inject) == 0 {
			t.Errorf("seed %d: fault %q has no inject or heal verb", s.Seed, f.Name)
		}
		in := 1
		for j, g := range s.Faults {
			if j == i || g.End <= f.Start || f.End <= g.Start {
				continue
			}
			if g.Start <= f.Start {
				in++
			}
			for _, h := range f.Holds {
				if slices.Contains(g.Holds, h) {
					t.Errorf("seed %d: %q and %q overlap and both hold %s\n%s", s.Seed, f.Name, g.Name, h, s)
				}
			}
		}
		if in > MaxOverlap {
			t.Errorf("seed %d: %d faults in force when %q starts", s.Seed, in, f.Name)
		}
	}
	if s.Duration >= 10*time.Minute && len(kinds) < 3 {
		t.Errorf("seed %d: 10 minutes drew only %v", s.Seed, kinds)
	}
}

func TestScheduleOverlaps(t *testing.T) {
	overlapping := 0
	for seed := uint64(0); seed < 20; seed++ {
		s, _ := Generate(seed, 10*time.Minute, Kinds, topo3)
		for i := 1; i < len(s.Faults); i++ {
			if s.Faults[i].Start < s.Faults[i-1].End {
				overlapping++
			}
		}
	}
	if overlapping == 0 {
		t.Error("20 seeds of 10 minutes: no two faults ever in force together")
	}
}

func TestGenerateRefuses(t *testing.T) {
	f := func(d time.Duration, kinds []string, want string) {
		t.Helper()
		_, err := Generate(1, d, kinds, topo3)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Generate(%s, %v) = %v; want an error with %q", d, kinds, err, want)
		}
	}
	f(30*time.Second, Kinds, "at least 90s")
	f(time.Minute, []string{"flood"}, "unknown fault kind")
	f(time.Minute, nil, "no fault kinds")
	if _, err := ParseKinds("kill,partition,meteor"); err == nil || !strings.Contains(err.Error(), `"meteor"`) {
		t.Errorf("ParseKinds: %v", err)
	}
	if k, err := ParseKinds("all"); err != nil || len(k) != len(Kinds) {
		t.Errorf("ParseKinds(all) = %v, %v", k, err)
	}
}

// recorder is an Actor that logs each verb with the fake clock's offset.
type recorder struct {
	mu      sync.Mutex
	start   time.Time
	log     []string
	primary string
	fail    string // a verb that fails
}

func (r *recorder) Do(ctx context.Context, args ...string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.log = append(r.log, fmt.Sprintf("%s %s", time.Since(r.start), strings.Join(args, " ")))
	if len(args) > 0 && args[0] == r.fail {
		return fmt.Errorf("%s: not supported", args[0])
	}
	if args[0] == "kill" && args[1] == r.primary {
		r.primary = "pg2" // a failover: the heal must still start pg1
	}
	return nil
}

func (r *recorder) Resolve(ctx context.Context, sym string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch sym {
	case Primary:
		return []string{r.primary}, nil
	case Standbys:
		return []string{"pg2", "pg3"}, nil
	}
	return []string{"pg3"}, nil
}

func sched(faults ...Fault) *Schedule {
	return &Schedule{Duration: time.Minute, HealedBy: 50 * time.Second, Faults: faults}
}

func TestRunInjectsAndHealsOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := &recorder{start: time.Now(), primary: "pg1"}
		s := sched(
			Fault{Kind: Kill, Name: "kill primary", Start: 2 * time.Second, End: 10 * time.Second, Inject: []string{"kill", Primary}, Heal: []string{"start", Primary}},
			Fault{Kind: Partition, Name: "cut", Start: 5 * time.Second, End: 10 * time.Second, Inject: []string{"partition", Primary, "etcd1," + Standbys}, Heal: []string{"unpartition", Primary, "etcd1," + Standbys}},
		)
		iv := Run(t.Context(), s, r.start, r, t.Logf)
		want := []string{"2s kill pg1", "5s partition pg2 etcd1,pg2,pg3", "10s start pg1", "10s unpartition pg2 etcd1,pg2,pg3"}
		slices.Sort(r.log) // faults run side by side: the order within a second is free
		slices.Sort(want)
		if !slices.Equal(r.log, want) {
			t.Errorf("verbs:\n%s\nwant\n%s", strings.Join(r.log, "\n"), strings.Join(want, "\n"))
		}
		if len(iv) != 2 || iv[0].Start.Sub(r.start) != 2*time.Second || iv[0].End.Sub(r.start) != 10*time.Second || iv[1].Err != "" {
			t.Errorf("intervals: %+v", iv)
		}
	})
}

func TestRunHealsOnCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := &recorder{start: time.Now(), primary: "pg1", fail: "pause"}
		s := sched(
			Fault{Kind: Kill, Name: "kill etcd2", Start: time.Second, End: 30 * time.Second, Inject: []string{"kill", "etcd2"}, Heal: []string{"start", "etcd2"}},
			Fault{Kind: Pause, Name: "pause primary", Start: 2 * time.Second, End: 30 * time.Second, Inject: []string{"pause", Primary}, Heal: []string{"resume", Primary}},
			Fault{Kind: Disk, Name: "later", Start: 40 * time.Second, End: 45 * time.Second, Inject: []string{"fill-disk", Primary}, Heal: []string{"free-disk", Primary}},
		)
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(5*time.Second, cancel) // Ctrl-C
		iv := Run(ctx, s, r.start, r, t.Logf)
		// Both in force are healed at the cancel, the one that failed to
		// inject too (it may have done half its work), the later one never starts.
		want := []string{"1s kill etcd2", "2s pause pg1", "5s resume pg1", "5s start etcd2"}
		slices.Sort(r.log)
		slices.Sort(want)
		if !slices.Equal(r.log, want) {
			t.Errorf("verbs:\n%s\nwant\n%s", strings.Join(r.log, "\n"), strings.Join(want, "\n"))
		}
		if !strings.Contains(iv[1].Err, "pause pg1: pause: not supported") {
			t.Errorf("the failed injection is not reported: %+v", iv[1])
		}
		if !iv[2].Start.IsZero() {
			t.Errorf("a fault after the cancel started: %+v", iv[2])
		}
	})
}

func TestRunGeneratedScheduleEndsHealed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := Generate(42, 3*time.Minute, Kinds, topo3)
		if err != nil {
			t.Fatal(err)
		}
		r := &recorder{start: time.Now(), primary: "pg1"}
		iv := Run(t.Context(), s, r.start, r, func(string, ...any) {})
		if got := time.Since(r.start); got > s.HealedBy {
			t.Errorf("Run returned at %s, after HealedBy %s", got, s.HealedBy)
		}
		if len(r.log) != 2*len(s.Faults) {
			// (a heal that fails is retried: the recorder fails none here)
			t.Errorf("%d verbs for %d faults:\n%s", len(r.log), len(s.Faults), strings.Join(r.log, "\n"))
		}
		for _, v := range iv {
			if v.End.IsZero() || v.End.Before(v.Start) || len(v.Heal) == 0 {
				t.Errorf("fault not healed: %+v", v)
			}
		}
	})
}

// flaky fails its first heal, as cluster.sh start does for a node that is
// not ready within its wait.
type flaky struct {
	recorder
	failed bool
}

func (f *flaky) Do(ctx context.Context, args ...string) error {
	f.recorder.Do(ctx, args...)
	if args[0] == "start" && !f.failed {
		f.failed = true
		return fmt.Errorf("kettle2: not within 60s")
	}
	return nil
}

func TestRunRetriesAHealAndKeepsOthersOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := &flaky{recorder: recorder{start: time.Now()}}
		s := sched(
			Fault{Kind: Kill, Name: "kill kettle2", Start: time.Second, End: 10 * time.Second, Inject: []string{"kill", "kettle2"}, Heal: []string{"start", "kettle2"}},
			Fault{Kind: Pause, Name: "pause kettle1", Start: 12 * time.Second, End: 20 * time.Second, Inject: []string{"pause", "kettle1"}, Heal: []string{"resume", "kettle1"}},
		)
		iv := Run(t.Context(), s, r.start, r, t.Logf)
		want := []string{"1s kill kettle2", "10s start kettle2", "12s pause kettle1", "15s start kettle2", "20s resume kettle1"}
		slices.Sort(r.log)
		slices.Sort(want)
		if !slices.Equal(r.log, want) {
			t.Errorf("verbs:\n%s\nwant\n%s", strings.Join(r.log, "\n"), strings.Join(want, "\n"))
		}
		if iv[0].Err != "" || iv[0].End.Sub(r.start) != 15*time.Second || iv[1].Start.Sub(r.start) != 12*time.Second {
			t.Errorf("intervals: %+v", iv)
		}
	})
}
