// Package leaktest searches what programs wrote and answered for secrets
// they were given: the files under a directory, every process's argv, logs
// and HTTP answers added by the test. A secret is found plain or
// URL-encoded (a DSN's escaping).
package leaktest

import (
	"bytes"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Secrets are known values a test gave the programs, by name.
type Secrets map[string]string

// Corpus is everything searched, by where it came from.
type Corpus map[string]string

// Add adds what, found at where.
func (c Corpus) Add(where, what string) { c[where] += what }

// Get adds the answer of a GET of url by cl — status and body — or the
// error; mod (a header, basic auth) changes the request first.
func (c Corpus) Get(cl *http.Client, url string, mod ...func(*http.Request)) {
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		c.Add(url, err.Error())
		return
	}
	for _, m := range mod {
		m(req)
	}
	res, err := cl.Do(req)
	if err != nil {
		c.Add(url, err.Error())
		return
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	c.Add(url, res.Status+"\n"+string(b))
}

// Files adds every regular file under dir for which skip (nil: none) is
// false: a file that holds a secret by design (the secret's own file, a
// configuration the engine reads it from) is skipped by name.
func (c Corpus) Files(dir string, skip func(path string) bool) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || (skip != nil && skip(p)) {
			return nil
		}
		if b, err := os.ReadFile(p); err == nil {
			c.Add(p, string(b))
		}
		return nil
	})
}

// Argv adds the command line of every process on the machine: what ps
// shows to every user, and what /debug/pprof/cmdline would serve.
func (c Corpus) Argv() {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && len(b) > 0 {
			c.Add("argv of "+filepath.Base(filepath.Dir(p)), string(bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
		}
	}
}

// Check fails t for every place a secret appears in, and when fewer than
// atLeast places were searched (a test that searched nothing proves nothing).
func (c Corpus) Check(t testing.TB, s Secrets, atLeast int) {
	t.Helper()
	if len(c) < atLeast {
		t.Fatalf("only %d sources searched, want at least %d: the test did not run what it means to", len(c), atLeast)
	}
	for name, v := range s {
		if v == "" {
			t.Fatalf("the %s is empty: nothing to search for", name)
		}
		forms := []string{v}
		if e := url.QueryEscape(v); e != v {
			forms = append(forms, e)
		}
		for _, form := range forms {
			for where, what := range c {
				if i := strings.Index(what, form); i >= 0 {
					lo, hi := max(0, i-80), min(len(what), i+len(form)+40)
					t.Errorf("the %s is in %s: …%s…", name, where, what[lo:hi])
				}
			}
		}
	}
}
