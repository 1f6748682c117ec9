package sim

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Scenario is a load shape in a file (kettle swarm --scenario FILE): YAML,
// or JSON (which YAML reads too). docs/operations.md ("Load shapes")
// documents the format;
// contrib/scenarios holds examples. Unknown fields are refused, so a typo
// does not pass for a default.
type Scenario struct {
	Name        string `yaml:"name"`
	Description string `yaml:"description"`
	// Devices is the fleet that 100 % stands for (kettle swarm --devices
	// replaces it, and the percentages follow); 0: the largest absolute
	// target.
	Devices  int           `yaml:"devices"`
	Interval time.Duration `yaml:"interval"` // between a kettle's readings (0: --interval)
	Batch    int           `yaml:"batch"`    // readings per upload before any rollout (0: --batch)
	// Stages are the fleet size over time (as --stages): each reaches its
	// target after its duration, linearly from the previous one; a stage of
	// 0 s is a step.
	Stages  []ScenarioStage  `yaml:"stages"`
	Rollout *ScenarioRollout `yaml:"rollout"`
}

// ScenarioStage is one stage of a scenario file.
type ScenarioStage struct {
	Duration time.Duration `yaml:"duration"`
	// Target is kettles ("20000") or a share of Devices ("30%").
	Target string `yaml:"target"`
}

// ScenarioRollout is a firmware rollout in a scenario file.
type ScenarioRollout struct {
	At    time.Duration `yaml:"at"`    // since the run's start
	Over  time.Duration `yaml:"over"`  // from the first kettle switched to the last
	Share float64       `yaml:"share"` // of the fleet, (0, 1]
	Batch int           `yaml:"batch"` // readings per upload once switched
}

// maxScenarioBytes bounds a scenario file.
const maxScenarioBytes = 1 << 20

// ReadScenario reads and checks a scenario file; errors name the file and
// the field.
func ReadScenario(path string) (*Scenario, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--scenario: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxScenarioBytes+1))
	if err != nil {
		return nil, fmt.Errorf("--scenario %s: %w", path, err)
	}
	if len(b) > maxScenarioBytes {
		return nil, fmt.Errorf("--scenario %s: larger than %d bytes", path, maxScenarioBytes)
	}
	sc, err := ParseScenario(b)
	if err != nil {
		return nil, fmt.Errorf("--scenario %s: %w", path, err)
	}
	if sc.Name == "" {
		sc.Name = strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
	}
	return sc, nil
}

// ParseScenario reads a scenario from YAML or JSON and checks it.
func ParseScenario(b []byte) (*Scenario, error) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	var sc Scenario
	if err := dec.Decode(&sc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty file: want at least stages")
		}
		return nil, err
	}
	if _, err := sc.stages(sc.Devices); err != nil {
		return nil, err
	}
	if sc.Interval < 0 || sc.Batch < 0 || sc.Devices < 0 {
		return nil, fmt.Errorf("devices %d, interval %s, batch %d: want none negative", sc.Devices, sc.Interval, sc.Batch)
	}
	return &sc, nil
}

// stages resolves the stages' targets against base kettles (100 %).
func (sc *Scenario) stages(base int) ([]Stage, error) {
	if len(sc.Stages) == 0 {
		return nil, errors.New("stages: want at least one {duration, target}")
	}
	pct := false
	for _, s := range sc.Stages {
		pct = pct || strings.HasSuffix(strings.TrimSpace(s.Target), "%")
	}
	if pct && base <= 0 {
		return nil, errors.New("devices: a stage's target is a percentage; say what 100 % is (devices: N, or --devices)")
	}
	out := make([]Stage, len(sc.Stages))
	for i, s := range sc.Stages {
		n, err := ParseTarget(s.Target, base)
		if err != nil {
			return nil, fmt.Errorf("stages[%d]: %w", i, err)
		}
		if s.Duration < 0 {
			return nil, fmt.Errorf("stages[%d]: duration %s: want ≥ 0", i, s.Duration)
		}
		out[i] = Stage{Duration: s.Duration, Target: n}
	}
	return out, nil
}

// Scaled is the scenario played speed times faster: every duration, the
// interval included, divided by speed (a soak of hours tried in minutes).
func (sc *Scenario) Scaled(speed float64) *Scenario {
	c := *sc
	d := func(x time.Duration) time.Duration { return time.Duration(float64(x) / speed) }
	c.Interval = d(sc.Interval)
	c.Stages = make([]ScenarioStage, len(sc.Stages))
	for i, s := range sc.Stages {
		c.Stages[i] = ScenarioStage{Duration: d(s.Duration), Target: s.Target}
	}
	if r := sc.Rollout; r != nil {
		c.Rollout = &ScenarioRollout{At: d(r.At), Over: d(r.Over), Share: r.Share, Batch: r.Batch}
	}
	return &c
}

// Apply sets cfg's shape from the scenario. devices, if > 0, is what 100 %
// stands for instead of the file's Devices (kettle swarm --devices); the
// file's interval and batch apply where cfg has none.
func (sc *Scenario) Apply(cfg *Config, devices int) error {
	base := sc.Devices
	if devices > 0 {
		base = devices
	}
	st, err := sc.stages(base)
	if err != nil {
		return err
	}
	cfg.Stages = st
	cfg.Devices = StagesPeak(st)
	if cfg.Interval <= 0 {
		cfg.Interval = sc.Interval
	}
	if cfg.Batch <= 0 {
		cfg.Batch = sc.Batch
	}
	if r := sc.Rollout; r != nil {
		cfg.Rollout = &Rollout{At: r.At, Over: r.Over, Share: r.Share, Batch: r.Batch}
	}
	cfg.Scenario = sc.Name
	return nil
}
