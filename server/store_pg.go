package server

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/postgres"
)

func openPostgres(ctx context.Context, dsn string, opts StoreOptions, log *slog.Logger) (kettle.Store, error) {
	st, err := postgres.Open(ctx, dsn, postgres.Options{MaxConns: int32(opts.PoolSize), StatementTimeout: opts.StatementTimeout})
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", redactDSN(dsn), err)
	}
	return st, nil
}

// registerPool exposes the PostgreSQL pool's gauges when the store has one.
func registerPool(m *metrics.Server, st kettle.Store) {
	if pg, ok := st.(*postgres.Store); ok {
		m.RegisterPool(func() metrics.PoolStats { return metrics.PoolStats(pg.PoolStats()) })
	}
}
