package deploy_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// machines is one deploy/cluster.sh topology in netns mode, named by its
// own prefix and address block so it never meets another on this host.
type machines struct {
	testkit.Cluster
	prefix string
	net    string
	dir    string
}

func newMachines(t *testing.T, prefix, net string, extraEnv ...string) *machines {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("deploy/cluster.sh's netns mode needs root (network namespaces, a bridge, mounts)")
	}
	for _, bin := range []string{"ip", "nft", "tc", "findmnt", "losetup"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s not found: make deps (deploy/deps/machines.sh)", bin)
		}
	}
	// Short: PostgreSQL's socket path must fit in 107 bytes.
	dir, err := os.MkdirTemp("/tmp", prefix+"-")
	if err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "KETTLE_HA_MODE=netns", "KETTLE_HA_PREFIX="+prefix, "KETTLE_HA_NET="+net, "KETTLE_HA_DIR="+dir)
	m := &machines{Cluster: testkit.Cluster{T: t, Env: append(env, extraEnv...)}, prefix: prefix, net: net, dir: dir}
	if left := m.leftovers(); len(left) > 0 {
		t.Fatalf("the system already holds objects named %s-: %q (deploy/cluster.sh down with KETTLE_HA_PREFIX=%s)", prefix, left, prefix)
	}
	return m
}

func (m *machines) addr(last int) string { return fmt.Sprintf("%s.%d", m.net, last) }

// leftovers lists what the system still holds of this prefix: namespaces,
// links, mounts, loop devices, the nftables table.
func (m *machines) leftovers() []string {
	m.T.Helper()
	var left []string
	for _, c := range [][]string{
		{"ip", "netns", "list"},
		{"ip", "-o", "link", "show"},
		{"findmnt", "-rn", "-o", "TARGET,SOURCE,FSTYPE,LABEL"},
		{"losetup", "-a"},
		{"nft", "list", "tables"},
	} {
		out, err := exec.Command(c[0], c[1:]...).CombinedOutput()
		if err != nil {
			m.T.Fatalf("%s: %v\n%s", strings.Join(c, " "), err, out)
		}
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, m.prefix+"-") || strings.TrimSpace(l) == "table bridge "+m.prefix {
				left = append(left, c[0]+" "+c[1]+": "+strings.TrimSpace(l))
			}
		}
	}
	return left
}

// killAll SIGKILLs every process in the prefix's namespaces, as a power cut.
func (m *machines) killAll() int {
	m.T.Helper()
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		m.T.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || !strings.HasPrefix(f[0], m.prefix+"-") {
			continue
		}
		pids, _ := exec.Command("ip", "netns", "pids", f[0]).Output()
		for _, p := range strings.Fields(string(pids)) {
			var pid int
			fmt.Sscan(p, &pid)
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				n++
			}
		}
	}
	return n
}

// downClean runs down and fails for anything left.
func (m *machines) downClean(what string) {
	m.T.Helper()
	if out, err := m.Run(3*time.Minute, "down"); err != nil {
		m.T.Errorf("deploy/cluster.sh down %s: %v\n%s", what, err, out)
	}
	if left := m.leftovers(); len(left) > 0 {
		m.T.Errorf("deploy/cluster.sh down %s left:\n  %s", what, strings.Join(left, "\n  "))
	}
	if _, err := os.Stat(m.dir); err == nil {
		m.T.Errorf("deploy/cluster.sh down %s left %s", what, m.dir)
	}
}

// inNS runs a command in member's machine.
func (m *machines) inNS(member string, args ...string) (string, error) {
	out, err := exec.Command("ip", append([]string{"netns", "exec", m.prefix + "-" + member}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

var quick = &http.Client{Timeout: time.Second}

func get(url string) (int, error) { return getWith(quick, url) }

func getWith(c *http.Client, url string) (int, error) {
	r, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	r.Body.Close()
	return r.StatusCode, nil
}

// members is a client of the members' HTTPS (Patroni's REST API), trusting
// the topology's CA (plain HTTP with KETTLE_HA_TLS=0).
func (m *machines) members() (*http.Client, string) {
	if os.Getenv("KETTLE_HA_TLS") == "0" {
		return quick, "http"
	}
	pool := x509.NewCertPool()
	if pem, err := os.ReadFile(filepath.Join(m.dir, "tls", "ca.crt")); err != nil || !pool.AppendCertsFromPEM(pem) {
		m.T.Fatalf("the topology's CA: %v", err)
	}
	return &http.Client{Timeout: time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}, "https"
}

// etcdHealth is curl's command line for etcd1's /health from a machine,
// with this host's client certificate (etcd asks every client for one).
func (m *machines) etcdHealth() []string {
	_, scheme := m.members()
	return append(append([]string{"curl", "-fsS", "-m", "1"}, strings.Fields(m.Must(10*time.Second, "tls-args"))...), scheme+"://"+m.addr(1)+":2379/health")
}

// patroniView is what member i's Patroni says of the cluster: the leader's
// name ("" for none) or an error.
func (m *machines) patroniView(i int) (string, error) {
	hc, scheme := m.members()
	r, err := hc.Get(fmt.Sprintf("%s://%s:8008/cluster", scheme, m.addr(10+i)))
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	var c struct {
		Members []struct{ Name, Role, State string }
	}
	if err := json.NewDecoder(r.Body).Decode(&c); err != nil {
		return "", err
	}
	for _, mb := range c.Members {
		if mb.Role == "leader" {
			return mb.Name, nil
		}
	}
	return "", nil
}

// TestMachines brings the whole topology up in netns mode (etcd × 3,
// PostgreSQL × 3 under Patroni, a kettle node, HAProxy, Toxiproxy on the
// links), checks that every member is a machine of its own, isolates the
// PostgreSQL primary and sees etcd and Patroni take it for gone (a new
// leader; the old one no longer primary), heals (it reaches etcd again), tries the pause, disk and
// latency verbs for their effect, then kills every process of every machine
// and checks that down leaves nothing behind.
func TestMachines(t *testing.T) {
	if os.Getenv("KETTLE_HA_LONG") == "" {
		// make test keeps TestDownAfterKill (the namespaces, disks and
		// their cleanup); the whole topology with its faults takes minutes
		// on two cores and runs in make chaos.
		t.Skip("KETTLE_HA_LONG: the whole topology on machines, a partition, pause, disk and latency (minutes; make chaos's machines part)")
	}
	bin, err := testkit.BuildKettle(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	m := newMachines(t, "kft", "198.18.16", "KETTLE_BIN="+bin, "KETTLE_HA_NODES=1", "KETTLE_HA_SERVE_ARGS=--access-log-sample 0")
	cleaned := false
	t.Cleanup(func() {
		if !cleaned {
			m.Run(3*time.Minute, "down")
		}
	})
	start := time.Now()
	m.Must(4*time.Minute, "up")
	t.Logf("figure: machines_up = %.1f s", time.Since(start).Seconds())

	// Every member a machine: one address on its link, no way out of the bridge.
	for _, mb := range []struct {
		name string
		last int
		disk bool
	}{{"etcd1", 1, true}, {"etcd2", 2, true}, {"etcd3", 3, true}, {"pg1", 11, true}, {"pg2", 12, true}, {"pg3", 13, true}, {"kettle1", 21, true}, {"haproxy", 30, false}} {
		out, err := m.inNS(mb.name, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
		if err != nil || strings.Count(out, " inet ") != 1 || !strings.Contains(out, " inet "+m.addr(mb.last)+"/24 ") {
			t.Errorf("%s: eth0 should hold %s/24 alone: %v %s", mb.name, m.addr(mb.last), err, out)
		}
		if out, err := m.inNS(mb.name, "ip", "route", "get", "192.0.2.1"); err == nil {
			t.Errorf("%s reaches beyond the bridge: %s", mb.name, out)
		}
		if out, err := m.inNS(mb.name, "ip", "-o", "link", "show", "dev", "lo"); err != nil || !strings.Contains(out, "UP") {
			t.Errorf("%s: loopback not up: %v %s", mb.name, err, out)
		}
		if mb.disk {
			dir := filepath.Join(m.dir, mb.name)
			out, err := exec.Command("findmnt", "-n", "-o", "FSTYPE,SOURCE", dir).Output()
			if err != nil || !strings.Contains(string(out), "tmpfs") || !strings.Contains(string(out), "kft-"+mb.name) {
				t.Errorf("%s: %s is not a tmpfs of its own: %v %s", mb.name, dir, err, out)
			}
		}
	}

	// Through HAProxy on its machine and Toxiproxy's link to the node: over
	// TLS (the topology's CA), and MQTT with the kettle's address carried
	// in PROXY protocol v2 to the node's log.
	if c, scheme := m.members(); scheme == "https" {
		if code, err := getWith(c, "https://"+m.addr(30)+":8443/healthz"); err != nil || code != 200 {
			t.Errorf("HTTPS through HAProxy: %d %v", code, err)
		}
	}
	secret, err := os.ReadFile(filepath.Join(m.dir, "secret"))
	if err != nil {
		t.Fatal(err)
	}
	host := m.addr(254)
	mqttThrough(t, m.addr(30)+":1883", strings.TrimSpace(string(secret)), host, host, func(from string) bool {
		b, _ := os.ReadFile(filepath.Join(m.dir, "kettle1.log"))
		return strings.Contains(string(b), "mqtt: connection refused") && strings.Contains(string(b), "remote="+from+":")
	})

	// Isolate the primary: its Patroni loses etcd, etcd's and Patroni's
	// majority elect another.
	old := m.Must(30*time.Second, "leader")
	var oi int
	fmt.Sscanf(old, "pg%d", &oi)
	other := oi%3 + 1
	isolated := time.Now()
	m.Must(30*time.Second, "isolate", old)
	if out, err := m.inNS(old, m.etcdHealth()...); err == nil {
		t.Fatalf("%s, isolated, still reaches etcd1: %s", old, out)
	}
	if out, err := m.inNS(fmt.Sprintf("pg%d", other), m.etcdHealth()...); err != nil {
		t.Fatalf("pg%d, not isolated, does not reach etcd1: %v %s", other, err, out)
	}
	var now string
	testkit.WaitFor(t, "a new leader after isolating "+old, 90*time.Second, func() bool {
		l, err := m.patroniView(other)
		now = l
		return err == nil && l != "" && l != old
	})
	t.Logf("figure: isolated_primary_replaced = %.1f s (%s → %s)", time.Since(isolated).Seconds(), old, now)
	testkit.WaitFor(t, old+" no longer primary", 60*time.Second, func() bool {
		c, scheme := m.members()
		code, err := getWith(c, fmt.Sprintf("%s://%s:8008/primary", scheme, m.addr(10+oi)))
		return err == nil && code != 200
	})
	if f := m.Must(10*time.Second, "faults"); !strings.Contains(f, "isolate "+old) {
		t.Errorf("faults does not list the isolation:\n%s", f)
	}
	m.Must(30*time.Second, "heal")
	// Healed: the old primary reaches etcd again. Its rejoin is not waited
	// for: cut from the nodes too, its fast shutdown waits for backends
	// blocked sending to clients it cannot reach, and for its walsenders'
	// timeout, minutes.
	testkit.WaitFor(t, old+" reaching etcd after heal", 10*time.Second, func() bool {
		_, err := m.inNS(old, m.etcdHealth()...)
		return err == nil
	})
	if f := m.Must(10*time.Second, "faults"); strings.Contains(f, "isolate") {
		t.Errorf("faults after heal:\n%s", f)
	}

	// pause: the node stops answering, resume: it answers again.
	node := "http://" + m.addr(21) + ":8080/healthz"
	m.Must(10*time.Second, "pause", "kettle1")
	if code, err := get(node); err == nil {
		t.Errorf("kettle1 paused answered %d", code)
	}
	m.Must(10*time.Second, "resume", "kettle1")
	testkit.WaitFor(t, "kettle1 answering after resume", 10*time.Second, func() bool { code, _ := get(node); return code == 200 })

	// fill-disk: nothing left on kettle1's filesystem; free-disk gives it back.
	var st syscall.Statfs_t
	m.Must(30*time.Second, "fill-disk", "kettle1")
	if err := syscall.Statfs(filepath.Join(m.dir, "kettle1"), &st); err != nil || st.Bavail != 0 {
		t.Errorf("after fill-disk kettle1: %d blocks free (%v)", st.Bavail, err)
	}
	m.Must(10*time.Second, "free-disk", "kettle1")
	if err := syscall.Statfs(filepath.Join(m.dir, "kettle1"), &st); err != nil || st.Bavail*uint64(st.Bsize) < 200<<20 {
		t.Errorf("after free-disk kettle1: %d blocks free (%v)", st.Bavail, err)
	}

	// toxic: balancer→node latency, both ways, on every request through HAProxy.
	lb := "http://" + m.addr(30) + ":8080/healthz"
	took := func() time.Duration {
		s := time.Now()
		if code, err := get(lb); err != nil || code != 200 {
			t.Fatalf("GET %s: %d %v", lb, code, err)
		}
		return time.Since(s)
	}
	m.Must(10*time.Second, "toxic", "lb", "latency", "300", "0")
	if d := took(); d < 550*time.Millisecond {
		t.Errorf("with 300 ms each way on balancer→node a request took %s", d)
	}
	m.Must(10*time.Second, "untoxic")
	if d := took(); d > 250*time.Millisecond {
		t.Errorf("untoxic: a request still took %s", d)
	}

	// slow: tbf on the link, listed, gone with heal.
	m.Must(10*time.Second, "slow", "haproxy", "1mbit")
	if f := m.Must(10*time.Second, "faults"); !strings.Contains(f, "slow haproxy 1Mbit") {
		t.Errorf("faults does not list the slow link:\n%s", f)
	}
	m.Must(30*time.Second, "heal")
	if f := m.Must(10*time.Second, "faults"); f != "" {
		t.Errorf("faults after heal:\n%s", f)
	}

	// A power cut: every process of every machine killed, then down.
	if n := m.killAll(); n < 10 {
		t.Fatalf("killed %d processes, want the whole topology's", n)
	}
	cleaned = true
	m.downClean("after every member was killed")
}

// TestDownAfterKill kills deploy/cluster.sh up (ext4 disks on loop devices)
// and every process it had started, and checks that down still finds and
// removes every namespace, link, mount and loop device.
func TestDownAfterKill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd in network namespaces; run without -short")
	}
	m := newMachines(t, "kfk", "198.18.24", "KETTLE_HA_FS=ext4", "KETTLE_HA_NODES=0", "KETTLE_HA_DISK_PG=64M")
	cleaned := false
	t.Cleanup(func() {
		if !cleaned {
			m.Run(3*time.Minute, "down")
		}
	})
	up := m.Command(context.Background(), "up")
	up.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := up.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { up.Wait(); close(done) }()
	// Patroni started: etcd's three machines and pg1's exist, disks mounted.
	// The bound is generous: on a loaded machine etcd's three members and
	// initdb take minutes, and the test is about what down finds, not speed.
	testkit.WaitFor(t, "pg1's Patroni running", 4*time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(m.dir, "pg1.pid"))
		return err == nil
	})
	// a fault in force too: the nftables table
	m.Must(30*time.Second, "partition", "etcd1", "etcd2,etcd3")
	syscall.Kill(-up.Process.Pid, syscall.SIGKILL)
	<-done
	if n := m.killAll(); n < 3 {
		t.Fatalf("killed %d processes in the machines, want etcd × 3 and Patroni at least", n)
	}
	left := strings.Join(m.leftovers(), "\n")
	for _, want := range []string{"ip netns: kfk-etcd1", "ip -o: ", "findmnt -rn: ", "losetup -a: ", "nft list: table bridge kfk"} {
		if !strings.Contains(left, want) {
			t.Fatalf("before down, no %q among the leftovers:\n%s", want, left)
		}
	}
	cleaned = true
	m.downClean("after up and its members were killed")
}
