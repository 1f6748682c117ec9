package report

import (
	"fmt"

	"github.com/kettlefleet/kettlefleet/sim"
)

// stageBands are the run's load shape as bands over the time series (the
// faults' mechanism): each stage where the fleet changes, labelled with
// the size it goes to (a step is a band of one second), and the rollout.
func stageBands(p sim.Params) []Band {
	var out []Band
	for i, st := range p.Stages {
		if st.From == st.To {
			continue
		}
		how := fmt.Sprintf("over %g s", st.EndS-st.StartS)
		if st.EndS == st.StartS {
			how = "at once"
		}
		out = append(out, Band{Name: fmt.Sprintf("stage %d: %d → %d kettles %s", i+1, st.From, st.To, how),
			Kind: fmt.Sprintf("→ %d kettles", st.To), T0: st.StartS, T1: st.EndS})
	}
	if r := p.Rollout; r != nil {
		out = append(out, Band{Name: fmt.Sprintf("firmware rollout: %.0f %% of the fleet to batches of %d", 100*r.Share, r.Batch),
			Kind: fmt.Sprintf("rollout → batch %d", r.Batch), T0: r.StartS, T1: r.EndS})
	}
	return out
}
