package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet/internal/pgtest"
)

// pgCluster is a throwaway PostgreSQL (pgtest.StartCluster) that chaos can
// stop and start again: pg_ctl on the cluster's data directory, run as the
// postgres OS user when we are root (as pgtest runs it). After a restart the
// postmaster is pg_ctl's child, not ours, so close stops it with pg_ctl.
type pgCluster struct {
	c         *pgtest.Cluster
	bin       string
	cred      *syscall.Credential
	restarted bool
}

func startPG() (*pgCluster, error) {
	bin, err := pgtest.BinDir()
	if err != nil {
		return nil, err
	}
	cred, err := pgtest.Credential()
	if err != nil {
		return nil, err
	}
	c, err := pgtest.StartCluster()
	if err != nil {
		return nil, err
	}
	return &pgCluster{c: c, bin: bin, cred: cred}, nil
}

func (p *pgCluster) DSN(db string) string { return p.c.DSN(db) }

// createDB creates database name and returns its DSN.
func (p *pgCluster) createDB(name string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.DSN("postgres"))
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name+" TEMPLATE template0"); err != nil {
		return "", err
	}
	return p.DSN(name), nil
}

func (p *pgCluster) pgctl(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(p.bin, "pg_ctl"), append([]string{"-D", filepath.Join(p.c.Dir, "data")}, args...)...)
	cmd.Dir = p.c.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl %v: %v: %s", args, err, b)
	}
	return nil
}

// stop is the outage: fast shutdown (sessions disconnected), waited for.
func (p *pgCluster) stop() error { return p.pgctl("stop", "-m", "fast", "-w", "-t", "60") }

// start brings the same cluster back with pgtest's settings.
func (p *pgCluster) start() error {
	p.restarted = true
	opts := fmt.Sprintf("-c listen_addresses= -c unix_socket_directories=%s -c max_connections=300 -c shared_buffers=128MB -c max_wal_size=2GB -c log_min_messages=warning", p.c.Dir)
	return p.pgctl("start", "-w", "-t", "60", "-l", filepath.Join(p.c.Dir, "postgres-restarted.log"), "-o", opts)
}

// ping reports whether the cluster answers.
func (p *pgCluster) ping() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.DSN("postgres"))
	if err != nil {
		return false
	}
	conn.Close(ctx)
	return true
}

// close stops the cluster and removes its directory.
func (p *pgCluster) close() {
	if p.restarted {
		p.pgctl("stop", "-m", "fast", "-w", "-t", "60")
	}
	p.c.Stop()
}
