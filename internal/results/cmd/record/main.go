// Command record is how the bench scripts record a run in
// bench/results.jsonl and read the figures out of what they ran
// (bench/lib/record.sh wraps it). It needs nothing of kettle's: the record's
// shape is internal/results', which renders the log.
//
//	record append BENCH COMMAND FIGURES_FILE   one record from a figures file (results.Collect)
//	record swarm RESULTS_JSON [LABEL]          figure lines of a kettle swarm run
//	record results FILE [LABEL]                figure lines of RESULT NAME KEY=VALUE… lines
//	record json FILE NAME=PATH:UNIT…           figure lines of a JSON document's numbers
//	record windows SWARM_LOG ENDPOINT FROM TO  "WORST_P99 MEDIAN_P50 N" of the swarm's 5 s windows
//	record median                              the median of the numbers on stdin
//	record topo-cpu KETTLE_HA_DIR              CPU seconds of each process of a deploy/cluster.sh topology, JSON
//	record free-port                           a TCP port free on 127.0.0.1 now
//
// append writes to $KETTLE_RESULTS, or bench/results.jsonl of the checkout;
// with SMOKE=1 and no $KETTLE_RESULTS it checks the record and writes
// nothing. Any failure exits 1 with what went wrong: a run whose record
// fails has failed.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kettlefleet/kettlefleet/internal/results"
)

func main() {
	if err := run(os.Args[1:], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "record:", err)
		os.Exit(1)
	}
}

const usage = "usage: record append BENCH COMMAND FIGURES_FILE | swarm RESULTS_JSON [LABEL] | results FILE [LABEL] | json FILE NAME=PATH:UNIT… | windows SWARM_LOG ENDPOINT FROM TO | median | topo-cpu KETTLE_HA_DIR | free-port"

func run(args []string, stdin io.Reader, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New(usage)
	}
	cmd, args := args[0], args[1:]
	label := func(i int) string {
		if len(args) > i {
			return args[i]
		}
		return ""
	}
	switch {
	case cmd == "append" && len(args) == 3:
		return appendRecord(args[0], args[1], args[2], stdout)
	case (cmd == "swarm" || cmd == "results") && (len(args) == 1 || len(args) == 2):
		f, err := os.Open(args[0])
		if err != nil {
			return err
		}
		defer f.Close()
		read := results.SwarmFigures
		if cmd == "results" {
			read = results.ResultFigures
		}
		lines, err := read(f, label(1))
		if err != nil {
			return fmt.Errorf("%s: %w", args[0], err)
		}
		if len(lines) == 0 {
			return fmt.Errorf("%s: no figures in it", args[0])
		}
		return printLines(stdout, lines)
	case cmd == "json" && len(args) >= 2:
		b, err := os.ReadFile(args[0])
		if err != nil {
			return err
		}
		var doc any
		if err := json.Unmarshal(b, &doc); err != nil {
			return fmt.Errorf("%s: %w", args[0], err)
		}
		var lines []string
		for _, spec := range args[1:] {
			line, ok, err := results.JSONFigure(doc, spec)
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			if ok {
				lines = append(lines, line)
			}
		}
		return printLines(stdout, lines)
	case cmd == "windows" && len(args) == 4:
		from, err1 := strconv.Atoi(args[2])
		to, err2 := strconv.Atoi(args[3])
		if err := errors.Join(err1, err2); err != nil {
			return fmt.Errorf("windows: FROM and TO are seconds: %w", err)
		}
		f, err := os.Open(args[0])
		if err != nil {
			return err
		}
		defer f.Close()
		p99, p50, n, err := results.Windows(f, args[1], from, to)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(stdout, "%.2f %.2f %d\n", p99, p50, n)
		return err
	case cmd == "free-port" && len(args) == 0:
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		defer l.Close()
		_, err = fmt.Fprintln(stdout, l.Addr().(*net.TCPAddr).Port)
		return err
	case cmd == "topo-cpu" && len(args) == 1:
		return topoCPU(args[0], stdout)
	case cmd == "median" && len(args) == 0:
		b, err := io.ReadAll(stdin)
		if err != nil {
			return err
		}
		var vs []float64
		for _, w := range strings.Fields(string(b)) {
			v, err := strconv.ParseFloat(w, 64)
			if err != nil {
				return fmt.Errorf("median: %q is not a number", w)
			}
			vs = append(vs, v)
		}
		if len(vs) == 0 {
			return errors.New("median: no numbers on stdin")
		}
		_, err = fmt.Fprintln(stdout, strconv.FormatFloat(results.Median(vs), 'g', 6, 64))
		return err
	}
	return errors.New(usage)
}

func printLines(w io.Writer, lines []string) error {
	for _, l := range lines {
		if _, err := fmt.Fprintln(w, l); err != nil {
			return err
		}
	}
	return nil
}

func appendRecord(bench, command, figures string, stdout io.Writer) error {
	f, err := os.Open(figures)
	if err != nil {
		return err
	}
	defer f.Close()
	root := "."
	if out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output(); err == nil {
		root = strings.TrimSpace(string(out))
	}
	rec, err := results.Collect(f, bench, command, root)
	if err != nil {
		return fmt.Errorf("%s: %w", bench, err)
	}
	log := os.Getenv("KETTLE_RESULTS")
	if log == "" && (os.Getenv("SMOKE") == "1" || os.Getenv("KETTLE_NO_RECORD") == "1") {
		fmt.Fprintf(stdout, "record: %s: %d figures, not recorded (smoke run)\n", bench, len(rec.Figures))
		return nil
	}
	if log == "" {
		log = filepath.Join(root, "bench", "results.jsonl")
	}
	if err := results.Append(log, rec); err != nil {
		return fmt.Errorf("%s: %w", bench, err)
	}
	fmt.Fprintf(stdout, "recorded in %s: %s at %s, %d figures\n", log, bench, rec.Commit, len(rec.Figures))
	return nil
}
