package blackhole

import (
	"net/url"
	"strings"
)

func pgURL(dsn string) (*url.URL, bool) {
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, false
	}
	return u, true
}

// hostPort reads host and port from a DSN (port 5432 when absent; with a
// keyword repeated, the last one, as libpq does).
func hostPort(dsn string) (host, port string) {
	port = "5432"
	if u, ok := pgURL(dsn); ok {
		if p := u.Port(); p != "" {
			port = p
		}
		return u.Hostname(), port
	}
	for _, kv := range strings.Fields(dsn) {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "host":
			host = v
		case "port":
			port = v
		}
	}
	return host, port
}
