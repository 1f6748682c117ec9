package server_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/server"
)

// TestSecretFiles: a generated secret is written whole (0600) and kept; an
// empty or unreadable secret file stops the start instead of becoming a
// new secret (which would invalidate every token in the field); a secret
// given too short is refused naming its flag.
func TestSecretFiles(t *testing.T) {
	start := func(c server.Config) (*server.Server, error) {
		c.Addr, c.DB = "127.0.0.1:0", "sqlite:"+filepath.Join(t.TempDir(), "k.db")
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		return server.Start(context.Background(), c)
	}
	dir := t.TempDir()
	s, err := start(server.Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	for _, name := range []string{"secret", "operator-token"} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Mode().Perm() != 0o600 || st.Size() < 32 {
			t.Errorf("generated %s: %v %v", name, st, err)
		}
	}
	before, _ := os.ReadFile(filepath.Join(dir, "secret"))
	s, err = start(server.Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if after, _ := os.ReadFile(filepath.Join(dir, "secret")); string(after) != string(before) {
		t.Fatal("a second start replaced the secret")
	}

	f := func(setup func(dir string), c server.Config, want string) {
		t.Helper()
		d := t.TempDir()
		setup(d)
		c.DataDir = d
		s, err := start(c)
		if err == nil {
			s.Close()
			t.Errorf("started; want a refusal saying %q", want)
			return
		}
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refused with %q; want it to say %q", err, want)
		}
	}
	none := func(string) {}
	f(func(d string) { os.WriteFile(filepath.Join(d, "secret"), []byte("\n"), 0o600) }, server.Config{}, "secret is empty")
	f(func(d string) { os.WriteFile(filepath.Join(d, "operator-token"), nil, 0o600) }, server.Config{}, "operator-token is empty")
	f(func(d string) { os.Mkdir(filepath.Join(d, "secret"), 0o700) }, server.Config{}, "read ")
	f(none, server.Config{Secret: "short"}, "--secret: 5 characters; at least 16")
	f(none, server.Config{OperatorToken: "tok"}, "--operator-token: 3 characters")
	f(none, server.Config{OperatorToken: "operator-token-long-enough", PreviousOperatorToken: "old"}, "--operator-token-previous: 3 characters")
}
