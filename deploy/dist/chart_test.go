package dist_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

var chartDir = filepath.Join(repo, "deploy/helm/kettlefleet")

// valueSets are the chart's configurations under test: its defaults, and
// everything on.
var valueSets = map[string]map[string]any{
	"defaults": {},
	"all":      {"log": map[string]any{"enabled": true}, "lab": map[string]any{"enabled": true}},
}

// TestChartLint: helm lint (the helm Go module) finds nothing above info.
func TestChartLint(t *testing.T) {
	for name, vals := range valueSets {
		lint := action.NewLint()
		lint.Strict = true
		res := lint.Run([]string{chartDir}, vals)
		for _, m := range res.Messages {
			if m.Severity > support.InfoSev {
				t.Errorf("%s: helm lint: %s", name, m)
			}
		}
		for _, err := range res.Errors {
			t.Errorf("%s: helm lint: %v", name, err)
		}
	}
}

// objects is a rendered chart, every object strictly decoded.
type objects struct {
	deployments  []appsv1.Deployment
	statefulSets []appsv1.StatefulSet
	services     []corev1.Service
	pdbs         []policyv1.PodDisruptionBudget
	jobs         []batchv1.Job
}

// render is `helm template` through the helm Go module, then every object
// decoded into its k8s.io/api type with unknown fields refused: a field
// Kubernetes does not know (a typo, a wrong indentation) fails here, not
// at the cluster.
func render(t *testing.T, vals map[string]any) objects {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	inst := action.NewInstall(&action.Configuration{})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = "kettle", "fleet"
	inst.KubeVersion = &chartutil.KubeVersion{Version: "v1.31.0", Major: "1", Minor: "31"}
	rel, err := inst.Run(ch, vals)
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	var o objects
	for name, doc := range releaseutil.SplitManifests(rel.Manifest) {
		j, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var head struct{ APIVersion, Kind string }
		if err := json.Unmarshal(j, &head); err != nil {
			t.Fatal(err)
		}
		var into any
		switch head.APIVersion + " " + head.Kind {
		case "apps/v1 Deployment":
			into = grow(&o.deployments)
		case "apps/v1 StatefulSet":
			into = grow(&o.statefulSets)
		case "v1 Service":
			into = grow(&o.services)
		case "policy/v1 PodDisruptionBudget":
			into = grow(&o.pdbs)
		case "batch/v1 Job":
			into = grow(&o.jobs)
		default:
			t.Fatalf("%s: %s %s: no decoder in this test (add it)", name, head.APIVersion, head.Kind)
		}
		dec := json.NewDecoder(bytes.NewReader(j))
		dec.DisallowUnknownFields()
		if err := dec.Decode(into); err != nil {
			t.Errorf("%s (%s): strict decode: %v", name, head.Kind, err)
		}
	}
	return o
}

// grow appends a zero object to *s and returns it, to decode into.
func grow[T any](s *[]T) *T {
	*s = append(*s, *new(T))
	return &(*s)[len(*s)-1]
}

// containers of every workload, with the kettle command each runs.
func (o objects) containers() map[string]corev1.Container {
	m := map[string]corev1.Container{}
	add := func(kind, name string, spec corev1.PodSpec) {
		for _, c := range spec.Containers {
			m[kind+"/"+name+"/"+c.Name] = c
		}
	}
	for _, d := range o.deployments {
		add("Deployment", d.Name, d.Spec.Template.Spec)
	}
	for _, s := range o.statefulSets {
		add("StatefulSet", s.Name, s.Spec.Template.Spec)
	}
	for _, j := range o.jobs {
		add("Job", j.Name, j.Spec.Template.Spec)
	}
	return m
}

func TestChartRendersStrictly(t *testing.T) {
	o := render(t, valueSets["defaults"])
	if len(o.deployments) != 1 || len(o.services) != 1 || len(o.pdbs) != 1 {
		t.Fatalf("defaults: %d deployments, %d services, %d PDBs; want the nodes' 1, 1, 1", len(o.deployments), len(o.services), len(o.pdbs))
	}
	all := render(t, valueSets["all"])
	if len(all.deployments) != 2 || len(all.statefulSets) != 1 || len(all.jobs) != 1 {
		t.Fatalf("all on: %d deployments, %d statefulsets, %d jobs; want nodes+writers, the lab's workers, its run", len(all.deployments), len(all.statefulSets), len(all.jobs))
	}
}

// kettle is a binary of this checkout, for what the chart is checked
// against: its routes and its flags. It is internal/testkit.BuildKettle,
// run once; this module imports none of kettlefleet's packages.
var kettle = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "kettle-chart-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "kettle")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/kettle")
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
})

var envTwin = regexp.MustCompile(`\[(KETTLE_[A-Z0-9_]+)\]`)

// flagEnv is the set of environment twins of `kettle ARGS --help`.
func flagEnv(t *testing.T, args ...string) map[string]bool {
	t.Helper()
	bin, err := kettle()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := exec.Command(bin, append(args, "--help")...).CombinedOutput()
	m := map[string]bool{}
	for _, s := range envTwin.FindAllStringSubmatch(string(out), -1) {
		m[s[1]] = true
	}
	if len(m) == 0 {
		t.Fatalf("kettle %s --help lists no flags:\n%s", strings.Join(args, " "), out)
	}
	return m
}

// command is the kettle subcommand a container runs: its args before the
// first flag ("serve", "swarm worker").
func command(c corev1.Container) []string {
	var cmd []string
	for _, a := range c.Args {
		if strings.HasPrefix(a, "-") {
			break
		}
		cmd = append(cmd, a)
	}
	return cmd
}

// TestChartMatchesCode: what the chart says of kettle is true of the code:
// every KETTLE_* variable is a flag of the command the container runs, the
// probes' paths are routes of the API (httpapi/openapi.json), each
// probe's port is a container port, and the HTTP container port is the
// one KETTLE_ADDR listens on.
func TestChartMatchesCode(t *testing.T) {
	spec, err := os.ReadFile(filepath.Join(repo, "httpapi/openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	var api struct {
		Paths map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(spec, &api); err != nil {
		t.Fatal(err)
	}
	flags := map[string]map[string]bool{}
	for name, c := range render(t, valueSets["all"]).containers() {
		cmd := command(c)
		key := strings.Join(cmd, " ")
		if flags[key] == nil {
			flags[key] = flagEnv(t, cmd...)
		}
		env := map[string]string{}
		for _, e := range c.Env {
			env[e.Name] = e.Value
			if strings.HasPrefix(e.Name, "KETTLE_") && !flags[key][e.Name] {
				t.Errorf("%s: %s is not a flag of kettle %s", name, e.Name, key)
			}
		}
		ports := map[string]int32{}
		for _, p := range c.Ports {
			ports[p.Name] = p.ContainerPort
		}
		for what, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
			if pr == nil {
				continue
			}
			var port string
			switch {
			case pr.HTTPGet != nil:
				port = pr.HTTPGet.Port.String()
				// The writer's listener serves the same three operational
				// routes as a node (server/log.go).
				if _, ok := api.Paths[pr.HTTPGet.Path]; !ok {
					t.Errorf("%s: %s probe path %s is not a route (httpapi/openapi.json)", name, what, pr.HTTPGet.Path)
				}
			case pr.TCPSocket != nil:
				port = pr.TCPSocket.Port.String()
			}
			if _, ok := ports[port]; !ok {
				t.Errorf("%s: %s probe port %q is not a container port %v", name, what, port, ports)
			}
		}
		for envName, portName := range map[string]string{"KETTLE_ADDR": "http", "KETTLE_MQTT_ADDR": "mqtt", "KETTLE_LISTEN": "control", "KETTLE_METRICS_ADDR": "metrics"} {
			addr, ok := env[envName]
			if !ok {
				continue
			}
			if p, ok := ports[portName]; ok && !strings.HasSuffix(addr, fmt.Sprintf(":%d", p)) {
				t.Errorf("%s: %s=%s but container port %s is %d", name, envName, addr, portName, p)
			}
		}
	}
}

// TestChartHardening: non-root, read-only root filesystem, no privilege,
// probes on the nodes, a preStop sleep of the drain and a grace period
// that covers it and the queue's drain.
func TestChartHardening(t *testing.T) {
	o := render(t, valueSets["all"])
	pods := map[string]corev1.PodSpec{}
	for _, d := range o.deployments {
		pods[d.Name] = d.Spec.Template.Spec
	}
	for _, s := range o.statefulSets {
		pods[s.Name] = s.Spec.Template.Spec
	}
	for _, j := range o.jobs {
		pods[j.Name] = j.Spec.Template.Spec
	}
	for name, p := range pods {
		if p.SecurityContext == nil || p.SecurityContext.RunAsNonRoot == nil || !*p.SecurityContext.RunAsNonRoot {
			t.Errorf("%s: not runAsNonRoot", name)
		}
		for _, c := range p.Containers {
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s/%s: root filesystem not read-only or privilege escalation allowed", name, c.Name)
			}
			for _, a := range c.Args {
				if regexp.MustCompile(`(?i)token|secret|password`).MatchString(a) {
					t.Errorf("%s/%s: a secret in args: %q", name, c.Name, a)
				}
			}
		}
	}
	var node appsv1.Deployment
	for _, d := range o.deployments {
		if d.Name == "kettle" {
			node = d
		}
	}
	if node.Name == "" {
		t.Fatal("no Deployment of the nodes (kettle)")
	}
	vals := chartValues(t)
	c := node.Spec.Template.Spec.Containers[0]
	if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil ||
		c.Lifecycle.PreStop.Sleep.Seconds != int64(vals.DrainDelaySeconds) {
		t.Errorf("nodes: no preStop sleep of drainDelaySeconds (%d)", vals.DrainDelaySeconds)
	}
	if g := node.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g <= int64(vals.DrainDelaySeconds+vals.ShutdownTimeoutSeconds) {
		t.Errorf("nodes: terminationGracePeriodSeconds %v does not cover the preStop (%d s) and --shutdown-timeout (%d s)", g, vals.DrainDelaySeconds, vals.ShutdownTimeoutSeconds)
	}
	if c.ReadinessProbe == nil || c.LivenessProbe == nil {
		t.Error("nodes: readiness or liveness probe missing")
	}
}

type chartVals struct {
	DrainDelaySeconds      int `json:"drainDelaySeconds"`
	ShutdownTimeoutSeconds int `json:"shutdownTimeoutSeconds"`
	Sizing                 struct {
		KettlesPerNode  float64 `json:"kettlesPerNode"`
		IntervalSeconds float64 `json:"intervalSeconds"`
	} `json:"sizing"`
	Resources corev1.ResourceRequirements `json:"resources"`
}

func chartValues(t *testing.T) chartVals {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v chartVals
	if err := yaml.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestChartResourcesFromSizing: each node's requests cover the chart's
// planned fleet (sizing.kettlesPerNode at sizing.intervalSeconds) at 70 %
// of what it is given, by the latest bench/sizing.sh record: its CPU per
// kettle and interval, and its memory per kettle over an idle node.
func TestChartResourcesFromSizing(t *testing.T) {
	rec := latestRecord(t, "sizing.sh")
	v := chartValues(t)
	cpuUs, rssPer, rssBase := rec["serve_cpu_us_per_kettle_interval"], rec["serve_rss_bytes_per_kettle"], rec["serve_rss_bytes_base"]
	if cpuUs == 0 || rssPer == 0 {
		t.Fatalf("the sizing record lacks serve CPU or memory: %v", rec)
	}
	const headroom = 0.7
	needCPU := cpuUs * v.Sizing.KettlesPerNode / v.Sizing.IntervalSeconds / 1e6 / headroom
	needMem := (rssBase + rssPer*v.Sizing.KettlesPerNode) / headroom
	req := v.Resources.Requests
	gotCPU := req.Cpu().AsApproximateFloat64()
	gotMem := req.Memory().AsApproximateFloat64()
	t.Logf("%.0f kettles every %.0f s: need %.3f cores and %s; requested %.3f cores and %s",
		v.Sizing.KettlesPerNode, v.Sizing.IntervalSeconds, needCPU, resource.NewQuantity(int64(needMem), resource.BinarySI), gotCPU, req.Memory())
	if gotCPU < needCPU {
		t.Errorf("requests.cpu %.3f < %.3f the sizing needs", gotCPU, needCPU)
	}
	if gotMem < needMem {
		t.Errorf("requests.memory %s < %.0f bytes the sizing needs", req.Memory(), needMem)
	}
	if lim := v.Resources.Limits.Memory(); lim.Cmp(*req.Memory()) < 0 {
		t.Errorf("limits.memory %s below requests.memory %s", lim, req.Memory())
	}
}

// latestRecord is the figures of bench/results.jsonl's last record of bench.
func latestRecord(t *testing.T, bench string) map[string]float64 {
	t.Helper()
	f, err := os.Open(filepath.Join(repo, "bench/results.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var last map[string]float64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		var r struct {
			Bench   string `json:"bench"`
			Figures []struct {
				Name  string  `json:"name"`
				Value float64 `json:"value"`
			} `json:"figures"`
		}
		if json.Unmarshal(sc.Bytes(), &r) != nil || r.Bench != bench {
			continue
		}
		last = map[string]float64{}
		for _, fg := range r.Figures {
			last[fg.Name] = fg.Value
		}
	}
	if last == nil {
		t.Fatalf("no %s record in bench/results.jsonl", bench)
	}
	return last
}
