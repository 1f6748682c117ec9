package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func init() {
	register("restore", "put a kettle backup back as the store (no server running on it)", runRestore)
}

const restoreDoc = `
Puts a file written by kettle backup back as the store, after checking it.
Readings acknowledged after the backup was taken are not in it, and
kettles do not send a reading again once it was acknowledged: they are
gone, so back up as often as you can afford to lose.

SQLite: replaces the store's file (created if missing; an existing one only
with --replace). The store must not be open in any other process: stop
kettle serve first (restore refuses otherwise; a running server would go on
answering from its caches). The store's -wal file, if a crash left one,
belongs to the old content and is not replayed over the restored one.

PostgreSQL: loads the archive into an empty database (createdb NAME first,
and name it in --db) with pg_restore in one transaction (all or nothing);
it refuses a database that has tables, so it never overwrites one servers
may use. Then point kettle serve --db at it.`

func runRestore(ctx context.Context, args []string) error {
	fset := newFlagSet("restore", "--from FILE --db DSN [--replace]", restoreDoc)
	db := fset.String("db", "sqlite:kettle-data/kettle.db", "the store to restore: sqlite:PATH, or an empty PostgreSQL database postgres://user@host:port/db")
	from := fset.String("from", "", "the backup file (written by kettle backup)")
	replace := fset.Bool("replace", false, "SQLite: overwrite an existing store")
	if err := parseFlags(fset, args); err != nil {
		return err
	}
	if *from == "" {
		return fmt.Errorf("--from is required: the backup file to restore")
	}
	start := time.Now()
	var (
		what       string
		n, kettles int64
	)
	if server.IsPostgresDSN(*db) {
		info, err := postgres.Restore(ctx, *from, *db)
		if err != nil {
			return err
		}
		what, n, kettles = dbName(*db), info.Measurements, info.Devices
	} else {
		path, err := sqliteFile(*db)
		if err != nil {
			return err
		}
		if _, err := os.Stat(path); err == nil && !*replace {
			return fmt.Errorf("%s exists: give --replace to overwrite it with %s (after stopping kettle serve)", path, *from)
		} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		info, err := sqlite.Restore(ctx, *from, path)
		if err != nil {
			return err
		}
		what, n, kettles = path, info.Measurements, info.Devices
	}
	fmt.Fprintf(os.Stdout, "restored %s from %s in %s: %d readings of %d kettles\n",
		what, *from, time.Since(start).Round(time.Millisecond), n, kettles)
	return nil
}
