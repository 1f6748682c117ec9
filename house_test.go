package kettle_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// maxFuncLines is the most lines a non-test function may take: one a
// reader can hold. Longer ones are split by attack, phase or concern.
const maxFuncLines = 120

// TestFunctionsFit walks every Go file of the tree (bench, chaos and the
// nested deploy/dist module included; tests and .deps excluded) and names
// each function or function literal longer than maxFuncLines.
func TestFunctionsFit(t *testing.T) {
	fset := token.NewFileSet()
	files := 0
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); p != "." && (strings.HasPrefix(n, ".") || n == "testdata" || n == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files++
		ast.Inspect(f, func(n ast.Node) bool {
			var body *ast.BlockStmt
			name := "a function literal"
			switch x := n.(type) {
			case *ast.FuncDecl:
				body, name = x.Body, x.Name.Name
			case *ast.FuncLit:
				body = x.Body
			}
			if body == nil {
				return true
			}
			if l := fset.Position(body.End()).Line - fset.Position(n.Pos()).Line + 1; l > maxFuncLines {
				t.Errorf("%s: %s is %d lines (at most %d)", fset.Position(n.Pos()), name, l, maxFuncLines)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 100 {
		t.Fatalf("walked %d Go files: not the whole tree", files)
	}
}
