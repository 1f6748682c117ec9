// Command kettle is kettlefleet's one binary: the backend (serve) and the lab
// that proves it (swarm, seed, report, capacity, demo) and its upkeep (expire,
// backup, restore).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// subcommand is one `kettle NAME` entry. run gets the arguments after NAME.
type subcommand struct {
	summary string
	run     func(ctx context.Context, args []string) error
}

var subcommands = map[string]subcommand{}

// register adds a subcommand; each lives in its own file.
func register(name, summary string, run func(ctx context.Context, args []string) error) {
	subcommands[name] = subcommand{summary, run}
}

var order = []string{"serve", "token", "seed", "expire", "prune", "backup", "restore", "swarm", "report", "capacity", "demo", "version"}

func usage() {
	fmt.Fprintf(os.Stderr, "kettle — the kettlefleet backend and the lab that proves it\n\nUsage: kettle COMMAND [flags]\n\nCommands:\n")
	for _, name := range order {
		if c, ok := subcommands[name]; ok {
			fmt.Fprintf(os.Stderr, "  %-12s %s\n", name, c.summary)
		}
	}
	fmt.Fprintf(os.Stderr, "  %-12s %s\n", "swarm worker", "a worker of the distributed lab: kettle swarm --workers and kettle capacity --workers split their fleet over such processes")
	fmt.Fprintf(os.Stderr, "\nEvery flag has an environment twin: --ingest-queue ↔ KETTLE_INGEST_QUEUE.\nRun `kettle COMMAND --help` for the flags of one command.\n")
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	c, ok := subcommands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "kettle: unknown command %q\n\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := c.run(ctx, os.Args[2:])
	stop()
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		var ec exitCode
		if errors.As(err, &ec) {
			fmt.Fprintf(os.Stderr, "kettle %s: %s\n", os.Args[1], ec.msg)
			os.Exit(ec.code)
		}
		fmt.Fprintf(os.Stderr, "kettle %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// exitCode is an error that asks for a specific exit status (documented per
// command, e.g. the swarm's audit failures).
type exitCode struct {
	code int
	msg  string
}

func (e exitCode) Error() string { return e.msg }
