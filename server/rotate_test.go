package server_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
)

// TestDatabasePasswordRotation: the runbook of docs/security.md on a real
// PostgreSQL that checks passwords (SCRAM): a node whose DSN holds no
// password reads it from its passfile (PGPASSFILE); the password is
// changed (ALTER ROLE) and the passfile rewritten, every connection the
// node had is cut (as a failover would), and uploads go on — without a
// restart — on new connections with the new password, while the old one
// is refused.
func TestDatabasePasswordRotation(t *testing.T) {
	cl, err := pgtest.StartCluster()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Stop() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, err := pgx.Connect(ctx, cl.DSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	exec := func(sql string) {
		t.Helper()
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	const oldPW, newPW = "rotation-old-password-0123", "rotation-new-password-4567"
	exec(`CREATE ROLE kettle_app LOGIN PASSWORD '` + oldPW + `'`)
	exec(`CREATE DATABASE rot OWNER kettle_app`)
	// kettle_app by password only (SCRAM); the test's own role stays trusted.
	hba := filepath.Join(cl.Dir, "data", "pg_hba.conf")
	rest, err := os.ReadFile(hba)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hba, append([]byte("local all kettle_app scram-sha-256\n"), rest...), 0o600); err != nil {
		t.Fatal(err)
	}
	exec(`SELECT pg_reload_conf()`)
	appDSN := fmt.Sprintf("host=%s port=5432 user=kettle_app dbname=rot sslmode=disable", cl.Dir)
	connects := func(pw string) error {
		c, err := pgx.Connect(ctx, appDSN+" password="+pw)
		if err == nil {
			c.Close(ctx)
		}
		return err
	}
	// pg_reload_conf signals the postmaster; the new rules hold once a
	// connection without a password is refused.
	for deadline := time.Now().Add(10 * time.Second); connects("") == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("kettle_app still connects without a password after pg_hba.conf's reload")
		}
	}

	passfile := filepath.Join(t.TempDir(), "pgpass")
	writePass := func(pw string) {
		t.Helper()
		// Replaced whole (a new file renamed over it), as the runbook says:
		// a node never reads half a passfile.
		if err := os.WriteFile(passfile+".new", []byte("*:*:*:kettle_app:"+pw+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(passfile+".new", passfile); err != nil {
			t.Fatal(err)
		}
	}
	writePass(oldPW)
	t.Setenv("PGPASSFILE", passfile)
	srv := start(t, appDSN)
	c := newClient(t, srv)
	id := uuid.New()
	dev := bearer(kettle.DeviceToken(srv.Secret(), id))
	base := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	upload := func(i int) int {
		return c.do("POST", "/v1/measurements", dev, v1Body(base.Add(time.Duration(i)*time.Second), 500, 1000, -5, 21, 90, 800)).status
	}
	if code := upload(0); code != 200 {
		t.Fatalf("upload with the old password: %d", code)
	}

	// The rotation: the new password on the role, then in the passfile.
	exec(`ALTER ROLE kettle_app PASSWORD '` + newPW + `'`)
	writePass(newPW)
	// Every connection of the node goes, as in a failover or a restart of
	// PostgreSQL: whatever it opens next authenticates anew.
	exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'kettle_app'`)
	if err := connects(oldPW); err == nil {
		t.Fatal("the old password still connects after ALTER ROLE")
	}
	deadline := time.Now().Add(30 * time.Second)
	for i := 1; ; i++ {
		code := upload(i)
		if code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("uploads after the rotation: still %d after 30 s; the node did not take the passfile's new password", code)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var n int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE usename = 'kettle_app'`).Scan(&n); err != nil || n == 0 {
		t.Fatalf("no connection of the node after the rotation (%d, %v)", n, err)
	}
}
