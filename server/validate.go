package server

import (
	"fmt"
	"strings"
)

// MinSecretLen is the fewest characters an operator token or a device
// secret given by the operator may have; generated ones have 64.
const MinSecretLen = 16

// Validate returns every problem with c, the ingest pipeline's
// (fleet.Config.Validate) included, each naming the kettle serve flag: serve
// and demo call it before Start, so both refuse what the other refuses.
// Zero fields take their defaults and are valid.
func (c Config) Validate() []error {
	errs := c.Ingest.Validate()
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.MaxConns < 0 {
		bad("--max-conns %d: want the open HTTP connections allowed, or 0 for the open-file limit − 1024", c.MaxConns)
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		bad("--tls-cert and --tls-key go together: give both PEM files, or neither for plain TCP")
	}
	for _, d := range []struct {
		flag string
		v    any
		neg  bool
	}{
		{"read-header-timeout", c.ReadHeaderTimeout, c.ReadHeaderTimeout < 0},
		{"read-timeout", c.ReadTimeout, c.ReadTimeout < 0},
		{"write-timeout", c.WriteTimeout, c.WriteTimeout < 0},
		{"idle-timeout", c.IdleTimeout, c.IdleTimeout < 0},
		{"shutdown-timeout", c.ShutdownTimeout, c.ShutdownTimeout < 0},
		{"shed-latency", c.Shed.Latency, c.Shed.Latency < 0},
		{"shed-retry-after", c.ShedRetryAfter, c.ShedRetryAfter < 0},
		{"pg-statement-timeout", c.Store.StatementTimeout, c.Store.StatementTimeout < 0},
		{"pg-pool", c.Store.PoolSize, c.Store.PoolSize < 0},
		{"mqtt-max-conns", c.MQTT.MaxConns, c.MQTT.MaxConns < 0},
	} {
		if d.neg {
			bad("--%s %v: want 0 or more", d.flag, d.v)
		}
	}
	if c.AccessLogSample < 0 || c.AccessLogSample > 1 {
		bad("--access-log-sample %g: want a fraction from 0 (no access log) to 1 (every request)", c.AccessLogSample)
	}
	if c.PublicURL != "" && !strings.HasPrefix(c.PublicURL, "https://") && !strings.HasPrefix(c.PublicURL, "http://") {
		bad("--public-url %q: want an http:// or https:// URL", c.PublicURL)
	}
	errs = append(errs, credentialErrs(c.OperatorToken, c.PreviousOperatorToken, c.Secret, c.PreviousSecret)...)
	return errs
}

// credentialErrs checks the operator token and the device secret with
// their rotation's predecessors: Validate with what was given, Start again
// with what it loaded from --data-dir. Empty values are not checked (they
// are generated, or rotation is off).
func credentialErrs(op, opPrev, sec, secPrev string) []error {
	var errs []error
	for _, f := range []struct{ flag, v string }{
		{"operator-token", op}, {"operator-token-previous", opPrev}, {"secret", sec}, {"secret-previous", secPrev},
	} {
		if f.v != "" && len(f.v) < MinSecretLen {
			errs = append(errs, fmt.Errorf("--%s: %d characters; at least %d (a short operator token or device secret can be guessed): e.g. `openssl rand -hex 32`, or leave it empty to have one generated in --data-dir", f.flag, len(f.v), MinSecretLen))
		}
	}
	if opPrev != "" && opPrev == op {
		errs = append(errs, fmt.Errorf("--operator-token-previous is the operator token in force: to rotate, pass the new token as --operator-token and the old one as --operator-token-previous"))
	}
	if secPrev != "" && secPrev == sec {
		errs = append(errs, fmt.Errorf("--secret-previous is the secret in force: to rotate, pass the new secret as --secret and the old one as --secret-previous"))
	}
	return errs
}
