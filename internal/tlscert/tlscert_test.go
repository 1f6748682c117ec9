package tlscert_test

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/tlscert"
	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
)

// TestNotAfterSeesARenewalWithoutAHandshake: the expiry gauge reads
// NotAfter; with no handshake since a renewal (an idle server, scrapes on a
// kept-alive connection) it still reports the renewed certificate once
// CheckEvery has passed, and not before.
func TestNotAfterSeesARenewalWithoutAHandshake(t *testing.T) {
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	old, _, _, _ := tlscerttest.Write(t, cert, key, time.Now().Add(10*24*time.Hour))
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()) }
	r, err := tlscert.Load(cert, key, slog.New(slog.NewTextHandler(io.Discard, nil)), clock)
	if err != nil {
		t.Fatal(err)
	}
	renewed, _, _, _ := tlscerttest.Write(t, cert, key, time.Now().Add(90*24*time.Hour))
	if got := r.NotAfter(); !got.Equal(old.NotAfter) {
		t.Errorf("before CheckEvery: NotAfter %v, want the old %v", got, old.NotAfter)
	}
	now.Add(int64(tlscert.CheckEvery))
	if got := r.NotAfter(); !got.Equal(renewed.NotAfter) {
		t.Errorf("after CheckEvery: NotAfter %v, want the renewed %v", got, renewed.NotAfter)
	}
	if r.Reloads() != 1 || r.Failures() != 0 {
		t.Errorf("reloads %d, failures %d", r.Reloads(), r.Failures())
	}
}

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
