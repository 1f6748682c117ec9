package postgres_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/postgres"
)

// TestWithoutPassword: what kettle backup and restore hand pg_dump and
// pg_restore: the DSN without its password in the arguments (another
// user's ps shows them), the password in PGPASSWORD.
func TestWithoutPassword(t *testing.T) {
	f := func(dsn, wantArg, wantPassword string) {
		t.Helper()
		arg, env := postgres.WithoutPassword(dsn)
		var pw string
		if i := slices.IndexFunc(env, func(e string) bool { return strings.HasPrefix(e, "PGPASSWORD=") }); i >= 0 {
			pw = strings.TrimPrefix(env[i], "PGPASSWORD=")
		}
		if arg != wantArg || pw != wantPassword {
			t.Errorf("WithoutPassword(%q) = %q, PGPASSWORD=%q; want %q, %q", dsn, arg, pw, wantArg, wantPassword)
		}
	}
	f("postgres://kettle:s3cret@db:5432/kettle?sslmode=disable", "postgres://kettle@db:5432/kettle?sslmode=disable", "s3cret")
	f("postgres://kettle@db/kettle?password=s3cret&sslmode=disable", "postgres://kettle@db/kettle?sslmode=disable", "s3cret")
	f("host=db user=kettle password=s3cret dbname=kettle", "host=db user=kettle dbname=kettle", "s3cret")
	f("host=db password='a b\\'c' dbname=kettle", "host=db dbname=kettle", "a b'c")
	f("password=s3cret host=db", "host=db", "s3cret")
	f("host=/tmp/x user=postgres dbname=kettle", "host=/tmp/x user=postgres dbname=kettle", "")
}
