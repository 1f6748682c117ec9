// Package systemd holds kettlefleet's systemd units (kettle.service,
// kettle-writer.service, kettle-swarm-worker.service). Its tests check them
// with systemd-analyze verify and run each unit's ExecStart as systemd would:
// its environment, its credentials directory, its state directory, an
// unprivileged user and a notify socket that must receive READY=1 and, on
// SIGTERM, STOPPING=1.
package systemd
