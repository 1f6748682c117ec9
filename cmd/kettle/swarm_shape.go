package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/kettlefleet/kettlefleet/sim"
)

// shapeFlags are kettle swarm's load shapes: --stages, or a --scenario file.
type shapeFlags struct {
	stages        string
	scenario      string
	scenarioSpeed float64
}

func (f *swarmFlags) registerShape(fs *flag.FlagSet) {
	fs.StringVar(&f.stages, "stages", "", "fleet size over time instead of --hatch-rate: DURATION:KETTLES,…, linear from 0 kettles at the start through each point, e.g. 2m:20000,5m:20000,30s:40000,5m:40000; a 0s stage is a step (its kettles join or leave at once); KETTLES may be a % of --devices. --devices and --duration default to the peak and the sum")
	fs.StringVar(&f.scenario, "scenario", "", "a load shape file, YAML or JSON (stages and a firmware rollout; docs/operations.md, Load shapes), e.g. contrib/scenarios/power-cut.yaml; --devices, --interval and --batch given on the command line override the file's")
	fs.Float64Var(&f.scenarioSpeed, "scenario-speed", 1, "play --scenario this many times faster: every duration of the file, its interval included, divided by it (a soak of hours tried in minutes; the load is then this many times the file's, unless --interval on the command line, which is not divided, keeps it)")
}

// resolveShape sets the run's stages from --stages or --scenario; flags
// the user set (on the command line or in the environment) win over the
// scenario file's.
func (f *swarmFlags) resolveShape(fs *flag.FlagSet) error {
	c := &f.cfg
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	switch {
	case f.stages != "" && f.scenario != "":
		return errors.New("--stages and --scenario: give one (a scenario file holds its stages)")
	case f.scenarioSpeed <= 0:
		return fmt.Errorf("--scenario-speed %g: want > 0", f.scenarioSpeed)
	case f.stages != "":
		st, err := sim.ParseStages(f.stages, c.Devices)
		if err != nil {
			return err
		}
		c.Stages = st
		c.Devices = sim.StagesPeak(st)
	case f.scenario != "":
		sc, err := sim.ReadScenario(f.scenario)
		if err != nil {
			return err
		}
		if f.scenarioSpeed != 1 {
			sc = sc.Scaled(f.scenarioSpeed)
		}
		devices := 0
		if set["devices"] {
			devices = c.Devices
		}
		if !set["interval"] {
			c.Interval = 0
		}
		if !set["batch"] {
			c.Batch = 0
		}
		if err := sc.Apply(c, devices); err != nil {
			return fmt.Errorf("--scenario %s: %w", f.scenario, err)
		}
	default:
		return nil
	}
	if !set["duration"] {
		c.Duration = sim.StagesDuration(c.Stages)
	}
	return nil
}

// describeShape says the run's shape before it starts.
func (f *swarmFlags) describeShape(w io.Writer) {
	c := &f.cfg
	if len(c.Stages) == 0 {
		return
	}
	fmt.Fprintf(w, "swarm: load shape: %d stages over %s, peak %d kettles", len(c.Stages), sim.StagesDuration(c.Stages), sim.StagesPeak(c.Stages))
	if c.Scenario != "" {
		fmt.Fprintf(w, " (scenario %s)", c.Scenario)
	}
	if r := c.Rollout; r != nil {
		fmt.Fprintf(w, "; rollout: %.0f %% of the fleet to batch %d from %s over %s", 100*r.Share, r.Batch, r.At, r.Over)
	}
	fmt.Fprintln(w)
}
