package nemesis

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// Actor carries out deploy/cluster.sh's verbs (in tests: a recorder).
type Actor interface {
	// Do runs one verb with its arguments.
	Do(ctx context.Context, args ...string) error
	// Resolve names the members behind a symbolic one (Primary, Sync,
	// Standbys), now.
	Resolve(ctx context.Context, symbol string) ([]string, error)
}

// Interval is one fault as it happened, in wall-clock time: what the
// report draws as a band and the checker charges the kettles' costs to.
type Interval struct {
	Kind  string    `json:"kind"`
	Name  string    `json:"name"`
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
	// Inject and Heal are the verbs as run, symbols resolved.
	Inject []string `json:"inject"`
	Heal   []string `json:"heal,omitempty"`
	// Err says why the fault was not injected or not healed ("": it was).
	Err string `json:"err,omitempty"`
}

// HealTimeout bounds each heal, also the ones run after a cancel.
const HealTimeout = 3 * time.Minute

// Run carries out the schedule from start (the run's time zero): each
// fault injected at its Start and healed at its End. It returns when every
// fault it injected is healed — at the schedule's end, or at once when ctx
// is cancelled (Ctrl-C, a failed part): a fault never outlives Run.
// logf narrates each step.
func Run(ctx context.Context, s *Schedule, start time.Time, a Actor, logf func(string, ...any)) []Interval {
	type step struct {
		at   time.Duration
		i    int
		heal bool
	}
	var steps []step
	for i, f := range s.Faults {
		steps = append(steps, step{f.Start, i, false}, step{f.End, i, true})
	}
	// Heals first at a tie: a fault ending when another starts frees what
	// they both hold.
	slices.SortStableFunc(steps, func(x, y step) int {
		if x.at != y.at {
			return int(x.at - y.at)
		}
		if x.heal != y.heal {
			if x.heal {
				return -1
			}
			return 1
		}
		return x.i - y.i
	})
	out := make([]Interval, len(s.Faults))
	active := map[int]bool{}
	var mu sync.Mutex
	heal := func(i int) {
		f := s.Faults[i]
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), HealTimeout)
		defer cancel()
		args := resolveAs(f.Heal, f.Inject, out[i].Inject)
		out[i].Heal = args
		if err := a.Do(hctx, args...); err != nil {
			out[i].Err = appendErr(out[i].Err, fmt.Sprintf("heal %s: %v", strings.Join(args, " "), err))
			logf("nemesis: heal %q failed: %v", f.Name, err)
		}
		out[i].End = time.Now()
		mu.Lock()
		delete(active, i)
		mu.Unlock()
		logf("nemesis: healed %s (%s)", f.Name, strings.Join(args, " "))
	}
	defer func() {
		// Whatever is still in force when Run leaves (cancel, panic) is
		// healed, last injected first.
		mu.Lock()
		var left []int
		for i := range active {
			left = append(left, i)
		}
		mu.Unlock()
		slices.SortFunc(left, func(x, y int) int { return y - x })
		for _, i := range left {
			heal(i)
		}
	}()
	for _, st := range steps {
		if w := time.Until(start.Add(st.at)); w > 0 {
			t := time.NewTimer(w)
			select {
			case <-ctx.Done():
				t.Stop()
				return out
			case <-t.C:
			}
		}
		if ctx.Err() != nil {
			return out
		}
		f := s.Faults[st.i]
		if st.heal {
			mu.Lock()
			on := active[st.i]
			mu.Unlock()
			if on {
				heal(st.i)
			}
			continue
		}
		args, err := resolve(ctx, a, f.Inject)
		out[st.i] = Interval{Kind: f.Kind, Name: f.Name, Start: time.Now(), Inject: args}
		if err == nil {
			err = a.Do(ctx, args...)
		}
		if err != nil {
			// A verb that failed half-way may have done something: it
			// is healed all the same.
			out[st.i].Err = fmt.Sprintf("inject %s: %v", strings.Join(args, " "), err)
			logf("nemesis: inject %q failed: %v", f.Name, err)
		} else {
			logf("nemesis: %s (%s)", f.Name, strings.Join(args, " "))
		}
		mu.Lock()
		active[st.i] = true
		mu.Unlock()
	}
	return out
}

// resolve replaces the symbolic members in args by the members now behind
// them.
func resolve(ctx context.Context, a Actor, args []string) ([]string, error) {
	out := make([]string, len(args))
	for k, arg := range args {
		parts := strings.Split(arg, ",")
		for j, p := range parts {
			if !strings.HasPrefix(p, "@") {
				continue
			}
			ms, err := a.Resolve(ctx, p)
			if err != nil {
				return args, fmt.Errorf("resolve %s: %w", p, err)
			}
			parts[j] = strings.Join(ms, ",")
		}
		out[k] = strings.Join(parts, ",")
	}
	return out, nil
}

// resolveAs gives the heal's symbolic arguments the members the injection
// resolved them to (a heal acts on the member that was faulted, even if the
// primary moved meanwhile).
func resolveAs(heal, inject, resolved []string) []string {
	out := slices.Clone(heal)
	for k, h := range out {
		if !strings.Contains(h, "@") {
			continue
		}
		for j, in := range inject {
			if in == h && j < len(resolved) {
				out[k] = resolved[j]
			}
		}
	}
	return out
}

func appendErr(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}
