#!/usr/bin/env python3
"""CPU seconds so far (user + system) of each process of a deploy/cluster.sh
topology, with its children, as one JSON object on stdout; used before and
after a run by bench/ha-sync.sh and bench/sizing.sh.

    python3 bench/lib/topo_cpu.py KETTLE_HA_DIR

Keys: kettleN (the node and its children), patroniN (the Patroni daemon
alone), postgresN (the postmaster and every backend, walsender and worker
under it), etcdN; and kettleN_rss_bytes, the node's resident memory.
"""
import json
import os
import sys


def stat(pid):
    s = open(f"/proc/{pid}/stat").read()
    f = s[s.rindex(")") + 2:].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main(d):
    procs = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                procs[int(p)] = stat(p)
            except (OSError, ValueError, IndexError):
                pass

    def tree(root):
        total, todo = 0.0, [root]
        while todo:
            r = todo.pop()
            if r in procs:
                total += procs[r][1]
            todo += [p for p, (pp, _) in procs.items() if pp == r]
        return total

    out = {}
    names = [f"kettle{i}" for i in range(1, 10)] + ["pg1", "pg2", "pg3", "etcd1", "etcd2", "etcd3"]
    for name in names:
        try:
            pid = int(open(f"{d}/{name}.pid").read())
        except (OSError, ValueError):
            continue
        if name.startswith("pg"):
            out["patroni" + name[2:]] = procs.get(pid, (0, 0))[1]
            try:
                pm = int(open(f"{d}/{name}/data/postmaster.pid").readline())
                out["postgres" + name[2:]] = tree(pm)
            except (OSError, ValueError):
                pass
            continue
        out[name] = tree(pid)
        if name.startswith("kettle"):
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        out[name + "_rss_bytes"] = int(line.split()[1]) * 1024
            except OSError:
                pass
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
