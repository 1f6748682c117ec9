// Package deploy holds kettlefleet's shipped monitoring configuration —
// prometheus/ (scrape config, alert rules and their unit tests) and grafana/
// (the dashboard and provisioning files) — and the tests that prove it: the
// promtool checks, and every dashboard and alert expression evaluated against
// a real Prometheus scraping a real, instrumented kettle serve. It also holds
// the high-availability topology (etcd/, patroni/, haproxy/, cluster.sh),
// tested by package ha. See README.md.
package deploy
