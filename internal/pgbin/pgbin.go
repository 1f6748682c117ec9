// Package pgbin finds installed PostgreSQL programs where Debian puts them.
package pgbin

import (
	"path/filepath"
	"sort"
	"strconv"
)

// Dirs returns the /usr/lib/postgresql/N/bin directories, newest N first.
func Dirs() []string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	version := func(dir string) int {
		v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
		return v
	}
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	return dirs
}
