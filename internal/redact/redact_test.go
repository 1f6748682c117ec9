package redact_test

import (
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/internal/redact"
)

func TestDSN(t *testing.T) {
	f := func(dsn, secret string) {
		t.Helper()
		got := redact.DSN(dsn)
		if secret != "" && strings.Contains(got, secret) {
			t.Errorf("DSN(%q) = %q: the password is still there", dsn, got)
		}
		if secret != "" && !strings.Contains(got, redact.Mask) {
			t.Errorf("DSN(%q) = %q: no mask", dsn, got)
		}
		if secret == "" && got != dsn {
			t.Errorf("DSN(%q) = %q: changed a DSN without a password", dsn, got)
		}
	}
	f("postgres://kettle:s3cr3t-pw@h1:5432,h2:5432/kettle?sslmode=verify-full", "s3cr3t-pw")
	f("postgres://kettle@h1/kettle?password=s3cr3t-pw&sslmode=disable", "s3cr3t-pw")
	f("host=/tmp port=5432 user=kettle password=s3cr3t-pw dbname=kettle", "s3cr3t-pw")
	f("host=/tmp user=kettle password='s3cr3t pw' dbname=kettle", "s3cr3t pw")
	f("postgres://kettle:p%40ss%2Fword@h1/kettle", "p%40ss%2Fword")
	f("postgres://kettle:p%40ss%2Fword@h1/kettle", "p@ss/word")
	// Does not parse (a port that is not a number): masked by pattern.
	f("postgres://kettle:s3cr3t-pw@h1:notaport/kettle", "s3cr3t-pw")
	f("postgres://kettle@h1/kettle?sslmode=disable", "")
	f("sqlite:kettle-data/kettle.db", "")
}

func TestArgs(t *testing.T) {
	secret := map[string]bool{"secret": true, "operator-token": true}
	dsns := map[string]bool{"db": true}
	got := strings.Join(redact.Args([]string{"--secret", "AAAA", "--operator-token=BBBB", "-secret=CCCC", "--devices", "10",
		"--db", "postgres://u:DDDD@h/k", "--db=postgres://u:EEEE@h/k", "--target", "http://x"}, secret, dsns), " ")
	for _, s := range []string{"AAAA", "BBBB", "CCCC", "DDDD", "EEEE"} {
		if strings.Contains(got, s) {
			t.Errorf("%s left in %q", s, got)
		}
	}
	for _, s := range []string{"--devices 10", "--target http://x", "--secret xxx", "--operator-token=xxx"} {
		if !strings.Contains(got, s) {
			t.Errorf("%q missing from %q", s, got)
		}
	}
}
