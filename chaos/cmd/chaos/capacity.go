package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// capacityInterval is the kettles' interval a capacity is stated at.
const capacityInterval = 30 * time.Second

// overloadCapacity is the fleet overload multiplies: the kettles kettle
// serve holds at capacityInterval, and where that number came from.
type overloadCapacity struct {
	kettles int
	source  string // how it was found, for the page
}

// measureCapacity runs a short `kettle capacity` against a kettle serve of
// the binary under test with its defaults (SQLite, --max-conns maxConns),
// started for it and stopped after, so that the overload offers a multiple
// of what this machine holds today, not of a number typed once.
func measureCapacity(ctx context.Context, e *env, maxConns int) (overloadCapacity, error) {
	srv, dir, data, err := startPartServe(ctx, e, "overload-capacity", "", "--max-conns", fmt.Sprint(maxConns))
	if err != nil {
		return overloadCapacity{}, err
	}
	defer srv.stop()
	args := []string{"capacity", "--target", srv.url, "--data-dir", data, "--interval", capacityInterval.String(),
		"--start", "20000", "--step", "40000", "--max", "420000", "--step-duration", "20s", "--warmup", "5s", "--pause", "2s",
		"--sample=false", "--out", filepath.Join(dir, "out")}
	e.logf("overload: measuring the capacity first: kettle %s", strings.Join(args, " "))
	cctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, e.bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	logf, err := os.Create(filepath.Join(dir, "capacity.log"))
	if err != nil {
		return overloadCapacity{}, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Run(); err != nil {
		return overloadCapacity{}, fmt.Errorf("kettle capacity: %v (log: %s)", err, filepath.Join(dir, "capacity.log"))
	}
	b, err := os.ReadFile(filepath.Join(dir, "out", "capacity.json"))
	if err != nil {
		return overloadCapacity{}, err
	}
	var doc struct {
		Capacity struct {
			Holds int    `json:"holds"`
			Line  string `json:"line"`
		} `json:"capacity"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return overloadCapacity{}, fmt.Errorf("capacity.json: %w", err)
	}
	c := doc.Capacity
	if c.Holds <= 0 {
		return overloadCapacity{}, fmt.Errorf("kettle capacity found no step that held: %s", c.Line)
	}
	return overloadCapacity{kettles: c.Holds, source: fmt.Sprintf("measured in this run by `kettle %s` against kettle serve (SQLite, --max-conns %d, other flags default): %s",
		strings.Join(args, " "), maxConns, c.Line)}, nil
}
