package deploy_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestPatroniStopBounded: with synchronous_mode_strict a primary's stop
// must be bounded (primary_stop_timeout), or a primary cut from etcd and
// its standbys never finishes demoting itself when a backend ends by
// dropping a temporary table, a commit that waits for a synchronous
// standby on the far side of the cut, which SIGTERM does not end. The
// rejoin after the heal is measured by make chaos's nem-primary-cut; this
// keeps the setting from going missing between those runs.
func TestPatroniStopBounded(t *testing.T) {
	b, err := os.ReadFile("patroni/patroni.yml")
	if err != nil {
		t.Fatal(err)
	}
	// cluster.sh replaces the @TOKENS@; with them replaced the file is YAML.
	text := regexp.MustCompile(`@[A-Z]+@`).ReplaceAllString(strings.ReplaceAll(string(b), "@SYNC@", "true"), "x")
	var cfg struct {
		Bootstrap struct {
			DCS map[string]any `yaml:"dcs"`
		} `yaml:"bootstrap"`
	}
	if err := yaml.Unmarshal([]byte(text), &cfg); err != nil {
		t.Fatalf("patroni/patroni.yml: %v", err)
	}
	dcs := cfg.Bootstrap.DCS
	if dcs["synchronous_mode_strict"] != true {
		t.Skip("synchronous_mode_strict is off: a stop has no commit to wait for")
	}
	stop, _ := dcs["primary_stop_timeout"].(int)
	ttl, _ := dcs["ttl"].(int)
	if stop <= 0 {
		t.Fatalf("bootstrap.dcs.primary_stop_timeout = %v: with synchronous_mode_strict a demoting primary waits for ever; set it (seconds, under the ttl %d)", dcs["primary_stop_timeout"], ttl)
	}
	if ttl > 0 && stop >= ttl {
		t.Errorf("bootstrap.dcs.primary_stop_timeout = %d s, not under the ttl (%d s): a stuck stop would outlast the leader lock", stop, ttl)
	}
}
