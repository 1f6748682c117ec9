#!/usr/bin/env python3
"""Append one benchmark run to the results log, bench/results.jsonl.

Every bench script calls this once at the end of a run, with the figures it
printed, so that docs/results.md and the README's headline table (`make
results`) are rendered from recorded runs and no figure is typed by hand.

    python3 bench/record.py --bench ingest.sh \
        --command "DEVICES=2000 DURATION=20s bench/ingest.sh" \
        --figure "kettle serve=10665:req/s" --figure "bare handler=17120:req/s" \
        --ceiling "bare handler=17120:req/s" --ratio 0.623

A figure is NAME=VALUE:UNIT (the name may hold spaces and '=' but not ':' after
the value). A figure whose value is not a number (the run did not print it) is
left out with a warning; a run with no figure left is not recorded. Recording
never fails the benchmark: problems are warnings on stderr.

The record (one JSON line; the shape is fixed, docs/results.md reads it):
  {"bench", "commit", "time_utc", "machine": {"cores", "cpu_model", "loadavg"},
   "command", "figures": [{"name", "value", "unit"}], "ceiling"?, "ratio"?}

--from FILE adds the lines of FILE, each "figure NAME=VALUE:UNIT", "ceiling
NAME=VALUE:UNIT" or "ratio N": what bench/lib/record.sh's rec_fig, rec_ceiling
and rec_ratio (and a script's embedded python, through $KETTLE_REC_FIGS) wrote
during the run.

KETTLE_RESULTS names another log (tests, or a scratch run); KETTLE_NO_RECORD=1
records nothing.
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn(msg):
    print("record: " + msg, file=sys.stderr)


def number(text):
    """The value of a figure as a JSON number, or None."""
    try:
        v = float(text)
    except ValueError:
        return None
    if math.isnan(v) or math.isinf(v):
        return None
    return int(v) if v.is_integer() and "." not in text and "e" not in text.lower() else v


def figure(spec):
    """NAME=VALUE:UNIT → {"name", "value", "unit"}, or None."""
    name, sep, rest = spec.rpartition("=")
    value, sep2, unit = rest.partition(":")
    if not sep or not sep2 or not name.strip() or not unit.strip():
        warn(f"figure {spec!r}: want NAME=VALUE:UNIT; left out")
        return None
    v = number(value.strip())
    if v is None:
        warn(f"figure {name.strip()!r}: value {value.strip()!r} is not a number; left out")
        return None
    return {"name": name.strip(), "value": v, "unit": unit.strip()}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


def commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="the script's name, e.g. ingest.sh")
    p.add_argument("--command", required=True, help="the exact command line that reruns this run")
    p.add_argument("--figure", action="append", default=[], help="NAME=VALUE:UNIT (repeat)")
    p.add_argument("--ceiling", help="NAME=VALUE:UNIT: what the figures are held against")
    p.add_argument("--ratio", help="the run's ratio to its ceiling (or B/A)")
    p.add_argument("--from", dest="from_file", help="a file of figure/ceiling/ratio lines")
    p.add_argument("--log", default=os.environ.get("KETTLE_RESULTS", os.path.join(ROOT, "bench", "results.jsonl")))
    a = p.parse_args(argv)
    if os.environ.get("KETTLE_NO_RECORD") == "1":
        return 0
    if a.from_file:
        try:
            with open(a.from_file) as f:
                for line in f:
                    kind, _, rest = line.strip().partition(" ")
                    if kind == "figure":
                        a.figure.append(rest)
                    elif kind == "ceiling":
                        a.ceiling = rest
                    elif kind == "ratio":
                        a.ratio = rest
                    elif line.strip():
                        warn(f"{a.from_file}: line {line.strip()!r} is not figure, ceiling or ratio; left out")
        except OSError as e:
            warn(f"cannot read {a.from_file}: {e}")
    figures = [f for f in (figure(s) for s in a.figure) if f]
    if not figures:
        warn(f"{a.bench}: no figure to record; nothing written")
        return 0
    rec = {
        "bench": a.bench,
        "commit": commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cores": os.cpu_count() or 0, "cpu_model": cpu_model(), "loadavg": loadavg()},
        "command": a.command,
        "figures": figures,
    }
    if a.ceiling:
        c = figure(a.ceiling)
        if c:
            rec["ceiling"] = c
    if a.ratio is not None:
        r = number(a.ratio.strip())
        if r is None:
            warn(f"ratio {a.ratio!r} is not a number; left out")
        else:
            rec["ratio"] = r
    line = json.dumps(rec, ensure_ascii=False, separators=(",", ":"))
    try:
        with open(a.log, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        warn(f"cannot append to {a.log}: {e}")
        return 0
    print(f"recorded in {os.path.relpath(a.log, os.getcwd())}: {a.bench} at {rec['commit']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
