package durable_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/kettlefleet/kettlefleet/internal/durable"
)

func TestCreateSecret(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "secret")
	if err := durable.CreateSecret(p, []byte("first\n")); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", st.Mode().Perm())
	}
	// A second writer never replaces it: the first secret stands.
	if err := durable.CreateSecret(p, []byte("second\n")); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second CreateSecret: %v, want fs.ErrExist", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "first\n" {
		t.Fatalf("content %q after a second writer, want the first", b)
	}
	// No temporary file left beside it.
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("directory holds %d entries, want the secret only", len(ents))
	}
}
