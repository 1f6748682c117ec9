package server

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/redact"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/postgres"
)

func openPostgres(ctx context.Context, dsn string, opts StoreOptions, log *slog.Logger) (kettle.Store, error) {
	st, err := postgres.Open(ctx, dsn, postgres.Options{MaxConns: int32(opts.PoolSize), StatementTimeout: opts.StatementTimeout, ReadDSN: opts.ReadDSN, MaxReadLag: opts.MaxReadLag})
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redact.DSN(dsn), err)
	}
	// Say once whether /metrics can show the WAL segment files (the
	// statistics connection opens here, not at the first scrape).
	if m, err := st.Maintenance(ctx); err == nil && !m.SegmentsKnown {
		log.Info("PostgreSQL: this role may not list pg_wal, so /metrics has no kettle_pg_wal_segment(s_ready) and KettlePostgresWALSegmentsCreated cannot fire; grant pg_monitor to see WAL segment files being created")
	}
	return st, nil
}

// registerPool exposes the PostgreSQL pool's gauges, and the database
// server's checkpoint and WAL counters, when the store has them.
func registerPool(m *metrics.Server, st kettle.Store) {
	if pg, ok := st.(*postgres.Store); ok {
		m.RegisterPool(func() metrics.PoolStats { return metrics.PoolStats(pg.PoolStats()) })
		m.RegisterPGMaintenance(func(ctx context.Context) (metrics.PGMaintenance, error) {
			st, err := pg.Maintenance(ctx)
			return metrics.PGMaintenance(st), err
		})
		if pg.ReplicaStats().Configured {
			m.RegisterReplica(func() metrics.ReplicaStats { return metrics.ReplicaStats(pg.ReplicaStats()) })
		}
	}
}
