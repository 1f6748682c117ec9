package results

import (
	"fmt"
	"regexp"
	"strconv"
)

// citation is a figure a document cites from the log:
//
//	<!--fig ingest.sh:38 "kettle serve, acknowledged"-->…<!--/fig-->
//
// names the record on line 38 of bench/results.jsonl (which must be a run of
// ingest.sh) and one of its figures, its ceiling (by name) or "ratio".
// Cite writes the figure between the markers, linked to its record, so that
// no measured number in the prose is typed by hand.
var citation = regexp.MustCompile(`<!--fig ([^:\s]+):(\d+) "([^"]+)"-->(.*?)<!--/fig-->`)

// Cite returns doc with every citation's text rendered from recs: the
// value, its unit, and a link to the record's line (log is the log's path
// relative to the document). A citation of a line that is not there, of
// another benchmark, or of a figure the record lacks is an error naming it.
func Cite(doc string, recs []Record, log string) (string, error) {
	byLine := map[int]Record{}
	for _, r := range recs {
		byLine[r.Line] = r
	}
	var err error
	out := citation.ReplaceAllStringFunc(doc, func(m string) string {
		s := citation.FindStringSubmatch(m)
		bench, name := s[1], s[3]
		line, _ := strconv.Atoi(s[2])
		r, ok := byLine[line]
		if !ok || r.Bench != bench {
			if err == nil {
				err = fmt.Errorf("citation %s:%d %q: line %d of the log is not a run of %s", bench, line, name, line, bench)
			}
			return m
		}
		text, ok := citedValue(r, name)
		if !ok {
			if err == nil {
				err = fmt.Errorf("citation %s:%d %q: the record has no such figure", bench, line, name)
			}
			return m
		}
		return fmt.Sprintf(`<!--fig %s:%d "%s"-->[%s](%s#L%d)<!--/fig-->`, bench, line, name, text, log, line)
	})
	return out, err
}

func citedValue(r Record, name string) (string, bool) {
	for _, f := range r.Figures {
		if f.Name == name {
			return num(f.Value) + " " + f.Unit, true
		}
	}
	if r.Ceiling != nil && r.Ceiling.Name == name {
		return num(r.Ceiling.Value) + " " + r.Ceiling.Unit, true
	}
	if name == "ratio" && r.Ratio != nil {
		return num(*r.Ratio) + "×", true
	}
	return "", false
}
