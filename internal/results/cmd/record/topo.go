package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of /proc/PID/stat's CPU times: 100 on
// every Linux architecture Go runs on.
const clockTicks = 100

type proc struct {
	ppid int
	cpu  float64 // user + system seconds
}

// procs reads every process's parent and CPU seconds from /proc.
func procs() map[int]proc {
	out := map[int]proc{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		u, _ := strconv.ParseFloat(f[11], 64)
		k, _ := strconv.ParseFloat(f[12], 64)
		out[pid] = proc{ppid: ppid, cpu: (u + k) / clockTicks}
	}
	return out
}

// tree is the CPU seconds of root and every process under it.
func tree(ps map[int]proc, root int) float64 {
	children := map[int][]int{}
	for pid, p := range ps {
		children[p.ppid] = append(children[p.ppid], pid)
	}
	total, todo := 0.0, []int{root}
	for len(todo) > 0 {
		r := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		total += ps[r].cpu
		todo = append(todo, children[r]...)
	}
	return total
}

func pidFile(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	return pid, err == nil
}

// topoCPU prints, as one JSON object, the CPU seconds so far of each process
// of a deploy/cluster.sh topology in dir (its NAME.pid files): kettleN (the
// node and its children) with kettleN_rss_bytes, patroniN (the daemon
// alone), postgresN (the postmaster and every backend under it), etcdN.
// bench/ha-sync.sh and bench/sizing.sh read it before and after a run.
func topoCPU(dir string, w io.Writer) error {
	ps := procs()
	out := map[string]float64{}
	names := []string{"pg1", "pg2", "pg3", "etcd1", "etcd2", "etcd3"}
	for i := 1; i <= 9; i++ {
		names = append(names, fmt.Sprintf("kettle%d", i))
	}
	for _, name := range names {
		pid, ok := pidFile(filepath.Join(dir, name+".pid"))
		if !ok {
			continue
		}
		if n, ok := strings.CutPrefix(name, "pg"); ok {
			out["patroni"+n] = ps[pid].cpu
			if pm, ok := pidFile(filepath.Join(dir, name, "data", "postmaster.pid")); ok {
				out["postgres"+n] = tree(ps, pm)
			}
			continue
		}
		out[name] = tree(ps, pid)
		if strings.HasPrefix(name, "kettle") {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
				for _, line := range strings.Split(string(b), "\n") {
					if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
						kib, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
						out[name+"_rss_bytes"] = kib * 1024
					}
				}
			}
		}
	}
	return json.NewEncoder(w).Encode(out)
}
