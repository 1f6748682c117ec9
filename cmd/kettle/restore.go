package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"github.com/kettlefleet/kettlefleet/sqlite"
)

func init() {
	register("restore", "put a kettle backup file back as the SQLite store (kettle serve stopped)", runRestore)
}

const restoreDoc = `
Replaces the embedded SQLite store with the content of a file written by
kettle backup, after checking it (its counts and PRAGMA quick_check). The
store must not be open in any other process: stop kettle serve first
(restore refuses otherwise; a running server would go on answering from
its caches). An existing store is overwritten only with --replace. The
store's -wal file, if a crash left one, belongs to the old content and is
not replayed over the restored one. Readings acknowledged after the backup
was taken are not in it: kettles upload them again only if they still hold
them.`

func runRestore(ctx context.Context, args []string) error {
	fset := newFlagSet("restore", "--from FILE --db sqlite:PATH [--replace]", restoreDoc)
	db := fset.String("db", "sqlite:kettle-data/kettle.db", "the store to restore: sqlite:PATH")
	from := fset.String("from", "", "the backup file (written by kettle backup)")
	replace := fset.Bool("replace", false, "overwrite an existing store")
	if err := parseFlags(fset, args); err != nil {
		return err
	}
	path, err := sqliteFile(*db, "kettle restore writes")
	if err != nil {
		return err
	}
	if *from == "" {
		return fmt.Errorf("--from is required: the backup file to restore")
	}
	if _, err := os.Stat(path); err == nil && !*replace {
		return fmt.Errorf("%s exists: give --replace to overwrite it with %s (after stopping kettle serve)", path, *from)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	start := time.Now()
	info, err := sqlite.Restore(ctx, *from, path)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stdout, "restored %s from %s in %s: %d readings of %d kettles\n",
		path, *from, time.Since(start).Round(time.Millisecond), info.Measurements, info.Devices)
	return nil
}
