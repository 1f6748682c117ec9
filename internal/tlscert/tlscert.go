// Package tlscert serves a certificate and key from two PEM files and picks
// up a renewed pair without a restart: certbot, cert-manager or an
// operator's script replace the files, and the next handshake after the
// replacement gets the new pair. The listeners of kettle serve (HTTP and
// MQTT) share one Reloader. Pool reads the CA file a flag names.
package tlscert

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// CheckEvery is how often, at most, a handshake looks at the files. A look
// reads the two files (a few KB), little next to the handshake itself (~480
// µs of the server's CPU here, bench/tls.sh).
const CheckEvery = time.Second

// pair is the two files' contents. Changes are found by content, not by
// stat: two writes within one tick of the kernel's coarse file clock have
// the same mtime, and a rewritten file keeps its inode and often its size.
type pair struct{ cert, key []byte }

// sum identifies a pair without keeping another copy of the private key.
type sum [2][sha256.Size]byte

func (p pair) sum() sum { return sum{sha256.Sum256(p.cert), sha256.Sum256(p.key)} }

// Reloader holds the pair in force. Its GetCertificate goes in a
// tls.Config.
type Reloader struct {
	certFile, keyFile string
	log               *slog.Logger
	now               func() time.Time

	cur       atomic.Pointer[tls.Certificate]
	nextCheck atomic.Int64 // unix nanoseconds

	mu      sync.Mutex // one reload at a time
	seen    sum        // the files as last loaded or last tried
	readErr bool       // the last look could not read them (logged once)

	reloads, failures atomic.Int64
}

// Load reads the pair once; an error here names the file and stops the
// server from starting (a server must not come up without its certificate).
func Load(certFile, keyFile string, log *slog.Logger, now func() time.Time) (*Reloader, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("--tls-cert and --tls-key go together: give both files (PEM) or neither")
	}
	if now == nil {
		now = time.Now
	}
	r := &Reloader{certFile: certFile, keyFile: keyFile, log: log, now: now}
	p, err := r.readFiles()
	if err != nil {
		return nil, err
	}
	c, err := r.parse(p)
	if err != nil {
		return nil, err
	}
	r.cur.Store(c)
	r.seen = p.sum()
	r.nextCheck.Store(now().Add(CheckEvery).UnixNano())
	r.warnExpiry(c)
	return r, nil
}

func (r *Reloader) readFiles() (p pair, err error) {
	if p.cert, err = os.ReadFile(r.certFile); err != nil {
		return p, fmt.Errorf("--tls-cert: %w", err)
	}
	if p.key, err = os.ReadFile(r.keyFile); err != nil {
		return p, fmt.Errorf("--tls-key: %w", err)
	}
	return p, nil
}

func (r *Reloader) parse(p pair) (*tls.Certificate, error) {
	c, err := tls.X509KeyPair(p.cert, p.key)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert %s, --tls-key %s: %w", r.certFile, r.keyFile, err)
	}
	if c.Leaf == nil {
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			return nil, fmt.Errorf("--tls-cert %s: %w", r.certFile, err)
		}
	}
	return &c, nil
}

func (r *Reloader) warnExpiry(c *tls.Certificate) {
	left := c.Leaf.NotAfter.Sub(r.now())
	switch {
	case left <= 0:
		r.log.Error("tls: the certificate has expired: clients will refuse it; replace the files (they are picked up without a restart)", "cert", r.certFile, "not_after", c.Leaf.NotAfter)
	case left < 14*24*time.Hour:
		r.log.Warn("tls: the certificate expires soon; renew it (the new files are picked up without a restart)", "cert", r.certFile, "not_after", c.Leaf.NotAfter)
	}
}

// GetCertificate is tls.Config.GetCertificate: the pair in force, after a
// look at the files if the last one is CheckEvery old.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.maybeCheck()
	return r.cur.Load(), nil
}

func (r *Reloader) maybeCheck() {
	if r.now().UnixNano() >= r.nextCheck.Load() {
		r.Check()
	}
}

// Check loads the pair again if either file changed since it was last
// loaded or tried. A pair that does not load (a half-written renewal: the
// new certificate beside the old key) leaves the one in force and is tried
// again when a file changes again; the log says why.
func (r *Reloader) Check() {
	if !r.mu.TryLock() {
		return // another handshake is looking
	}
	defer r.mu.Unlock()
	r.nextCheck.Store(r.now().Add(CheckEvery).UnixNano())
	p, err := r.readFiles()
	if err != nil {
		if !r.readErr { // a file being replaced by mv is missing for a moment: say it once
			r.readErr = true
			r.failures.Add(1)
			r.log.Warn("tls: cannot read the certificate files; serving the one loaded before", "err", err)
		}
		return
	}
	r.readErr = false
	if p.sum() == r.seen {
		return
	}
	r.seen = p.sum()
	c, err := r.parse(p)
	if err != nil {
		r.failures.Add(1)
		r.log.Warn("tls: the changed certificate files do not load; serving the one loaded before until they change again", "err", err)
		return
	}
	old := r.cur.Swap(c)
	r.reloads.Add(1)
	r.log.Info("tls: certificate reloaded", "cert", r.certFile, "subject", c.Leaf.Subject.String(), "not_after", c.Leaf.NotAfter, "previous_not_after", old.Leaf.NotAfter)
	r.warnExpiry(c)
}

// NotAfter is when the certificate in force expires, after a look at the
// files if the last one is CheckEvery old: a scrape of the expiry gauge
// sees a renewal even when no handshake has happened since (kept-alive
// connections, an idle server).
func (r *Reloader) NotAfter() time.Time {
	r.maybeCheck()
	return r.cur.Load().Leaf.NotAfter
}

// Reloads counts pairs loaded after the first; Failures, changed files that
// did not load.
func (r *Reloader) Reloads() int64  { return r.reloads.Load() }
func (r *Reloader) Failures() int64 { return r.failures.Load() }

// Config is the server side's tls.Config: TLS 1.2 or later, the ALPN
// protocols given (HTTP: http/1.1 only — kettles speak HTTP/1.1, and
// HTTP/2's streams would slip past the per-connection bounds), session
// tickets on (Go's default: a kettle that reconnects may resume; in TLS 1.3
// that saves the certificate's signature, not the key exchange).
func (r *Reloader) Config(nextProtos ...string) *tls.Config {
	return &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: r.GetCertificate,
		NextProtos:     nextProtos,
	}
}
