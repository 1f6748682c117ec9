package pgtest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestStart(t *testing.T) {
	ctx := context.Background()
	a, b := pgtest.Start(t), pgtest.Start(t)
	if a == b {
		t.Fatalf("two callers got the same database %q", a)
	}
	for _, dsn := range []string{a, b} {
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "CREATE TABLE x (i int)"); err != nil {
			t.Fatalf("%s: %v", dsn, err)
		}
		conn.Close(ctx)
	}
}
