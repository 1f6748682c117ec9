package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

var updateDocs = flag.Bool("update", false, "write docs/configuration.md and docs/api.md from the flag sets and httpapi/openapi.json (make docs)")

// TestReferenceCurrent fails when docs/configuration.md or docs/api.md
// differ from what the commands' flag sets and httpapi/openapi.json give.
func TestReferenceCurrent(t *testing.T) {
	spec, err := os.ReadFile(filepath.Join("..", "..", "httpapi", "openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	api, err := apiReference(spec)
	if err != nil {
		t.Fatalf("httpapi/openapi.json: %v", err)
	}
	docs := map[string]string{
		filepath.Join("..", "..", "docs", "configuration.md"): configurationReference(t),
		filepath.Join("..", "..", "docs", "api.md"):           api,
	}
	for path, want := range docs {
		if *updateDocs {
			if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%v: run `make docs`", err)
		}
		if string(got) != want {
			t.Errorf("%s differs from what the code gives: run `make docs`", path)
		}
	}
}

// TestEveryFlagDocumented holds every flag to a help line and every
// command's flags to the env twins parseFlags reads.
func TestEveryFlagDocumented(t *testing.T) {
	names, _, sets := allFlagSets(t)
	for i, fs := range sets {
		fs.VisitAll(func(f *flag.Flag) {
			if strings.TrimSpace(f.Usage) == "" {
				t.Errorf("kettle %s --%s: no help line", names[i], f.Name)
			}
		})
	}
}

// flagSetNames are the names of every flag set the commands make
// (newFlagSet("swarm worker", …) in cmd/kettle's source): a subcommand such
// as "swarm worker" is one, reached as `kettle swarm worker`.
func flagSetNames(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	fset := token.NewFileSet()
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			if id, ok := call.Fun.(*ast.Ident); !ok || id.Name != "newFlagSet" || len(call.Args) == 0 {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok {
				t.Errorf("%s: newFlagSet's name is not a string literal", fset.Position(call.Pos()))
				return true
			}
			name, _ := strconv.Unquote(lit.Value)
			names = append(names, name)
			return true
		})
	}
	return names
}

// kettleHelp is what `kettle --help` lists: each of the named commands it
// lists (the longest name a line starts with: "swarm worker" before
// "swarm"), with its summary.
func kettleHelp(t *testing.T, names []string) map[string]string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	usage()
	os.Stderr = stderr
	w.Close()
	out, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	sort.Slice(names, func(i, j int) bool { return len(names[i]) > len(names[j]) })
	listed := map[string]string{}
	for _, line := range strings.Split(string(out), "\n") {
		for _, name := range names {
			if rest, ok := strings.CutPrefix(line, "  "+name+" "); ok {
				listed[name] = strings.TrimSpace(rest)
				break
			}
		}
	}
	return listed
}

// describe is the flag set `kettle name [sub]` parses, without running it.
func describe(name string, sub ...string) (got *flag.FlagSet) {
	c, ok := subcommands[name]
	if !ok {
		return nil
	}
	describeFlags = func(fs *flag.FlagSet) { got = fs }
	defer func() { describeFlags = nil }()
	c.run(context.Background(), sub)
	return got
}

// allFlagSets is FlagSets and the subcommands' flag sets after their parent
// (kettle swarm worker after kettle swarm), each with its summary from
// `kettle --help`; every flag set the source makes must be among them, and
// every command among the listed ones.
func allFlagSets(t *testing.T) (names, summaries []string, sets []*flag.FlagSet) {
	t.Helper()
	top, tops, topSets := FlagSets()
	byParent := map[string][]string{}
	help := kettleHelp(t, flagSetNames(t))
	for _, n := range flagSetNames(t) {
		if parent, sub, ok := strings.Cut(n, " "); ok {
			byParent[parent] = append(byParent[parent], sub)
		}
	}
	for i, name := range top {
		names, summaries, sets = append(names, name), append(summaries, tops[i]), append(sets, topSets[i])
		sort.Strings(byParent[name])
		for _, sub := range byParent[name] {
			fs := describe(name, sub)
			if fs == nil || fs.Name() != name+" "+sub {
				t.Errorf("kettle %s %s: kettle %s does not hand %q to its flag set %q", name, sub, name, sub, name+" "+sub)
				continue
			}
			summary, ok := help[name+" "+sub]
			if !ok {
				t.Errorf("kettle --help does not list kettle %s %s", name, sub)
			}
			names, summaries, sets = append(names, name+" "+sub), append(summaries, summary), append(sets, fs)
		}
	}
	seen := map[string]bool{}
	for _, n := range names {
		seen[strings.Fields(n)[0]] = true
	}
	for _, n := range flagSetNames(t) {
		if !seen[strings.Fields(n)[0]] {
			t.Errorf("flag set %q: its command is not in kettle --help", n)
		}
	}
	return names, summaries, sets
}

// configurationReference is docs/configuration.md: every flag of every
// command and subcommand with its environment twin, default and help line.
func configurationReference(t *testing.T) string {
	var b strings.Builder
	b.WriteString("# Configuration reference\n\n")
	b.WriteString("<!-- Generated by `make docs` from the flag sets of cmd/kettle: do not edit. -->\n\n")
	b.WriteString("Every flag of every `kettle` command, as `kettle COMMAND --help` prints it.\n")
	b.WriteString("Every flag has an environment twin (`--ingest-queue` ↔ `KETTLE_INGEST_QUEUE`);\n")
	b.WriteString("a flag given on the command line wins over its environment variable.\n")
	b.WriteString("How to use them together: [operations.md](operations.md).\n\n")
	names, summaries, sets := allFlagSets(t)
	for i, name := range names {
		fmt.Fprintf(&b, "- [`kettle %s`](#kettle-%s): %s\n", name, strings.ReplaceAll(name, " ", "-"), summaries[i])
	}
	for i, name := range names {
		fmt.Fprintf(&b, "\n## kettle %s\n\n%s.\n\n", name, upperFirst(summaries[i]))
		b.WriteString("| flag | environment | default | what |\n|---|---|---|---|\n")
		sets[i].VisitAll(func(f *flag.Flag) {
			def := "—"
			if f.DefValue != "" {
				def = "`" + f.DefValue + "`"
			}
			fmt.Fprintf(&b, "| `--%s` | `%s` | %s | %s |\n", f.Name, envName(f.Name), def, mdCell(f.Usage))
		})
	}
	return b.String()
}

// apiReference is docs/api.md: one line per operation of the OpenAPI
// document, in its order.
func apiReference(spec []byte) (string, error) {
	type operation struct {
		Summary   string                     `json:"summary"`
		Security  []map[string][]string      `json:"security"`
		Responses map[string]json.RawMessage `json:"responses"`
	}
	var doc struct {
		Info struct {
			Title   string `json:"title"`
			Version string `json:"version"`
		} `json:"info"`
		Paths json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(spec, &doc); err != nil {
		return "", err
	}
	paths, err := orderedKeys(doc.Paths)
	if err != nil {
		return "", fmt.Errorf("paths: %w", err)
	}
	var all map[string]map[string]operation
	if err := json.Unmarshal(doc.Paths, &all); err != nil {
		return "", fmt.Errorf("paths: %w", err)
	}
	who := map[string]string{"operatorToken": "operator", "deviceToken": "device (v1 token)", "servantCookie": "device (case-study cookie)"}
	var b strings.Builder
	b.WriteString("# API reference\n\n")
	b.WriteString("<!-- Generated by `make docs` from httpapi/openapi.json: do not edit. -->\n\n")
	fmt.Fprintf(&b, "%s, version %s. The full document, with every schema, is served by\n", doc.Info.Title, doc.Info.Version)
	b.WriteString("`kettle serve` at `GET /openapi.json` (source: [httpapi/openapi.json](../httpapi/openapi.json));\n")
	b.WriteString("the API tests send every request through a validator built from it.\n\n")
	b.WriteString("| method | path | who | what | responses |\n|---|---|---|---|---|\n")
	for _, p := range paths {
		for _, m := range []string{"get", "put", "post", "delete", "patch"} {
			op, ok := all[p][m]
			if !ok {
				continue
			}
			var whom []string
			for _, s := range op.Security {
				for k := range s {
					whom = append(whom, who[k])
				}
			}
			if len(whom) == 0 {
				whom = []string{"anyone"}
			}
			codes := make([]string, 0, len(op.Responses))
			for c := range op.Responses {
				codes = append(codes, c)
			}
			sort.Strings(codes)
			fmt.Fprintf(&b, "| %s | `%s` | %s | %s | %s |\n", strings.ToUpper(m), p, strings.Join(whom, ", "), mdCell(op.Summary), strings.Join(codes, " "))
		}
	}
	return b.String(), nil
}

// orderedKeys returns the keys of a JSON object in document order.
func orderedKeys(obj json.RawMessage) ([]string, error) {
	dec := json.NewDecoder(bytes.NewReader(obj))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("want an object")
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		keys = append(keys, tok.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return nil, err
		}
	}
	return keys, nil
}

func mdCell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(strings.TrimSpace(s))
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}
