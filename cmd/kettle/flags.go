package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/redact"
)

// envName is the environment twin of a flag: --ingest-queue → KETTLE_INGEST_QUEUE.
func envName(flagName string) string {
	return "KETTLE_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// newFlagSet returns a flag set whose usage lists every flag with its
// environment twin; it is the configuration reference of the command.
func newFlagSet(name, synopsis, doc string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: kettle %s %s\n\n%s\n\nFlags (each also read from its environment variable; a flag on the command line wins):\n", name, synopsis, strings.TrimSpace(doc))
		fs.VisitAll(func(f *flag.Flag) {
			def := ""
			if f.DefValue != "" {
				def = fmt.Sprintf(" (default %s)", f.DefValue)
			}
			fmt.Fprintf(w, "  --%s  [%s]%s\n      %s\n", f.Name, envName(f.Name), def, f.Usage)
		})
	}
	return fs
}

// describeFlags, when set, receives each command's complete flag set in
// place of parsing it (the command then returns flag.ErrHelp): the
// configuration reference, docs/configuration.md, is generated from the
// flag sets the commands really use (see FlagSets).
var describeFlags func(*flag.FlagSet)

// parseFlags parses args, then fills every flag not given on the command line
// from its environment twin.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := parseArgs(fs, args); err != nil {
		return err
	}
	err := flagsFromEnv(fs)
	if err == nil && fs.NArg() > 0 {
		err = fmt.Errorf("unexpected argument %q (flags only; see --help)", fs.Arg(0))
	}
	return err
}

// parseArgs is fs.Parse, or hands fs to describeFlags when that is set.
func parseArgs(fs *flag.FlagSet, args []string) error {
	if describeFlags != nil {
		describeFlags(fs)
		return flag.ErrHelp
	}
	return fs.Parse(args)
}

// flagsFromEnv fills every flag not given on the command line from its
// environment twin.
func flagsFromEnv(fs *flag.FlagSet) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			if e := f.Value.Set(v); e != nil {
				err = fmt.Errorf("environment %s=%q: %w", envName(f.Name), v, e)
			}
		}
	})
	return err
}

// FlagSets returns the complete flag set of every command, in the order of
// `kettle --help`, without running any: what the configuration reference
// is generated from.
func FlagSets() (names, summaries []string, sets []*flag.FlagSet) {
	defer func() { describeFlags = nil }()
	for _, name := range order {
		c, ok := subcommands[name]
		if !ok {
			continue
		}
		var got *flag.FlagSet
		describeFlags = func(fs *flag.FlagSet) { got = fs }
		if err := c.run(context.Background(), nil); !errors.Is(err, flag.ErrHelp) || got == nil {
			panic(fmt.Sprintf("kettle %s: its flags are not parsed by parseFlags or parseArgs (%v)", name, err))
		}
		names, summaries, sets = append(names, name), append(summaries, c.summary), append(sets, got)
	}
	return names, summaries, sets
}

// parseTimeFlag reads the value of flag --name: RFC 3339 or YYYY-MM-DD (UTC).
func parseTimeFlag(name, v string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		if t, err = time.Parse(time.DateOnly, v); err != nil {
			return time.Time{}, fmt.Errorf("--%s %q: want RFC 3339 (2024-06-01T00:00:00Z) or YYYY-MM-DD", name, v)
		}
	}
	return t, nil
}

// retentionVar defines --retention, read by kettle.ParseRetention into d.
func retentionVar(fs *flag.FlagSet, d *time.Duration, usage string) {
	fs.Func("retention", usage, func(v string) (err error) {
		*d, err = kettle.ParseRetention(v)
		return err
	})
}

// pruneAgeVar defines an age flag of a prune: whole days or a Go duration,
// at least fleet.MinPruneAge (zeroOK: or 0, off). usage says so.
func pruneAgeVar(fs *flag.FlagSet, d *time.Duration, name, usage string, zeroOK bool) {
	fs.Func(name, usage, func(v string) (err error) {
		if zeroOK && v == "0" {
			*d = 0
			return nil
		}
		if *d, err = kettle.ParseAge(v); err != nil {
			return err
		}
		if *d < fleet.MinPruneAge {
			return fmt.Errorf("must be at least %s (a kettle registered just now has not reported yet), got %q", fleet.MinPruneAge, v)
		}
		return nil
	})
}

// sqliteFile returns the path of a sqlite:PATH --db.
func sqliteFile(dsn string) (string, error) {
	if strings.HasPrefix(dsn, "sqlite:") && len(dsn) > len("sqlite:") {
		return strings.TrimPrefix(dsn, "sqlite:"), nil
	}
	return "", fmt.Errorf("--db %q: want sqlite:PATH or postgres://user@host/db", dsn)
}

// dbName is what a message calls a PostgreSQL --db: its database name, not
// the DSN (which may hold a password).
func dbName(dsn string) string {
	if cfg, err := pgconn.ParseConfig(dsn); err == nil {
		return "PostgreSQL database " + cfg.Database
	}
	return "PostgreSQL"
}

// secretFileVars gives each named secret flag a twin --NAME-file (and so
// KETTLE_NAME_FILE) that reads the value from a file: secrets travel in
// files (systemd's LoadCredential, a Kubernetes Secret volume), never argv,
// where every user of the machine can read them. An empty or unreadable
// file is an error naming the flag, never an empty secret.
func secretFileVars(fs *flag.FlagSet, names ...string) {
	for _, name := range names {
		secretFlags[name] = true
		target := fs.Lookup(name)
		if target == nil {
			panic("secretFileVars: no flag --" + name)
		}
		fs.Func(name+"-file", "read --"+name+" from this file (a trailing newline is dropped); for secrets, better than the flag: argv is visible to every user of the machine", func(path string) error {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			v := strings.TrimRight(string(b), "\r\n")
			if v == "" {
				return fmt.Errorf("%s is empty", path)
			}
			return target.Value.Set(v)
		})
	}
}

// secretFlags are the flags whose values are secrets (every one given a
// -file twin by secretFileVars); dsnFlags hold a database DSN, which may
// carry a password.
var (
	secretFlags = map[string]bool{}
	dsnFlags    = map[string]bool{"db": true, "db-read": true}
)

// commandLine is the command that reproduces a run, as results.json and
// report.html print it: the arguments as given, each secret replaced by a
// mask and each DSN's password masked. Whoever reruns it gives the secrets
// again (their -file twins, or the environment).
func commandLine(name string, args []string) string {
	return strings.TrimSpace("kettle " + name + " " + strings.Join(redact.Args(args, secretFlags, dsnFlags), " "))
}
