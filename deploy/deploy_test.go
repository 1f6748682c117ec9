package deploy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/metrics/metricstest"
)

func run(t *testing.T, bin string, args ...string) {
	t.Helper()
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(bin), strings.Join(args, " "), err, out)
	}
}

func TestPromtool(t *testing.T) {
	promtool := testkit.Tool(t, "prometheus", "promtool")
	run(t, promtool, "check", "config", "prometheus/prometheus.yml")
	run(t, promtool, "check", "rules", "prometheus/alerts.yml")
	run(t, promtool, "test", "rules", "prometheus/alerts_test.yml")
}

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	Title      string  `json:"title"`
	UID        string  `json:"uid"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Definition string          `json:"definition"`
			Datasource *datasource     `json:"datasource"`
		} `json:"list"`
	} `json:"templating"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID         int         `json:"id"`
	Type       string      `json:"type"`
	Title      string      `json:"title"`
	Datasource *datasource `json:"datasource"`
	Targets    []struct {
		RefID      string      `json:"refId"`
		Expr       string      `json:"expr"`
		Datasource *datasource `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // collapsed rows
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile("grafana/kettlefleet.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("grafana/kettlefleet.json: %v", err)
	}
	return d
}

func allPanels(ps []panel) []panel {
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// TestDashboardImportable checks what an import needs: unique panel ids,
// every query through the datasource variable (no hard-coded uid), and the
// ground the issue asks the dashboard to cover.
func TestDashboardImportable(t *testing.T) {
	d := loadDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Error("dashboard needs a uid and a title")
	}
	hasDS := false
	for _, v := range d.Templating.List {
		if v.Name == "datasource" && v.Type == "datasource" {
			hasDS = true
		}
		if v.Datasource != nil && v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s: datasource %q, want ${datasource}", v.Name, v.Datasource.UID)
		}
	}
	if !hasDS {
		t.Error("no datasource template variable")
	}
	ids := map[int]bool{}
	var all strings.Builder
	for _, p := range allPanels(d.Panels) {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource %+v, want uid ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q target %s: empty expr", p.Title, tg.RefID)
			}
			all.WriteString(tg.Expr + "\n")
		}
	}
	for _, want := range []string{
		"kettle_http_request_duration_seconds_count", "kettle_http_request_duration_seconds_bucket",
		"kettle_ingest_queue_rows", "kettle_ingest_queue_capacity_rows", "kettle_ingest_batch_rows_bucket",
		"kettle_ingest_commit_seconds_bucket", "kettle_pg_pool_acquire_wait_seconds_total", "kettle_devices_registered",
		"kettle_devices_reporting", "go_gc_duration_seconds", "go_goroutines", "process_cpu_seconds_total",
		"process_open_fds", "kettle_swarm_requests_offered_total", "kettle_swarm_requests_completed_total",
	} {
		if !strings.Contains(all.String(), want) {
			t.Errorf("no panel queries %s", want)
		}
	}
}

// ---- the dashboard and the alerts against a real Prometheus ----

// Grafana's built-in and the dashboard's variables, substituted the way
// Grafana would with "All" selected.
var substitutions = []struct{ re, with string }{
	{`\$\{__rate_interval\}|\$__rate_interval`, "1m"},
	{`\$\{__interval\}|\$__interval`, "15s"},
	{`\$\{__range\}|\$__range`, "5m"},
	{`\$\{route(:regex)?\}|\$route`, ".*"},
	{`\$\{job(:regex)?\}|\$job`, ".*"},
}

var leftover = regexp.MustCompile(`\$\{?\w+`)

func substitute(expr string) (string, error) {
	for _, s := range substitutions {
		expr = regexp.MustCompile(s.re).ReplaceAllString(expr, s.with)
	}
	if v := leftover.FindString(expr); v != "" {
		return "", fmt.Errorf("unknown template variable %s: add it to substitutions in deploy_test.go", v)
	}
	return expr, nil
}

var labelValues = regexp.MustCompile(`^\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*$`)

// withBool turns every top-level comparison of an alert expression into a
// bool comparison ("x > 0.8" → "x > bool 0.8"), so the expression returns a
// 0/1 series for everything its left-hand side returns instead of nothing
// while the alert is not firing: the test then proves the whole expression,
// threshold included, is valid and finds data. Label matchers inside {} and
// strings are left alone.
func withBool(expr string) string {
	var b strings.Builder
	depth := 0
	var quote byte
	for i := 0; i < len(expr); i++ {
		c := expr[i]
		b.WriteByte(c)
		switch {
		case quote != 0:
			if c == '\\' && i+1 < len(expr) {
				i++
				b.WriteByte(expr[i])
			} else if c == quote {
				quote = 0
			}
			continue
		case c == '"' || c == '\'' || c == '`':
			quote = c
			continue
		case c == '{':
			depth++
			continue
		case c == '}':
			depth--
			continue
		}
		if depth > 0 {
			continue
		}
		op := ""
		switch {
		case (c == '=' || c == '!' || c == '>' || c == '<') && i+1 < len(expr) && expr[i+1] == '=':
			op = string(c) + "="
		case c == '>' || c == '<':
			op = string(c)
		}
		if op == "" {
			continue
		}
		if len(op) == 2 {
			i++
			b.WriteByte(expr[i])
		}
		if !strings.HasPrefix(strings.TrimLeft(expr[i+1:], " \t\n"), "bool") {
			b.WriteString(" bool")
		}
	}
	return b.String()
}

func TestWithBool(t *testing.T) {
	f := func(in, want string) {
		t.Helper()
		if got := withBool(in); got != want {
			t.Errorf("withBool(%q) = %q, want %q", in, got, want)
		}
	}
	f(`a / b > 0.8`, `a / b > bool 0.8`)
	f(`up{job="kettle"} == 0`, `up{job="kettle"} == bool 0`)
	f(`x{route!="a>b", s=~"5.."} >= 1`, `x{route!="a>b", s=~"5.."} >= bool 1`)
	f(`a == 0 and on (job) b > 0`, `a == bool 0 and on (job) b > bool 0`)
	f(`a > bool 1`, `a > bool 1`)
	f(`rate(x[5m])`, `rate(x[5m])`)
}

// promAPI is a Prometheus HTTP API client.
type promAPI struct{ base string }

type apiResponse struct {
	Status    string          `json:"status"`
	ErrorType string          `json:"errorType"`
	Error     string          `json:"error"`
	Data      json.RawMessage `json:"data"`
}

func (p promAPI) get(path string, q url.Values) (apiResponse, error) {
	u := p.base + path
	if q != nil {
		u += "?" + q.Encode()
	}
	resp, err := http.Get(u)
	if err != nil {
		return apiResponse{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var r apiResponse
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("GET %s: %d %.200s", path, resp.StatusCode, b)
	}
	if r.Status != "success" {
		return r, fmt.Errorf("%s: %s", r.ErrorType, r.Error)
	}
	return r, nil
}

// query evaluates expr now and returns how many series it gave.
func (p promAPI) query(expr string) (int, error) {
	r, err := p.get("/api/v1/query", url.Values{"query": {expr}})
	if err != nil {
		return 0, err
	}
	var d struct {
		ResultType string            `json:"resultType"`
		Result     []json.RawMessage `json:"result"`
	}
	if err := json.Unmarshal(r.Data, &d); err != nil {
		return 0, err
	}
	if d.ResultType == "scalar" || d.ResultType == "string" {
		return 1, nil
	}
	return len(d.Result), nil
}

// check is one expression to evaluate.
type check struct {
	where string // panel, variable or alert
	expr  string
	// storeOnly: a metric only one store exports (kettle_pg_* on
	// PostgreSQL), or only a server with --tls-cert (kettle_tls_*, checked
	// by server.TestTLS) or --log (kettle_log_*, on a front or a writer,
	// checked by ./kafka's suite); against the plain SQLite server here it
	// must be valid, but may return nothing. So may the high-availability
	// topology's (patroni_*, haproxy_*; ha.TestHA scrapes them for real).
	storeOnly bool
}

func optional(expr string) bool {
	return strings.Contains(expr, "kettle_pg_") || strings.Contains(expr, "kettle_tls_") || strings.Contains(expr, "kettle_log_") ||
		strings.Contains(expr, "patroni_") || strings.Contains(expr, "haproxy_")
}

// TestAgainstPrometheus starts an instrumented kettle serve (SQLite, in this
// process), a metrics endpoint for the client side (metrics.Swarm) fed by a
// real HTTP client driving a burst of every kind of request, a real
// node_exporter (its textfile collector reading a kettle backup
// --metrics-file) and a real Prometheus running the shipped prometheus.yml
// (scrape and evaluation at 1 s, targets rewritten to this test's ports) and
// alerts.yml. Then it evaluates every PromQL expression of the dashboard
// (panels and variables, template variables substituted) and of the alert
// rules (as Prometheus loaded them, comparisons made bool, see withBool) over
// the HTTP API, and fails if one is invalid or returns no series. The
// PostgreSQL pool panels only need to be valid here (the server runs SQLite).
func TestAgainstPrometheus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Prometheus and node_exporter (~15 s); run without -short")
	}
	promBin := testkit.Tool(t, "prometheus", "prometheus")
	nodeBin := testkit.Tool(t, "prometheus-node-exporter", "prometheus-node-exporter", "node_exporter")

	// The system under observation, and traffic.
	const queue = 64
	k := metricstest.Start(t, queue)
	sw := metrics.NewSwarm(prometheus.NewRegistry())
	swl, err := metrics.Listen("127.0.0.1:0", sw.Handler())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { swl.Close() })
	c := &metricstest.Client{Base: k.URL, Swarm: sw, HTTP: &http.Client{Timeout: 10 * time.Second}}
	if err := c.Register(20); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			start := time.Now()
			c.Round(queue)
			sw.SetActive(len(c.Devices))
			sw.SetLag(time.Since(start) / 100)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })

	// kettle backup --metrics-file's gauges, through the textfile collector.
	textDir := t.TempDir()
	err = metrics.WriteBackupFile(filepath.Join(textDir, "kettle_backup.prom"),
		metrics.Backup{At: time.Now(), Took: 6 * time.Second, Bytes: 600 << 20, Measurements: 6_000_000})
	if err != nil {
		t.Fatal(err)
	}
	nodeAddr := testkit.FreeAddr(t)
	testkit.Start(t, nodeBin, "--web.listen-address="+nodeAddr, "--collector.textfile.directory="+textDir)

	// The shipped configuration, pointed at this test's ports.
	dir := t.TempDir()
	cfg, err := os.ReadFile("prometheus/prometheus.yml")
	if err != nil {
		t.Fatal(err)
	}
	s := string(cfg)
	for _, r := range [][2]string{
		{"scrape_interval: 5s", "scrape_interval: 1s"},
		{"evaluation_interval: 5s", "evaluation_interval: 1s"},
		{"scrape_timeout: 4s", "scrape_timeout: 1s"},
		{"'127.0.0.1:8080'", "'" + strings.TrimPrefix(k.URL, "http://") + "'"},
		{"'127.0.0.1:9101'", "'" + swl.Addr() + "'"},
		{"'127.0.0.1:9100'", "'" + nodeAddr + "'"},
	} {
		if strings.Count(s, r[0]) != 1 {
			t.Fatalf("prometheus/prometheus.yml no longer has exactly one %q: update this test", r[0])
		}
		s = strings.Replace(s, r[0], r[1], 1)
	}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	alerts, err := os.ReadFile("prometheus/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "alerts.yml"), alerts, 0o644); err != nil {
		t.Fatal(err)
	}
	promAddr := testkit.FreeAddr(t)
	testkit.Start(t, promBin,
		"--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+promAddr,
		"--log.level=warn")
	api := promAPI{base: "http://" + promAddr}

	// Ready, every target up, every rule loaded.
	deadline := time.Now().Add(45 * time.Second)
	wantRules := strings.Count(string(alerts), "- alert:")
	var rules []check
	for {
		if time.Now().After(deadline) {
			t.Fatalf("Prometheus not ready with every target up and %d rules loaded", wantRules)
		}
		time.Sleep(300 * time.Millisecond)
		r, err := api.get("/api/v1/targets", nil)
		if err != nil {
			continue
		}
		var targets struct {
			ActiveTargets []struct {
				Labels    map[string]string `json:"labels"`
				Health    string            `json:"health"`
				LastError string            `json:"lastError"`
			} `json:"activeTargets"`
		}
		json.Unmarshal(r.Data, &targets)
		up, n := 0, 0
		for _, tg := range targets.ActiveTargets {
			// The HA topology's jobs (Patroni, HAProxy) are not running
			// here: ha.TestHA reads their metrics.
			if j := tg.Labels["job"]; j == "patroni" || j == "haproxy" {
				continue
			}
			n++
			if tg.Health == "up" {
				up++
			}
		}
		if n != 3 || up != 3 {
			continue
		}
		r, err = api.get("/api/v1/rules", nil)
		if err != nil {
			continue
		}
		var rs struct {
			Groups []struct {
				Rules []struct {
					Name      string `json:"name"`
					Query     string `json:"query"`
					Health    string `json:"health"`
					LastError string `json:"lastError"`
				} `json:"rules"`
			} `json:"groups"`
		}
		json.Unmarshal(r.Data, &rs)
		rules = rules[:0]
		healthy := true
		for _, g := range rs.Groups {
			for _, rule := range g.Rules {
				if rule.LastError != "" || rule.Health == "err" {
					t.Fatalf("alert %s: %s", rule.Name, rule.LastError)
				}
				healthy = healthy && rule.Health == "ok"
				rules = append(rules, check{where: "alert " + rule.Name, expr: withBool(rule.Query), storeOnly: optional(rule.Query)})
			}
		}
		if len(rules) == wantRules && healthy {
			break
		}
	}

	// Every expression of the dashboard and the alerts.
	checks := rules
	d := loadDashboard(t)
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			e, err := substitute(tg.Expr)
			if err != nil {
				t.Fatalf("panel %q: %v", p.Title, err)
			}
			checks = append(checks, check{where: fmt.Sprintf("panel %q %s", p.Title, tg.RefID), expr: e, storeOnly: optional(e)})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Fatalf("variable %s: %q is not label_values(metric, label)", v.Name, v.Definition)
		}
		checks = append(checks, check{where: "variable " + v.Name, expr: fmt.Sprintf("group by (%s) (%s)", m[2], m[1])})
	}

	// Rates need two scrapes with traffic between them: retry what is empty
	// until the deadline; an invalid expression fails at once.
	pending := checks
	for len(pending) > 0 && time.Now().Before(deadline) {
		var still []check
		for _, ch := range pending {
			n, err := api.query(ch.expr)
			if err != nil {
				t.Fatalf("%s: invalid PromQL: %v\n  %s", ch.where, err, ch.expr)
			}
			if n == 0 && !ch.storeOnly {
				still = append(still, ch)
			}
		}
		pending = still
		if len(pending) > 0 {
			time.Sleep(time.Second)
		}
	}
	for _, ch := range pending {
		t.Errorf("%s: no series\n  %s", ch.where, ch.expr)
	}
	if t.Failed() {
		t.Fatalf("%d of %d expressions returned no series", len(pending), len(checks))
	}
	t.Logf("%d expressions (%d alerts, %d dashboard) valid and non-empty against Prometheus", len(checks), len(rules), len(checks)-len(rules))
}
