package server

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

var (
	_ metrics.BusyRetrier  = (*sqlite.Store)(nil)
	_ metrics.StagedMerger = (*sqlite.Store)(nil)
)

// StoreOptions tunes the stores (PostgreSQL pool and timeouts).
type StoreOptions struct {
	PoolSize         int
	StatementTimeout time.Duration
	// ReadDSN and MaxReadLag: see postgres.Options.
	ReadDSN    string
	MaxReadLag time.Duration
}

// IsPostgresDSN reports whether a --db names a PostgreSQL database: a
// postgres:// URL or libpq's keyword/value form (host=… dbname=…).
func IsPostgresDSN(dsn string) bool {
	return strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") ||
		strings.Contains(dsn, "host=") || strings.Contains(dsn, "dbname=")
}

// OpenStore opens the store a DSN names: sqlite:PATH or postgres://….
func OpenStore(ctx context.Context, dsn string, opts StoreOptions, log *slog.Logger) (kettle.Store, error) {
	switch {
	case strings.HasPrefix(dsn, "sqlite:"):
		path := strings.TrimPrefix(dsn, "sqlite:")
		if path == "" {
			return nil, fmt.Errorf("--db sqlite: needs a file path, e.g. sqlite:kettle-data/kettle.db")
		}
		st, err := sqlite.Open(ctx, path, sqlite.WithLogger(log))
		if err != nil {
			return nil, fmt.Errorf("open store %s: %w", dsn, err)
		}
		return st, nil
	case IsPostgresDSN(dsn):
		return openPostgres(ctx, dsn, opts, log)
	}
	return nil, fmt.Errorf("--db %q: want sqlite:PATH or postgres://user@host/db", dsn)
}
