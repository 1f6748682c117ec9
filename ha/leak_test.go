package ha_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/kettlefleet/kettlefleet/internal/leaktest"
)

// byDesign are the topology's files that hold a secret because that is
// where it lives: the secrets' own files, the configuration an engine reads
// its password from (Patroni's, HAProxy's, each 0600) and the passfile
// Patroni writes for its replication connections; Kafka's users' password
// and client properties files.
var byDesign = regexp.MustCompile(`(^|/)(password|operator-token|secret|haproxy\.cfg|pg[1-3]\.yml|pgpass|users/[^/]+)$`)

// checkNoLeaks searches the running topology for its secrets — every
// database role's password (also the HAProxy stats page's), the operator
// token and the device secret: every file under its directory but byDesign
// (members' logs, HAProxy's log, the data directories, the swarms' results),
// every process's argv, and the answers of the nodes' /metrics, /readyz and
// /healthz, HAProxy's stats page and exporter, and Patroni's REST API.
// extra are more secrets (Kafka's users' passwords), dirs more directories
// to search (the brokers').
func checkNoLeaks(t *testing.T, tp *topo, extra leaktest.Secrets, dirs ...string) {
	t.Helper()
	s := leaktest.Secrets{"database password": tp.pw, "operator token": tp.readFile("operator-token"), "device secret": tp.readFile("secret")}
	for k, v := range extra {
		s[k] = v
	}
	c := leaktest.Corpus{}
	for i := 1; i <= 2; i++ {
		for _, p := range []string{"/metrics", "/readyz", "/healthz", "/debug/pprof/cmdline"} {
			c.Get(http.DefaultClient, fmt.Sprintf("http://%s.2%d:8080%s", haNet, i, p))
		}
	}
	c.Get(http.DefaultClient, "http://"+haNet+".30:8404/stats", func(r *http.Request) { r.SetBasicAuth("kettle", tp.pw) })
	c.Get(http.DefaultClient, "http://"+haNet+".30:8404/metrics")
	for i := 1; i <= 3; i++ {
		for _, p := range []string{"/patroni", "/cluster", "/config", "/metrics"} {
			c.Get(tp.client(), patroni(i, p))
		}
	}
	c.Argv()
	c.Check(t, s, 20)
	// The members' directories one at a time: data directories are large.
	for _, dir := range append([]string{tp.dir}, dirs...) {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			fc := leaktest.Corpus{}
			fc.Files(filepath.Join(dir, e.Name()), func(p string) bool { return byDesign.MatchString(p) })
			fc.Check(t, s, 0)
		}
	}
}
