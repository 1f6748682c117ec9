package postgres

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// rereadPassword makes every new connection of cfg take its password from
// dsn afresh: from the DSN itself, or, when it holds none, from the passfile
// (PGPASSFILE, passfile=, ~/.pgpass) or service file as it is now. Rotating
// the database password is then ALTER ROLE … PASSWORD and rewriting the
// passfile: connections already open stay authenticated, new ones use the
// new password, and no node restarts. A file that cannot be read just now
// (being replaced) leaves the password the last read gave.
func rereadPassword(dsn string, cfg *pgxpool.Config) {
	before := cfg.BeforeConnect
	cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		freshPassword(dsn, cc)
		if before != nil {
			return before(ctx, cc)
		}
		return nil
	}
}

// freshPassword sets cc's password as rereadPassword does, for a connection
// made outside the pool.
func freshPassword(dsn string, cc *pgx.ConnConfig) {
	if c, err := pgconn.ParseConfig(dsn); err == nil && c.Password != "" {
		cc.Password = c.Password
	}
}
