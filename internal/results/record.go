package results

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"
)

// A bench script collects its figures as lines of a figures file while it
// runs (bench/lib/record.sh's rec_fig, or one of the Figures… helpers
// below), then turns the file into one record with Collect and Append:
//
//	figure NAME=VALUE:UNIT
//	ceiling NAME=VALUE:UNIT
//	ratio N
//
// A name may hold spaces and '='; the value is after the last '='.

// FigureLine is the figures-file line of one figure.
func FigureLine(name string, value float64, unit string) string {
	return fmt.Sprintf("figure %s=%s:%s", name, num(value), unit)
}

// ParseFigure reads NAME=VALUE:UNIT. A value that is not a finite number is
// an error naming the figure: the run did not print what it measures.
func ParseFigure(spec string) (Figure, error) {
	i := strings.LastIndex(spec, "=")
	if i < 0 {
		return Figure{}, fmt.Errorf("figure %q: want NAME=VALUE:UNIT", spec)
	}
	name, rest := strings.TrimSpace(spec[:i]), spec[i+1:]
	value, unit, ok := strings.Cut(rest, ":")
	unit = strings.TrimSpace(unit)
	if !ok || name == "" || unit == "" {
		return Figure{}, fmt.Errorf("figure %q: want NAME=VALUE:UNIT", spec)
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return Figure{}, fmt.Errorf("figure %q: value %q is not a number (the run did not measure it)", name, strings.TrimSpace(value))
	}
	return Figure{Name: name, Value: v, Unit: unit}, nil
}

// Collect reads a figures file into a record of bench, rerun by command, on
// this machine at this commit (read from git in dir). Every line must parse.
func Collect(r io.Reader, bench, command, dir string) (Record, error) {
	rec := Record{Bench: bench, Command: command, TimeUTC: time.Now().UTC().Truncate(time.Second), Machine: ThisMachine(), Commit: commit(dir)}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		kind, rest, _ := strings.Cut(line, " ")
		switch kind {
		case "figure", "ceiling":
			f, err := ParseFigure(rest)
			if err != nil {
				return Record{}, fmt.Errorf("figures line %d: %w", n, err)
			}
			if kind == "figure" {
				rec.Figures = append(rec.Figures, f)
			} else {
				rec.Ceiling = &f
			}
		case "ratio":
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
				return Record{}, fmt.Errorf("figures line %d: ratio %q is not a number", n, rest)
			}
			rec.Ratio = &v
		default:
			return Record{}, fmt.Errorf("figures line %d: %q is not a figure, ceiling or ratio line", n, line)
		}
	}
	if err := sc.Err(); err != nil {
		return Record{}, err
	}
	return rec, rec.check()
}

// Append writes rec as one line at the end of the log.
func Append(path string, rec Record) error {
	if err := rec.check(); err != nil {
		return err
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(line, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("append to %s: %w", path, err)
	}
	return f.Close()
}

// ThisMachine describes the machine the process runs on.
func ThisMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), CPUModel: "unknown"}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			m.LoadAvg = strings.Join(f[:3], " ")
		}
	}
	return m
}

func commit(dir string) string {
	out, err := exec.Command("git", "-C", dir, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

// SwarmFigures are the figures of a kettle swarm run (its results.json):
// each endpoint's p99 and rate, the run's errors, and the audit's lost and
// duplicated readings, each name prefixed with label.
func SwarmFigures(r io.Reader, label string) ([]string, error) {
	var res struct {
		Totals struct {
			Endpoints map[string]struct {
				P99Ms     float64 `json:"p99_ms"`
				PerSecond float64 `json:"per_second"`
			} `json:"endpoints"`
			Errors float64 `json:"errors"`
		} `json:"totals"`
		Audit *struct {
			Lost       float64 `json:"lost"`
			Duplicated float64 `json:"duplicated"`
		} `json:"audit"`
	}
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return nil, fmt.Errorf("swarm results: %w", err)
	}
	pre := ""
	if label != "" {
		pre = label + " "
	}
	names := make([]string, 0, len(res.Totals.Endpoints))
	for n := range res.Totals.Endpoints {
		names = append(names, n)
	}
	sort.Strings(names)
	var out []string
	for _, n := range names {
		e := res.Totals.Endpoints[n]
		out = append(out, FigureLine(pre+n+" p99", e.P99Ms, "ms"), FigureLine(pre+n+" req/s", e.PerSecond, "req/s"))
	}
	out = append(out, FigureLine(pre+"errors", res.Totals.Errors, "requests"))
	if res.Audit != nil {
		out = append(out, FigureLine(pre+"audit lost", res.Audit.Lost, "readings"), FigureLine(pre+"audit duplicated", res.Audit.Duplicated, "readings"))
	}
	return out, nil
}

var resultKV = regexp.MustCompile(`(\w+)=(-?[\d.]+(?:e[-+]?\d+)?)(?:\s|$)`)

// keyUnits maps a RESULT key's suffix (or prefix) to its unit, first match.
var keyUnits = []struct{ key, unit string }{
	{"_us_per_row", "µs/row"}, {"_us_per_req", "µs/req"}, {"_us_per_request", "µs/req"}, {"rows_per_s", "rows/s"},
	{"_per_s", "/s"}, {"rps", "req/s"}, {"_ms", "ms"}, {"seconds", "s"}, {"_s", "s"}, {"bytes", "bytes"},
	{"_pct", "%"}, {"ratio", "ratio"}, {"_mib", "MiB"},
}

// ResultFigures are the figures of every "RESULT NAME KEY=VALUE…" line (what
// bench/pgbench and the scripts' own summaries print): one per numeric
// KEY=VALUE, named "LABEL NAME KEY", its unit read from the key.
func ResultFigures(r io.Reader, label string) ([]string, error) {
	pre := ""
	if label != "" {
		pre = label + " "
	}
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[0] != "RESULT" {
			continue
		}
		for _, m := range resultKV.FindAllStringSubmatch(sc.Text(), -1) {
			v, err := strconv.ParseFloat(m[2], 64)
			if err != nil {
				continue
			}
			out = append(out, FigureLine(pre+f[1]+" "+m[1], v, keyUnit(m[1])))
		}
	}
	return out, sc.Err()
}

func keyUnit(key string) string {
	for _, u := range keyUnits {
		if strings.HasSuffix(key, u.key) || strings.HasPrefix(key, strings.Trim(u.key, "_")) {
			return u.unit
		}
	}
	return "count"
}

// JSONFigure is the figure NAME=PATH:UNIT of a JSON document: PATH is a
// dotted path of object keys and array indexes (".totals.acked",
// ".figures.0.value"). A path that is not there, or not a number, is an
// error; a PATH ending in '?' gives no figure then instead.
func JSONFigure(doc any, spec string) (string, bool, error) {
	i := strings.LastIndex(spec, "=")
	if i < 0 {
		return "", false, fmt.Errorf("%q: want NAME=PATH:UNIT", spec)
	}
	name := spec[:i]
	path, unit, ok := strings.Cut(spec[i+1:], ":")
	if !ok || name == "" || unit == "" {
		return "", false, fmt.Errorf("%q: want NAME=PATH:UNIT", spec)
	}
	optional := strings.HasSuffix(path, "?")
	path = strings.TrimSuffix(path, "?")
	v := doc
	for _, k := range strings.Split(strings.Trim(path, "."), ".") {
		switch x := v.(type) {
		case map[string]any:
			v = x[k]
		case []any:
			n, err := strconv.Atoi(k)
			if err != nil || n < 0 || n >= len(x) {
				v = nil
			} else {
				v = x[n]
			}
		default:
			v = nil
		}
	}
	f, isNum := v.(float64)
	if !isNum {
		if optional {
			return "", false, nil
		}
		return "", false, fmt.Errorf("figure %q: %s is not a number in the document (%v)", name, path, v)
	}
	return FigureLine(name, f, unit), true, nil
}

// window is one of the swarm's progress lines ("[  35s] kettles … |
// measurement 120/s p50 1.2ms p99 3.4ms | command …").
type window struct {
	at       int
	p50, p99 map[string]float64
}

var (
	windowAt = regexp.MustCompile(`^\[\s*(\d+)s\]`)
	windowEP = regexp.MustCompile(`(\w+) [\d.]+/s p50 ([\d.]+)ms p99 ([\d.]+)ms`)
)

func windows(r io.Reader) ([]window, error) {
	var ws []window
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		m := windowAt.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		at, _ := strconv.Atoi(m[1])
		w := window{at: at, p50: map[string]float64{}, p99: map[string]float64{}}
		for _, e := range windowEP.FindAllStringSubmatch(sc.Text(), -1) {
			w.p50[e[1]], _ = strconv.ParseFloat(e[2], 64)
			w.p99[e[1]], _ = strconv.ParseFloat(e[3], 64)
		}
		ws = append(ws, w)
	}
	return ws, sc.Err()
}

// Windows summarises an endpoint over the swarm's 5 s progress windows that
// end within [from, to] seconds (to < 0: no end): the worst window's p99,
// the median of the windows' p50, and how many windows there were.
func Windows(r io.Reader, endpoint string, from, to int) (worstP99, medianP50 float64, n int, err error) {
	ws, err := windows(r)
	if err != nil {
		return 0, 0, 0, err
	}
	var p50s []float64
	for _, w := range ws {
		if w.at < from || (to >= 0 && w.at > to) {
			continue
		}
		if p, ok := w.p99[endpoint]; ok {
			worstP99 = max(worstP99, p)
			p50s = append(p50s, w.p50[endpoint])
		}
		n++
	}
	return worstP99, Median(p50s), n, nil
}

// Median of vs (NaN when empty).
func Median(vs []float64) float64 {
	if len(vs) == 0 {
		return math.NaN()
	}
	s := append([]float64(nil), vs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
