// Package web is the operator dashboard that kettle serve shows at "/": one
// page, vanilla JavaScript and CSS embedded in the binary (no CDN, works with
// no internet), signed in with the operator token through a server-side
// session cookie so that no token ever sits in JavaScript or a URL.
//
// The page reads the fleet through the v1 API with that cookie; the API's
// operator check accepts it through IsOperator.
package web

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"log/slog"
	"mime"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

//go:embed assets
var assetFS embed.FS

// Defaults of Config.
const (
	DefaultSessionTTL   = 12 * time.Hour
	DefaultMaxSessions  = 1024
	DefaultOfflineAfter = 60 * time.Second // two missed 30 s poll intervals
)

// Config is what the dashboard needs from kettle serve.
type Config struct {
	// OperatorToken is the token an operator signs in with.
	OperatorToken string
	// PreviousOperatorToken, when set, is the token being retired
	// (--operator-token-previous): a sign-in with it is accepted too and
	// reported to OnPreviousToken.
	PreviousOperatorToken string
	OnPreviousToken       func()
	// Now is the clock; nil means time.Now.
	Now func() time.Time

	// SessionTTL is how long a session lasts after sign-in (default 12 h).
	SessionTTL time.Duration
	// MaxSessions bounds the session table (default 1024); when full, the
	// session closest to expiry is dropped.
	MaxSessions int
	// OfflineAfter is how long a kettle may be silent before the page marks
	// it offline (default 60 s: two missed polls at the default interval).
	OfflineAfter time.Duration
	// SecureCookie marks the session cookie Secure even when the request
	// reached this node in plain HTTP: behind a balancer that terminates
	// TLS (kettle serve --public-url https://…).
	SecureCookie bool
}

// Failed sign-ins a source may make at once, then one per
// signInInterval; at most signInSources sources are tracked.
const (
	signInBurst    = 5
	signInInterval = 12 * time.Second
	signInSources  = 4096
)

// Web serves the dashboard and its sessions. Build it with New.
type Web struct {
	cfg    Config
	log    *slog.Logger
	assets map[string]*asset // by URL path, e.g. "/assets/app.js"
	index  *asset

	mu       sync.Mutex
	sessions map[[32]byte]time.Time // sha256(session id) → expiry

	refusedLog logthin.Limiter // failed sign-ins: anyone can cause them at any rate
	throttle   *signInThrottle
}

// asset is one embedded file, with its gzip form computed once at start.
type asset struct {
	body, gz    []byte
	contentType string
	etag        string
}

// New builds the dashboard. It panics only if the embedded assets are broken,
// which a test catches before release.
func New(cfg Config, log *slog.Logger) *Web {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.OfflineAfter <= 0 {
		cfg.OfflineAfter = DefaultOfflineAfter
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &Web{cfg: cfg, log: log, assets: map[string]*asset{}, sessions: map[[32]byte]time.Time{},
		throttle: newSignInThrottle(signInInterval, signInBurst, signInSources)}
	if err := w.loadAssets(); err != nil {
		panic(fmt.Sprintf("web: embedded assets: %v", err))
	}
	return w
}

// loadAssets reads the embedded files, stamps each asset URL in index.html
// with its content hash (so assets can be cached for good and a new binary
// is still picked up at once), and gzips everything.
func (w *Web) loadAssets() error {
	files := map[string][]byte{}
	err := fs.WalkDir(assetFS, "assets", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := assetFS.ReadFile(p)
		files["/"+p] = b
		return err
	})
	if err != nil {
		return err
	}
	html, ok := files["/assets/index.html"]
	if !ok {
		return fmt.Errorf("assets/index.html missing")
	}
	delete(files, "/assets/index.html")
	for p, b := range files {
		a := newAsset(p, b)
		w.assets[p] = a
		html = bytes.ReplaceAll(html, []byte(`"`+p+`"`), []byte(`"`+p+"?v="+a.etag[1:9]+`"`))
	}
	w.index = newAsset("index.html", html)
	return nil
}

func newAsset(name string, b []byte) *asset {
	sum := sha256.Sum256(b)
	a := &asset{body: b, etag: `"` + hex.EncodeToString(sum[:8]) + `"`}
	a.contentType = mime.TypeByExtension(path.Ext(name))
	if a.contentType == "" {
		a.contentType = "application/octet-stream"
	}
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zw.Write(b)
	zw.Close()
	if buf.Len() < len(b) {
		a.gz = buf.Bytes()
	}
	return a
}

// Mount registers the page, its assets and the session endpoints. Patterns
// are exact so they coexist with the API's catch-all "/".
func (w *Web) Mount(mux interface {
	Handle(pattern string, h http.Handler)
}) {
	mux.Handle("GET /{$}", http.HandlerFunc(w.servePage))
	mux.Handle("GET /assets/", http.HandlerFunc(w.serveAsset))
	mux.Handle("GET /session", http.HandlerFunc(w.sessionInfo))
	mux.Handle("POST /session", http.HandlerFunc(w.signIn))
	mux.Handle("DELETE /session", http.HandlerFunc(w.signOut))
}

// contentSecurityPolicy allows only the page's own scripts, styles and API:
// an injected script or a cross-origin fetch is refused by the browser.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

func securityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", contentSecurityPolicy)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
}

func (w *Web) servePage(rw http.ResponseWriter, r *http.Request) {
	securityHeaders(rw.Header())
	// The page itself holds no fleet data; it is revalidated every time so a
	// new binary's assets are picked up.
	rw.Header().Set("Cache-Control", "no-cache")
	w.index.serve(rw, r)
}

func (w *Web) serveAsset(rw http.ResponseWriter, r *http.Request) {
	a, ok := w.assets[r.URL.Path]
	if !ok {
		securityHeaders(rw.Header())
		http.Error(rw, "no such asset; the page is at /", http.StatusNotFound)
		return
	}
	securityHeaders(rw.Header())
	if v := r.URL.Query().Get("v"); v != "" && v == a.etag[1:9] {
		rw.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	} else {
		rw.Header().Set("Cache-Control", "no-cache")
	}
	a.serve(rw, r)
}

func (a *asset) serve(rw http.ResponseWriter, r *http.Request) {
	h := rw.Header()
	h.Set("Content-Type", a.contentType)
	h.Set("ETag", a.etag)
	h.Add("Vary", "Accept-Encoding")
	if inm := r.Header.Get("If-None-Match"); inm != "" && inm == a.etag {
		rw.WriteHeader(http.StatusNotModified)
		return
	}
	body := a.body
	if a.gz != nil && acceptsGzip(r) {
		h.Set("Content-Encoding", "gzip")
		body = a.gz
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	rw.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		rw.Write(body)
	}
}

func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		enc, params, _ := strings.Cut(part, ";")
		if !strings.EqualFold(strings.TrimSpace(enc), "gzip") {
			continue
		}
		if q, ok := strings.CutPrefix(strings.TrimSpace(params), "q="); ok {
			f, err := strconv.ParseFloat(q, 64)
			return err == nil && f > 0
		}
		return true
	}
	return false
}
