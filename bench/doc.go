// Package bench holds the benchmark scripts, bench/*.sh, and the commands
// they build (bench/pgbench, bench/mqttpub, …). Its tests keep the scripts
// running and documented: each runs in its smoke mode (SMOKE=1: tiny sizes,
// seconds, its record checked but not written) in `make test`.
package bench
