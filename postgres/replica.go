package postgres

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kettlefleet/kettlefleet/internal/redact"
)

// replica is the pool of Options.ReadDSN: reads that tolerate lag (device
// lists, a device's history, the dashboard's charts) go there while its
// lag, measured every second, is within Options.MaxReadLag, and to the
// primary otherwise.
type replica struct {
	pool   *pgxpool.Pool
	maxLag time.Duration
	// lag in ns; lagUnknown while it cannot be measured (unreachable, not
	// streaming from a primary)
	lag           atomic.Int64
	reads, misses atomic.Uint64 // reads served by it, and sent to the primary instead
	stop, done    chan struct{}
}

const lagUnknown = math.MinInt64

// replicaLagQuery is the standby's replay lag: 0 when it has replayed all
// it received, else the age of the last transaction it replayed (an idle
// primary does not make it look behind: then receive = replay). A standby
// not streaming from a primary cannot tell how far behind it is (NULL).
// The primary itself has no lag.
const replicaLagQuery = `SELECT CASE
	WHEN NOT pg_is_in_recovery() THEN 0
	WHEN NOT EXISTS (SELECT FROM pg_stat_wal_receiver WHERE status = 'streaming') THEN NULL
	WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0
	ELSE COALESCE(EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp()), 0) END::float8`

func openReplica(ctx context.Context, dsn string, opts Options, params map[string]string) (*replica, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("read replica %s: %w", redact.DSN(dsn), err)
	}
	cfg.MaxConns = opts.MaxConns
	cfg.ConnConfig.ConnectTimeout = opts.ConnectTimeout
	rereadPassword(dsn, cfg)
	for k, v := range params {
		if cfg.ConnConfig.RuntimeParams[k] == "" {
			cfg.ConnConfig.RuntimeParams[k] = v
		}
	}
	// Lazily connected: a replica down at start is measured as such and
	// skipped, not a reason not to start.
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("read replica %s: %w", redact.DSN(dsn), err)
	}
	r := &replica{pool: pool, maxLag: opts.MaxReadLag, stop: make(chan struct{}), done: make(chan struct{})}
	r.lag.Store(lagUnknown)
	r.measure()
	go r.watch()
	return r, nil
}

func (r *replica) measure() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var lag *float64
	if err := r.pool.QueryRow(ctx, replicaLagQuery).Scan(&lag); err != nil || lag == nil {
		r.lag.Store(lagUnknown)
		return
	}
	r.lag.Store(int64(*lag * 1e9))
}

func (r *replica) watch() {
	defer close(r.done)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
			r.measure()
		}
	}
}

func (r *replica) close() {
	close(r.stop)
	<-r.done
	r.pool.Close()
}

// reader is the pool for a read that tolerates lag: the replica's while its
// lag is known and within MaxReadLag, else the primary's.
func (s *Store) reader() *pgxpool.Pool {
	r := s.replica
	if r == nil {
		return s.pool
	}
	if l := r.lag.Load(); l != lagUnknown && time.Duration(l) <= r.maxLag {
		r.reads.Add(1)
		return r.pool
	}
	r.misses.Add(1)
	return s.pool
}

// ReplicaStats describe the read replica (Options.ReadDSN).
type ReplicaStats struct {
	Configured bool
	// LagSeconds is the replica's replay lag as last measured; NaN while
	// it cannot be measured (unreachable, not streaming).
	LagSeconds    float64
	MaxLagSeconds float64
	// Reads went to the replica; PrimaryReads could have but went to the
	// primary (lag unknown or over the maximum).
	Reads, PrimaryReads uint64
}

// ReplicaStats returns the read replica's lag and use.
func (s *Store) ReplicaStats() ReplicaStats {
	r := s.replica
	if r == nil {
		return ReplicaStats{}
	}
	lag := math.NaN()
	if l := r.lag.Load(); l != lagUnknown {
		lag = time.Duration(l).Seconds()
	}
	return ReplicaStats{Configured: true, LagSeconds: lag, MaxLagSeconds: r.maxLag.Seconds(), Reads: r.reads.Load(), PrimaryReads: r.misses.Load()}
}
