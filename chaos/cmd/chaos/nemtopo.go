package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
)

// haTopo is one deploy/cluster.sh topology brought up by a nemesis part:
// its verbs are the nemesis's actions, its members what the checker reads.
type haTopo struct {
	e   *env
	dir string // KETTLE_HA_DIR
	env []string
	// balancer is HAProxy's HTTP base URL and mqtt its MQTT address, from
	// cluster.sh status (loopback or machines alike).
	balancer, mqtt string
	nodes          int
	keep           string // where down copies the members' logs ("": nowhere)
}

// haMode is deploy/cluster.sh's mode for the nemesis: netns (every member
// on a machine of its own, the network between them can fail), unless
// KETTLE_HA_MODE=loopback asks for processes on 127.0.44.x (kills and
// pauses only).
func haMode() string {
	if m := os.Getenv("KETTLE_HA_MODE"); m != "" {
		return m
	}
	return "netns"
}

// upTopo brings the topology up (nodes kettle serve nodes; withLog: the
// readings log, Kafka × 3 and a writer; extra environment for cluster.sh)
// and returns it; down must follow, also after
// a failure or Ctrl-C.
func upTopo(ctx context.Context, e *env, nodes int, withLog bool, extra ...string) (*haTopo, error) {
	// Short: PostgreSQL's socket path must fit in 107 bytes.
	dir, err := os.MkdirTemp("/tmp", "knem-")
	if err != nil {
		return nil, err
	}
	pw := uuid.NewString()
	t := &haTopo{e: e, dir: dir, nodes: nodes}
	t.env = append(os.Environ(), "KETTLE_HA_DIR="+dir, "KETTLE_BIN="+e.bin, fmt.Sprintf("KETTLE_HA_NODES=%d", nodes),
		"KETTLE_HA_PASSWORD="+pw, "KETTLE_HA_MODE="+haMode(), "KETTLE_HA_SERVE_ARGS=--access-log-sample 0")
	t.env = append(t.env, extra...)
	start := time.Now()
	up := []string{"up"}
	if withLog {
		up = append(up, "--log")
	}
	if out, err := t.cmd(ctx, 6*time.Minute, up...); err != nil {
		t.down()
		return nil, fmt.Errorf("deploy/cluster.sh up: %v: %s", err, lastLines(out, 8))
	}
	e.logf("topology up in %.0fs (%s mode, %s)", time.Since(start).Seconds(), haMode(), dir)
	out, err := t.cmd(ctx, time.Minute, "status")
	if err != nil {
		t.down()
		return nil, fmt.Errorf("deploy/cluster.sh status: %v: %s", err, lastLines(out, 8))
	}
	m := regexp.MustCompile(`(?m)^haproxy (\S+):8080 `).FindStringSubmatch(out)
	if m == nil {
		t.down()
		return nil, fmt.Errorf("deploy/cluster.sh status names no haproxy address: %s", lastLines(out, 8))
	}
	t.balancer, t.mqtt = "http://"+m[1]+":8080", m[1]+":1883"
	return t, nil
}

// down takes the topology down within 3 minutes, whatever the context.
// With keep set, the members' logs go there first (the topology's
// directory is removed).
func (t *haTopo) down() {
	if t.keep != "" {
		logs, _ := filepath.Glob(filepath.Join(t.dir, "*.log"))
		if len(logs) > 0 {
			os.MkdirAll(filepath.Join(t.keep, "logs"), 0o755)
		}
		for _, l := range logs {
			if b, err := os.ReadFile(l); err == nil {
				os.WriteFile(filepath.Join(t.keep, "logs", filepath.Base(l)), b, 0o644)
			}
		}
	}
	if out, err := t.cmd(context.Background(), 3*time.Minute, "down"); err != nil {
		t.e.logf("deploy/cluster.sh down: %v: %s", err, lastLines(out, 5))
	}
	os.RemoveAll(t.dir)
}

// cmd runs deploy/cluster.sh args… within limit.
func (t *haTopo) cmd(ctx context.Context, limit time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	c := exec.CommandContext(ctx, filepath.Join(t.e.root, "deploy", "cluster.sh"), args...)
	c.Env = t.env
	c.WaitDelay = 5 * time.Second
	out, err := c.CombinedOutput()
	fmt.Fprintf(t.e.log, "%s cluster.sh %s: %v\n%s\n", time.Now().Format("15:04:05.000"), strings.Join(args, " "), err, out)
	return strings.TrimSpace(string(out)), err
}

// Do is the nemesis's action: one cluster.sh verb, at most 3 minutes.
func (t *haTopo) Do(ctx context.Context, args ...string) error {
	out, err := t.cmd(ctx, nemesis.HealTimeout, args...)
	if err != nil {
		return fmt.Errorf("%v: %s", err, lastLines(out, 2))
	}
	return nil
}

// Resolve names the members behind @primary, @sync and @standbys now.
func (t *haTopo) Resolve(ctx context.Context, sym string) ([]string, error) {
	leader, err := t.cmd(ctx, 30*time.Second, "leader")
	if err != nil || leader == "" {
		return nil, fmt.Errorf("no Patroni leader: %v %s", err, leader)
	}
	switch sym {
	case nemesis.Primary:
		return []string{leader}, nil
	case nemesis.Sync:
		s, err := t.cmd(ctx, 30*time.Second, "sync")
		if err != nil || s == "" {
			return nil, fmt.Errorf("no synchronous standby: %v %s", err, s)
		}
		return strings.Fields(s)[:1], nil
	case nemesis.Standbys:
		var out []string
		for _, m := range []string{"pg1", "pg2", "pg3"} {
			if m != leader {
				out = append(out, m)
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown member %s", sym)
}

// healthy waits up to limit for a leader and two streaming standbys.
func (t *haTopo) healthy(ctx context.Context, limit time.Duration) error {
	end := time.Now().Add(limit)
	for {
		if _, err := t.cmd(ctx, 10*time.Second, "healthy"); err == nil {
			return nil
		}
		if time.Now().After(end) || ctx.Err() != nil {
			out, _ := t.cmd(ctx, 30*time.Second, "status")
			return fmt.Errorf("not a leader and two streaming standbys %s after the faults: %s", limit, lastLines(out, 8))
		}
		time.Sleep(time.Second)
	}
}

// machines are the members running now and their addresses.
func (t *haTopo) machines(ctx context.Context) map[string]string {
	out, _ := t.cmd(ctx, 30*time.Second, "machines")
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			m[f[0]] = f[1]
		}
	}
	return m
}

// dsn is the nodes' multi-host DSN (the primary among the members).
func (t *haTopo) dsn(ctx context.Context) (string, error) {
	return t.cmd(ctx, 30*time.Second, "dsn")
}

// file reads a file the topology keeps (operator-token, secret).
func (t *haTopo) file(name string) string {
	b, _ := os.ReadFile(filepath.Join(t.dir, name))
	return strings.TrimSpace(string(b))
}

// swarmArgs are the flags a swarm through the balancer needs: the
// operator's token and the nodes' secret (the files cluster.sh keeps),
// and the balancer's host allowed when it is not on loopback.
func (t *haTopo) swarmArgs() []string {
	args := []string{"--data-dir", t.dir}
	if u, err := url.Parse(t.balancer); err == nil && !strings.HasPrefix(u.Hostname(), "127.") {
		args = append(args, "--allow-target", u.Hostname())
	}
	return args
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], " | ")
}

// newEnv is main's env for a part run on its own (chaos nemesis): the
// results directory, chaos.log and, when needBin, the kettle binary.
func newEnv(needBin bool) (*env, func(), error) {
	root, err := moduleRoot()
	if err != nil {
		return nil, nil, err
	}
	out := filepath.Join(root, "chaos-results")
	if err := os.MkdirAll(out, 0o755); err != nil {
		return nil, nil, err
	}
	logf, err := os.OpenFile(filepath.Join(out, "chaos.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, err
	}
	e := &env{root: root, out: out, log: logf}
	if needBin {
		e.bin = filepath.Join(out, "bin", "kettle")
		e.logf("building %s", e.bin)
		cmd := exec.Command("go", "build", "-o", e.bin, "./cmd/kettle")
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			logf.Close()
			return nil, nil, fmt.Errorf("go build ./cmd/kettle: %v\n%s", err, b)
		}
	}
	return e, func() { logf.Close() }, nil
}
