package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
)

// Stamped by `make release` (-ldflags -X); a plain `go build` leaves the
// defaults and version falls back to what the Go toolchain recorded.
var (
	version = "dev"
	commit  = ""
	date    = ""
)

func init() {
	register("version", "print the version, commit and build date", runVersion)
}

// buildInfo is what `kettle version` prints, one field a line.
func buildInfo() (v, c, d string) {
	v, c, d = version, commit, date
	if c != "" {
		return v, c, d
	}
	// A `go build` in a checkout records the VCS state itself.
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				c = s.Value
			case "vcs.time":
				d = s.Value
			case "vcs.modified":
				if s.Value == "true" && c != "" {
					c += "-dirty"
				}
			}
		}
	}
	if c == "" {
		c = "unknown"
	}
	if d == "" {
		d = "unknown"
	}
	return v, c, d
}

func runVersion(_ context.Context, args []string) error {
	fs := newFlagSet("version", "", "Prints the release version, the commit it was built from, the build date (the commit's time, so two builds of one commit are identical), the Go version and the platform.")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	v, c, d := buildInfo()
	fmt.Fprintf(os.Stdout, "kettle %s\ncommit %s\ndate %s\ngo %s\nplatform %s/%s\n", v, c, d, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return nil
}
