// Package testkit holds what the process-level tests of several packages
// share: the kettle binary of this checkout and a free loopback address for
// a process the test starts.
package testkit

import (
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// Root is the directory of this checkout (the module's root).
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}

// BuildKettle builds ./cmd/kettle of this checkout into dir/kettle with the
// go build flags given (-race for a test that wants the detector in the
// child too) and returns the binary's path.
func BuildKettle(dir string, flags ...string) (string, error) {
	bin := filepath.Join(dir, "kettle")
	args := append(append([]string{"build"}, flags...), "-o", bin, "./cmd/kettle")
	cmd := exec.Command("go", args...)
	cmd.Dir = Root()
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/kettle: %v\n%s", err, out)
	}
	return bin, nil
}

// FreeAddr returns a loopback TCP address that nothing listens on: the
// kernel's choice of port, closed again, for a child process's flag. Another
// process may take it in between; on loopback in a test that is rare.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
