// Package servertest starts the real kettle server inside a test, as kettle
// serve does: on 127.0.0.1:0, with a data directory of the test's own.
package servertest

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/kettlefleet/kettlefleet/server"
)

// Start runs the server on the store dsn with a temp data directory, mods
// applied to its Config first, and closes it when the test ends. Its log is
// dropped, or shows warnings on stderr under go test -v.
func Start(t testing.TB, dsn string, mods ...func(*server.Config)) *server.Server {
	t.Helper()
	cfg := server.Config{
		Addr:    "127.0.0.1:0",
		DB:      dsn,
		DataDir: t.TempDir(),
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if testing.Verbose() {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	for _, m := range mods {
		m(&cfg)
	}
	srv, err := server.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("start server: %v", err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

// SQLite is Start on a fresh SQLite file; it returns the directory that
// holds the file and is the data directory.
func SQLite(t testing.TB, mods ...func(*server.Config)) (*server.Server, string) {
	t.Helper()
	dir := t.TempDir()
	mods = append([]func(*server.Config){func(c *server.Config) { c.DataDir = dir }}, mods...)
	return Start(t, "sqlite:"+filepath.Join(dir, "k.db"), mods...), dir
}
