// Package ha holds the tests of kettlefleet's high-availability topology:
// deploy/cluster.sh brings up etcd × 3, PostgreSQL × 3 under Patroni
// (synchronous replication), two kettle serve nodes and HAProxy on
// 127.0.44.x, from the files in deploy/ used unchanged; the tests run
// `kettle swarm` (v1 and v0) through HAProxy while they kill the primary,
// switch it over, lose standbys and restart nodes, and judge what the
// kettles saw and what the store holds (the swarm's audit).
//
// `go test ./ha/` runs the unplanned failover (about 2 minutes) and, on a
// topology of its own, case-study kettles that are not ours logging in and
// sending at once through HAProxy, in steady state and through a failover
// (TestV0LoginRoundRobin: no 401 to a kettle the fleet registered);
// KETTLE_HA_LONG=1 (make chaos: `go run ./chaos/cmd/chaos failover`) adds
// the planned switchover, the rolling restart and the kill of a node, the
// loss of standbys, and runs the swarm longer. Every figure is logged as a
// line "figure: NAME = VALUE UNIT" for the chaos part to collect.
package ha
