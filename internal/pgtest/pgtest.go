// Package pgtest gives tests a throwaway PostgreSQL: one cluster per test
// binary, started from the installed binaries on first use and removed when
// the binary ends, and one fresh database per caller so tests stay
// independent.
//
// A test package that uses it declares
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// and each test calls dsn := pgtest.Start(t).
//
// With KETTLE_TEST_PG_DSN set (an account allowed to CREATE DATABASE), the
// databases are created on that server instead and no cluster is started.
// Missing binaries fail the test, never skip it: CI installs them with
// `apt-get install -y postgresql`.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet/internal/pgbin"
	"github.com/kettlefleet/kettlefleet/internal/redact"
)

// EnvDSN names the environment variable that points the tests at an existing
// server instead of a throwaway cluster.
const EnvDSN = "KETTLE_TEST_PG_DSN"

var (
	inMain   atomic.Bool
	once     sync.Once
	shared   *Cluster
	sharedEr error
	dbSeq    atomic.Int64
)

// Main runs the tests of m and then stops and removes the cluster, if one was
// started. Call it from TestMain.
func Main(m *testing.M) { os.Exit(Run(m)) }

// Run is Main for a TestMain with its own cleanup after the tests: it runs
// them, removes the cluster if one was started and returns the exit code
// for os.Exit.
func Run(m *testing.M) int {
	inMain.Store(true)
	code := m.Run()
	if shared != nil {
		if err := shared.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		}
	}
	return code
}

// Start returns the DSN of a new, empty database for the calling test. The
// database is dropped when the test ends.
func Start(t testing.TB) string {
	t.Helper()
	admin := os.Getenv(EnvDSN)
	if admin == "" {
		if !inMain.Load() {
			t.Fatal("pgtest: the cluster would outlive the test binary; add `func TestMain(m *testing.M) { pgtest.Main(m) }` to this package")
		}
		once.Do(func() { shared, sharedEr = StartCluster() })
		if sharedEr != nil {
			t.Fatal(sharedEr)
		}
		admin = shared.DSN("postgres")
	}
	name := fmt.Sprintf("kt_%d_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6, dbSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatalf("pgtest: connect %s: %v", redact.DSN(admin), err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name+" TEMPLATE template0"); err != nil {
		t.Fatalf("pgtest: create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, admin)
		if err != nil {
			t.Logf("pgtest: drop database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Logf("pgtest: drop database %s: %v", name, err)
		}
	})
	return withDatabase(admin, name)
}

// withDatabase returns dsn (URL or keyword/value form) naming database db.
func withDatabase(dsn, db string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		if u, err := url.Parse(dsn); err == nil {
			u.Path = "/" + db
			return u.String()
		}
	}
	return dsn + " dbname=" + db // a later keyword wins
}

// Cluster is a PostgreSQL cluster in a temporary directory, reachable only
// through a Unix socket in that directory. It trusts every local connection.
type Cluster struct {
	Dir  string // data in Dir/data, socket and log in Dir
	cmd  *exec.Cmd
	done chan error
}

// DSN returns a keyword/value DSN for database db of the cluster.
func (c *Cluster) DSN(db string) string {
	return fmt.Sprintf("host=%s port=5432 user=postgres dbname=%s sslmode=disable", c.Dir, db)
}

// BinDir finds the PostgreSQL server binaries: the directory of initdb on
// PATH, else the newest /usr/lib/postgresql/*/bin.
func BinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	for _, d := range pgbin.Dirs() {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("pgtest: PostgreSQL server binaries (initdb, postgres) not found on PATH or in /usr/lib/postgresql/*/bin; install them with `apt-get install -y postgresql`, or set " + EnvDSN + " to a server where the tests may create databases")
}

// Credential is whom PostgreSQL's programs run as: nil (this process's
// user), or, when running as root, the postgres OS user, since initdb
// refuses root.
func Credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgtest: running as root, and initdb refuses root, but there is no `postgres` OS user to run it as (%v); `apt-get install -y postgresql` creates it, or `useradd --system postgres`", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// StartCluster initializes and starts a new cluster. When running as root it
// runs the server as the `postgres` OS user, since initdb refuses root.
// The server gets SIGQUIT (immediate shutdown) if this process dies first.
func StartCluster() (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	cred, err := Credential()
	if err != nil {
		return nil, err
	}
	// Short path: the socket path must fit in 107 bytes.
	dir, err := os.MkdirTemp("/tmp", "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgtest: %w", err)
		}
	}
	c := &Cluster{Dir: dir, done: make(chan error, 1)}
	data := filepath.Join(dir, "data")
	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgtest: initdb: %v\n%s", err, out)
	}
	logf, err := os.Create(filepath.Join(dir, "postgres.log"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	defer logf.Close()
	c.cmd = exec.Command(filepath.Join(bin, "postgres"), "-D", data,
		"-c", "listen_addresses=",
		"-c", "unix_socket_directories="+dir,
		"-c", "max_connections=300",
		"-c", "shared_buffers=128MB",
		"-c", "max_wal_size=2GB",
		"-c", "log_min_messages=warning",
	)
	c.cmd.Dir = dir
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgtest: start postgres: %w", err)
	}
	go func() { c.done <- c.cmd.Wait() }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, c.DSN("postgres"))
		if err == nil {
			conn.Close(ctx)
			cancel()
			return c, nil
		}
		cancel()
		select {
		case werr := <-c.done:
			log, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgtest: postgres exited at start (%v):\n%s", werr, log)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
			c.Stop()
			return nil, fmt.Errorf("pgtest: postgres did not accept connections within 60s (%v):\n%s", err, log)
		}
	}
}

// Stop shuts the server down (fast mode: sessions are disconnected) and
// removes its directory.
func (c *Cluster) Stop() error {
	defer os.RemoveAll(c.Dir)
	if c.cmd == nil || c.cmd.Process == nil {
		return nil
	}
	c.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-c.done:
		return nil
	case <-time.After(30 * time.Second):
		c.cmd.Process.Signal(syscall.SIGQUIT)
		<-c.done
		return errors.New("postgres did not stop within 30s; sent SIGQUIT")
	}
}
