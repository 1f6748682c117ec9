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
// fault injected at its Start and healed at its End, each on its own
// goroutine, so a slow verb (a node that takes a minute to be ready) never
// delays another fault. It returns when every fault it injected is healed —
// at the schedule's end, or at once when ctx is cancelled (Ctrl-C, a failed
// part): a fault never outlives Run. A heal that fails is retried until
// HealTimeout (a node started while the database cannot take writes is
// ready only once it can). logf narrates each step.
func Run(ctx context.Context, s *Schedule, start time.Time, a Actor, logf func(string, ...any)) []Interval {
	out := make([]Interval, len(s.Faults))
	var wg sync.WaitGroup
	for i := range s.Faults {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runFault(ctx, s.Faults[i], start, a, logf, &out[i])
		}()
	}
	wg.Wait()
	return out
}

// until waits for t or ctx's end, and reports whether t came.
func until(ctx context.Context, t time.Time) bool {
	if w := time.Until(t); w > 0 {
		tm := time.NewTimer(w)
		defer tm.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-tm.C:
		}
	}
	return ctx.Err() == nil
}

func runFault(ctx context.Context, f Fault, start time.Time, a Actor, logf func(string, ...any), out *Interval) {
	if !until(ctx, start.Add(f.Start)) {
		return
	}
	args, err := resolve(ctx, a, f.Inject)
	*out = Interval{Kind: f.Kind, Name: f.Name, Start: time.Now(), Inject: args}
	if err == nil {
		err = a.Do(ctx, args...)
	}
	if err != nil {
		// A verb that failed half-way may have done something: it is
		// healed all the same.
		out.Err = fmt.Sprintf("inject %s: %v", strings.Join(args, " "), err)
		logf("nemesis: inject %q failed: %v", f.Name, err)
	} else {
		logf("nemesis: %s (%s)", f.Name, strings.Join(args, " "))
	}
	until(ctx, start.Add(f.End))
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), HealTimeout)
	defer cancel()
	out.Heal = resolveAs(f.Heal, f.Inject, out.Inject)
	for {
		err := a.Do(hctx, out.Heal...)
		if err == nil {
			break
		}
		if hctx.Err() != nil || !until(hctx, time.Now().Add(5*time.Second)) {
			out.Err = appendErr(out.Err, fmt.Sprintf("heal %s: %v", strings.Join(out.Heal, " "), err))
			logf("nemesis: heal %q failed: %v", f.Name, err)
			break
		}
		logf("nemesis: heal %q: %v; again in 5s", f.Name, err)
	}
	out.End = time.Now()
	logf("nemesis: healed %s (%s)", f.Name, strings.Join(out.Heal, " "))
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
