// Package dist tests what kettlefleet ships to real machines, as far as it
// runs here without a cluster or a container engine: the release binaries
// (reproducible, static, the arm64 one under qemu-user), the OCI image
// (reproducible, unpacked and run in fresh namespaces), the Helm chart and
// the Compose file (rendered and strictly decoded, checked against the
// code). It is a module of its own so that the product's go.mod holds none
// of helm's, Kubernetes' or go-containerregistry's dependencies.
package dist_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// repo is the kettlefleet checkout this module sits in.
var repo = func() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}()

// release runs deploy/release/release.sh into a new directory, with the
// given extra environment, and returns the directory.
func release(t testing.TB, env ...string) string {
	t.Helper()
	out, err := os.MkdirTemp("", "kettle-dist-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(out) })
	cmd := exec.Command(filepath.Join(repo, "deploy/release/release.sh"), out)
	cmd.Dir = repo
	cmd.Env = append(append(os.Environ(), "VERSION=9.9.9-test"), env...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("release.sh: %v\n%s", err, b)
	}
	return out
}

// sums reads a SHA256SUMS file: file → digest.
func sums(t testing.TB, dir string) map[string]string {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if d, name, ok := strings.Cut(sc.Text(), "  "); ok {
			m[name] = d
		}
	}
	return m
}

var (
	distOnce sync.Once
	distDir  string
	distErr  error
)

// dist is one release build shared by the tests that only use it.
func dist(t *testing.T) string {
	t.Helper()
	distOnce.Do(func() {
		defer func() {
			if r := recover(); r != nil {
				distErr = fmt.Errorf("%v", r)
			}
		}()
		distDir = releaseOnce()
	})
	if distErr != nil {
		t.Fatal(distErr)
	}
	return distDir
}

func releaseOnce() string {
	out, err := os.MkdirTemp("", "kettle-dist-shared-")
	if err != nil {
		panic(err)
	}
	cmd := exec.Command(filepath.Join(repo, "deploy/release/release.sh"), out)
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "VERSION=9.9.9-test")
	if b, err := cmd.CombinedOutput(); err != nil {
		panic(fmt.Sprintf("release.sh: %v\n%s", err, b))
	}
	return out
}

func TestMain(m *testing.M) {
	code := m.Run()
	if distDir != "" {
		os.RemoveAll(distDir)
	}
	os.Exit(code)
}

// TestReleaseReproducible: two builds of one commit, the second with an
// empty build cache (so nothing is reused), give the same bytes — every
// binary and every tarball.
func TestReleaseReproducible(t *testing.T) {
	a := sums(t, dist(t))
	if len(a) != 4 {
		t.Fatalf("SHA256SUMS lists %d files, want 2 binaries and 2 tarballs: %v", len(a), a)
	}
	// amd64 only from a cold cache: the arm64 build takes the same script
	// and flags, and a second cold cross build would double the test's time.
	b := sums(t, release(t, "GOCACHE="+t.TempDir(), "ARCHES=amd64"))
	compared := 0
	for name, d := range b {
		if a[name] != d {
			t.Errorf("%s: %s, then %s: not reproducible", name, a[name], d)
		}
		compared++
	}
	if compared != 2 {
		t.Fatalf("the second build made %d files, want the amd64 binary and tarball: %v", compared, b)
	}
}

// TestReleaseBinaries: static, stamped, and each runs (arm64 under
// qemu-user).
func TestReleaseBinaries(t *testing.T) {
	d := dist(t)
	for _, arch := range []string{"amd64", "arm64"} {
		bin := filepath.Join(d, "kettle_linux_"+arch)
		out, err := exec.Command("file", bin).CombinedOutput()
		if err != nil {
			t.Fatalf("file %s: %v", bin, err)
		}
		if !strings.Contains(string(out), "statically linked") {
			t.Errorf("%s is not static: %s", arch, out)
		}
		if strings.Contains(string(out), "BuildID") {
			t.Errorf("%s carries a build id: %s", arch, out)
		}
		run := []string{bin, "version"}
		if arch != runtime.GOARCH {
			run = append([]string{qemu(t, arch)}, run...)
		}
		v, err := exec.Command(run[0], run[1:]...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s version: %v\n%s", arch, err, v)
		}
		for _, want := range []string{"kettle 9.9.9-test", "platform linux/" + arch, "commit "} {
			if !strings.Contains(string(v), want) {
				t.Errorf("%s version: no %q in\n%s", arch, want, v)
			}
		}
		if strings.Contains(string(v), "commit unknown") || strings.Contains(string(v), "date unknown") {
			t.Errorf("%s version is not stamped:\n%s", arch, v)
		}
	}
}

// qemu finds qemu-user for arch (Debian qemu-user-static).
func qemu(t *testing.T, arch string) string {
	t.Helper()
	name := map[string]string{"arm64": "qemu-aarch64-static"}[arch]
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found: apt-get install -y qemu-user-static (make deps)", name)
	}
	return p
}
