package leaktest

import (
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that keeps Check's failures instead of failing.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Helper()                   {}
func (r *recorder) Errorf(f string, a ...any) { r.errs = append(r.errs, fmt.Sprintf(f, a...)) }
func (r *recorder) Fatalf(f string, a ...any) {
	r.errs = append(r.errs, "fatal: "+fmt.Sprintf(f, a...))
}

// TestCheckFindsPlantedSecrets: a secret in a file, URL-encoded in another,
// in a running process's argv — each found where it is, none in the file
// skipped by design, and a search of too few places refused.
func TestCheckFindsPlantedSecrets(t *testing.T) {
	const pw = "planted/secret+0123456789"
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("app.log", "connected with "+pw+"\n")
	write("dsn.txt", "postgres://u:"+url.QueryEscape(pw)+"@h/db")
	write("password", pw)
	write("clean.log", "nothing here")
	p := exec.Command("sh", "-c", "sleep 30; :", pw) // the secret as $0, in sh's argv
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Process.Kill(); p.Wait() })

	c := Corpus{}
	c.Files(dir, func(p string) bool { return filepath.Base(p) == "password" })
	c.Argv()
	r := &recorder{TB: t}
	c.Check(r, Secrets{"planted": pw}, 3)
	all := strings.Join(r.errs, "\n")
	for _, want := range []string{"app.log", "dsn.txt", fmt.Sprintf("argv of %d", p.Process.Pid)} {
		if !strings.Contains(all, want) {
			t.Errorf("the planted secret in %s was not found; Check said:\n%s", want, all)
		}
	}
	if strings.Contains(all, filepath.Join(dir, "password")) || strings.Contains(all, "clean.log") {
		t.Errorf("a skipped or clean file reported:\n%s", all)
	}
	r = &recorder{TB: t}
	Corpus{"one": "x"}.Check(r, Secrets{"planted": pw}, 2)
	if len(r.errs) != 1 || !strings.Contains(r.errs[0], "only 1 sources searched") {
		t.Errorf("a search of one place: %v, want refused", r.errs)
	}
}
