package bench

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestBenchmarksDocumented fails when a script is missing from
// docs/benchmarks.md, which says what each measures and how to run it.
func TestBenchmarksDocumented(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "docs", "benchmarks.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range append(scripts(t), "lib/pg-cluster.sh") {
		if !bytes.Contains(doc, []byte("bench/"+s)) {
			t.Errorf("docs/benchmarks.md does not describe bench/%s", s)
		}
	}
}

// TestMakefileListsChaosParts fails when the Makefile's `make chaos`
// comment does not name every part of chaos/cmd/chaos (its parts table),
// or names one that is not there.
func TestMakefileListsChaosParts(t *testing.T) {
	// Every part, from the command itself: parts register from several files.
	cmd := exec.Command("go", "run", "./chaos/cmd/chaos", "parts")
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go run ./chaos/cmd/chaos parts: %v", err)
	}
	parts := strings.Fields(string(out))
	if len(parts) == 0 {
		t.Fatal("chaos/cmd/chaos/main.go: no parts found")
	}
	mk, err := os.ReadFile(filepath.Join("..", "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	// The comment block right above the chaos target.
	m := regexp.MustCompile(`(?m)((?:^#.*\n)+)chaos:`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("Makefile: no comment above the chaos target")
	}
	listed := map[string]bool{}
	words := strings.Fields(strings.NewReplacer("#", " ", ",", " ", "|", " ").Replace(string(m[1])))
	for _, w := range words {
		listed[w] = true
	}
	for _, p := range parts {
		if !listed[p] {
			t.Errorf("the Makefile's chaos comment does not name the part %q", p)
		}
	}
	if i := bytes.Index(m[1], []byte("PART one of")); i < 0 {
		t.Error(`the Makefile's chaos comment has no "PART one of" list`)
	} else {
		known := map[string]bool{}
		for _, p := range parts {
			known[p] = true
		}
		list := string(m[1][i+len("PART one of"):])
		list = list[:strings.Index(list, "(")]
		for _, w := range strings.Fields(strings.ReplaceAll(list, "#", " ")) {
			if !known[w] {
				t.Errorf("the Makefile's chaos comment names %q, not a part of chaos/cmd/chaos", w)
			}
		}
	}
}
