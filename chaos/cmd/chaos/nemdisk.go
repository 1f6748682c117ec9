package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kettlefleet/kettlefleet/chaos/nemesis"
	"github.com/kettlefleet/kettlefleet/sim"
)

func init() {
	parts = append(parts, part{"nem-sqlite-disk-full", "10d. A single node's SQLite disk full (30 s), then freed", partSQLiteDiskFull})
}

// fillActor fills and frees one filesystem: the nemesis's fill-disk and
// free-disk for a node of its own (no topology).
type fillActor struct{ file string }

func (a fillActor) Do(ctx context.Context, args ...string) error {
	switch args[0] {
	case "fill-disk":
		f, err := os.OpenFile(a.file, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			return err
		}
		defer f.Close()
		buf := make([]byte, 1<<20)
		for {
			if _, err := f.Write(buf); err != nil {
				if errors.Is(err, syscall.ENOSPC) {
					return nil
				}
				return err
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
	case "free-disk":
		return os.Remove(a.file)
	}
	return fmt.Errorf("%s: not a verb of this node", args[0])
}

func (fillActor) Resolve(context.Context, string) ([]string, error) {
	return nil, errors.New("no topology")
}

// partSQLiteDiskFull: kettle serve on SQLite whose data directory is a
// 64 MiB tmpfs; 20 s into a swarm the filesystem is filled to ENOSPC, 30 s
// later freed. Uploads must be refused (503, never a 500), polls answered,
// ingest resume after the free, and the audit find nothing lost.
func partSQLiteDiskFull(ctx context.Context, e *env) *Result {
	const d = 90 * time.Second
	r := &Result{Pass: true, Command: "go run ./chaos/cmd/chaos nem-sqlite-disk-full",
		Done: fmt.Sprintf("kettle serve on SQLite, its data directory a 64 MiB tmpfs; kettle swarm 200 HTTP v1 kettles every 2 s for %s; "+
			"the filesystem filled to ENOSPC from +20 s to +50 s (a file written until the kernel refuses), then removed; the swarm's audit", d)}
	dir, err := os.MkdirTemp("", "knem-sqlite-")
	if err != nil {
		return r.fail("%v", err)
	}
	defer os.RemoveAll(dir)
	mnt := filepath.Join(dir, "data")
	os.Mkdir(mnt, 0o755)
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "knem-sqlite", mnt).CombinedOutput(); err != nil {
		return r.fail("mount a 64 MiB tmpfs (needs root): %v %s", err, out)
	}
	defer exec.Command("umount", "-l", mnt).Run()
	addr, err := freeAddr()
	if err != nil {
		return r.fail("%v", err)
	}
	srv, err := startServe(ctx, e, addr, mnt, "sqlite:"+filepath.Join(mnt, "kettle.db"), filepath.Join(dir, "serve.log"))
	if err != nil {
		return r.fail("kettle serve: %v", err)
	}
	defer srv.stop()
	out := filepath.Join(e.out, "nem-sqlite-disk-full")
	os.RemoveAll(out)
	sw, err := startSwarm(e, srv.url, out, "--api", "v1", "--devices", "200", "--interval", "2s", "--duration", d.String(), "--hatch-rate", "0", "--data-dir", mnt)
	if err != nil {
		return r.fail("swarm: %v", err)
	}
	s := &nemesis.Schedule{Duration: d, HealedBy: d, Faults: []nemesis.Fault{fault(nemesis.Disk, "the node's SQLite disk full", 20*time.Second, 50*time.Second,
		[]string{"fill-disk", "node"}, []string{"free-disk", "node"})}}
	iv := nemesis.Run(ctx, s, sw.started, fillActor{filepath.Join(mnt, "kettle-fill")}, e.logf)
	res, _, err := sw.wait(ctx, d+5*time.Minute)
	v := nemesis.Verdict{Pass: true}
	v.Add(nemesis.Faults(iv))
	if err != nil {
		v.Add(nemesis.Check{Name: "the swarm ends with its results", Detail: err.Error()})
	} else {
		results := map[string]*sim.Results{"http-v1": res}
		v.Add(nemesis.Audits(results)[0])
		for _, c := range judgeDiskFull(true, iv, results) {
			v.Add(c)
		}
		v.Costs = nemesis.Costs(iv, results)
		if err := writeFaults(out, res, iv); err != nil {
			e.logf("%v", err)
		}
	}
	if !srv.alive() {
		v.Add(nemesis.Check{Name: "the node survives", Detail: "kettle serve exited: " + tail(srv.logPath, 3)})
	}
	return judged(r, v, "SQLite disk full: uploads refused, polls answered, ingest resumed after the free, 0 lost")
}
