package dist_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
)

var composeFile = filepath.Join(repo, "deploy/compose/compose.yaml")

// loadCompose loads the Compose file as `docker compose` does, with the
// Compose specification's schema checked (an unknown key fails) and into
// compose-go's typed project.
func loadCompose(t *testing.T) *types.Project {
	t.Helper()
	details := types.ConfigDetails{
		WorkingDir:  filepath.Dir(composeFile),
		ConfigFiles: []types.ConfigFile{{Filename: composeFile}},
		Environment: types.Mapping{},
	}
	p, err := loader.LoadWithContext(context.Background(), details, func(o *loader.Options) {
		o.SetProjectName("kettlefleet", true)
	})
	if err != nil {
		t.Fatalf("load %s: %v", composeFile, err)
	}
	return p
}

// TestCompose: the single-machine production shape loads strictly, and
// what it says of kettle is true of the code: every KETTLE_* variable is a
// flag of `kettle serve`, the published port is the one KETTLE_ADDR
// listens on, secrets are files (never in the environment), the service
// runs as the image's non-root user on a read-only root filesystem, and
// the Prometheus configuration it mounts passes promtool.
func TestCompose(t *testing.T) {
	p := loadCompose(t)
	k, err := p.GetService("kettle")
	if err != nil {
		t.Fatal(err)
	}
	flags := flagEnv(t, "serve")
	for name, v := range k.Environment {
		if strings.HasPrefix(name, "KETTLE_") && !flags[name] {
			t.Errorf("kettle: %s is not a flag of kettle serve", name)
		}
		if v != nil && (strings.Contains(strings.ToLower(name), "token") || strings.Contains(strings.ToLower(name), "secret")) && !strings.HasSuffix(name, "_FILE") {
			t.Errorf("kettle: %s carries a secret in the environment; use its _FILE twin and a Compose secret", name)
		}
	}
	addr := k.Environment["KETTLE_ADDR"]
	published := false
	for _, port := range k.Ports {
		if addr != nil && strings.HasSuffix(*addr, fmt.Sprintf(":%d", port.Target)) {
			published = true
		}
	}
	if !published {
		t.Errorf("kettle: no port published for KETTLE_ADDR=%v: %v", addr, k.Ports)
	}
	if !k.ReadOnly || k.User == "" || strings.HasPrefix(k.User, "0") {
		t.Errorf("kettle: read_only %v, user %q: want a read-only root and the non-root user", k.ReadOnly, k.User)
	}
	for _, s := range []string{"operator-token", "secret", "pgpass"} {
		found := false
		for _, ref := range k.Secrets {
			found = found || ref.Source == s
		}
		if !found {
			t.Errorf("kettle: secret %s not given to the service", s)
		}
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: apt-get install -y prometheus (make deps)")
	}
	// promtool resolves rule_files beside the configuration: check it as
	// mounted, with the shipped rules next to it.
	dir := t.TempDir()
	for src, dst := range map[string]string{"deploy/compose/prometheus.yml": "prometheus.yml", "deploy/prometheus/alerts.yml": "alerts.yml"} {
		if out, err := exec.Command("cp", filepath.Join(repo, src), filepath.Join(dir, dst)).CombinedOutput(); err != nil {
			t.Fatalf("%v %s", err, out)
		}
	}
	if out, err := exec.Command(promtool, "check", "config", filepath.Join(dir, "prometheus.yml")).CombinedOutput(); err != nil {
		t.Errorf("promtool check config: %v\n%s", err, out)
	}
}
