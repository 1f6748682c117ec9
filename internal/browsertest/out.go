package browsertest

import (
	"os"
	"testing"
)

// OutDir is where a UI test keeps its screenshots: $KETTLE_TEST_OUT (make
// screenshots copies them to docs/img), or a temp dir of the test.
func OutDir(t testing.TB) string {
	t.Helper()
	out := os.Getenv("KETTLE_TEST_OUT")
	if out == "" {
		return t.TempDir()
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	return out
}
