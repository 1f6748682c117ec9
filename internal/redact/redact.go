// Package redact takes secrets out of what kettlefleet writes for people:
// database connection strings in logs and errors, and the command lines
// that results and reports print so that a run can be reproduced.
package redact

import (
	"net/url"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Mask stands where a secret was.
const Mask = "xxx"

// fallback masks what looks like a password when the DSN does not parse:
// a URL's user:password@ and a keyword or query password=.
var fallback = []*regexp.Regexp{
	regexp.MustCompile(`(://[^:/@?#]*:)[^@/?#]*@`),
	regexp.MustCompile(`(?i)(password=)('(?:[^'\\]|\\.)*'|[^ &]*)`),
}

// DSN returns dsn with its password masked, in whichever form it is given:
// a URL's userinfo (postgres://u:p@h/db), a query parameter (?password=p)
// or a keyword/value string (host=h password=p). The password is found by
// pgconn's own parser, the one that connects, so what it would send is
// what is masked; a DSN it cannot parse is masked by pattern. sqlite:
// DSNs hold no secret and come back as they are.
func DSN(dsn string) string {
	if dsn == "" || strings.HasPrefix(dsn, "sqlite:") {
		return dsn
	}
	out := dsn
	if cfg, err := pgconn.ParseConfig(dsn); err == nil && cfg.Password != "" && inString(dsn, cfg.Password) {
		for _, form := range []string{cfg.Password, url.QueryEscape(cfg.Password), url.PathEscape(cfg.Password), url.UserPassword("", cfg.Password).String()[1:]} {
			if form != "" {
				out = strings.ReplaceAll(out, form, Mask)
			}
		}
	}
	for _, re := range fallback {
		out = re.ReplaceAllString(out, "${1}"+Mask)
	}
	return out
}

// inString reports whether the password is spelled in the DSN itself, in
// any of its escapings (it may come from PGPASSWORD or a passfile instead).
func inString(dsn, pw string) bool {
	return strings.Contains(dsn, pw) || strings.Contains(dsn, url.QueryEscape(pw)) || strings.Contains(dsn, url.PathEscape(pw))
}

// Args returns a copy of a command's arguments with the value of every
// flag named in secret masked ("--secret v", "--secret=v", one or two
// dashes) and the value of every flag named in dsns passed through DSN.
func Args(args []string, secret, dsns map[string]bool) []string {
	out := append([]string(nil), args...)
	for i := 0; i < len(out); i++ {
		a := out[i]
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, val, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		prefix := a[:len(a)-len(strings.TrimLeft(a, "-"))] + name + "="
		switch {
		case secret[name] && inline:
			out[i] = prefix + Mask
		case secret[name] && i+1 < len(out):
			out[i+1] = Mask
			i++
		case dsns[name] && inline:
			out[i] = prefix + DSN(val)
		case dsns[name] && i+1 < len(out):
			out[i+1] = DSN(out[i+1])
			i++
		}
	}
	return out
}
