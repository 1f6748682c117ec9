package postgres_test

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// TestExpireWhileAnotherExpires: while another process holds the expiry's
// advisory lock (another node expiring), Expire removes nothing and says
// kettle.ErrExpiring; the retention loop counts that round as done, not
// failed; once the lock is free, Expire removes the old month.
func TestExpireWhileAnotherExpires(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Start(t)
	s := open(t, dsn)
	defer s.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	dev := uuid.New()
	old := time.Now().UTC().AddDate(0, -3, 0)
	if _, err := s.Write(ctx, []kettle.Measurement{rowAt(rng, dev, old), rowAt(rng, dev, time.Now().UTC().Add(-time.Hour))}, time.Now()); err != nil {
		t.Fatal(err)
	}
	other, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", postgres.LockExpire); err != nil {
		t.Fatal(err)
	}
	before := kettle.ExpireBefore(time.Now(), 40*24*time.Hour)
	if n, err := s.Expire(ctx, before); n != 0 || !errors.Is(err, kettle.ErrExpiring) {
		t.Errorf("Expire while another process expires: %d, %v; want 0 and ErrExpiring", n, err)
	}
	svc, err := fleet.New(ctx, s, fleet.Config{Retention: 40 * 24 * time.Hour, ExpireEvery: time.Hour}, slog.New(slog.DiscardHandler), nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := svc.Expire(ctx); n != 0 || err != nil {
		t.Errorf("the retention loop while another process expires: %d, %v; want 0, nil", n, err)
	}
	svc.Close() // and its loop, whose first round ran at start
	if st := svc.ExpiryStats(); st.Errors != 0 || st.Runs < 1 || st.LastSuccess.IsZero() {
		t.Errorf("retention loop stats while another process expires: %+v; want rounds done, none failed", st)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", postgres.LockExpire); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Expire(ctx, before); n != 1 || err != nil {
		t.Errorf("Expire once the lock is free: %d, %v; want the old reading", n, err)
	}
}
