package server

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/kettlefleet/kettlefleet"
)

func openPostgres(ctx context.Context, dsn string, opts StoreOptions, log *slog.Logger) (kettle.Store, error) {
	return nil, fmt.Errorf("open store %s: the PostgreSQL store is not in this build yet", redactDSN(dsn))
}
