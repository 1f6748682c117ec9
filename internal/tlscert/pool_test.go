package tlscert_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/tlscert"
	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
)

// TestPool: a PEM certificate becomes a pool that trusts it; a missing file
// and a file without a certificate are errors naming the flag.
func TestPool(t *testing.T) {
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	_, want, _, _ := tlscerttest.Write(t, ca, "", time.Now().Add(time.Hour))
	pool, err := tlscert.Pool("--log-ca", ca)
	if err != nil {
		t.Fatal(err)
	}
	if !pool.Equal(want) {
		t.Error("the pool does not hold the file's certificate")
	}
	junk := filepath.Join(dir, "junk.pem")
	os.WriteFile(junk, []byte("not a certificate"), 0o644)
	for _, file := range []string{filepath.Join(dir, "missing.pem"), junk} {
		if _, err := tlscert.Pool("--log-ca", file); err == nil || !strings.HasPrefix(err.Error(), "--log-ca") {
			t.Errorf("Pool(%s) = %v, want an error naming --log-ca", file, err)
		}
	}
}
