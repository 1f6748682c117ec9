package web_test

import (
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/web"
)

const opToken = "0123456789abcdef0123456789abcdef"

// clock is the fake at the edge: the session table's only input besides
// requests.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newWeb(t *testing.T, cfg web.Config) (*web.Web, *http.ServeMux, *clock) {
	t.Helper()
	clk := &clock{t: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)}
	cfg.OperatorToken = opToken
	cfg.Now = clk.Now
	w := web.New(cfg, nil)
	mux := http.NewServeMux()
	w.Mount(mux)
	return w, mux, clk
}

func do(mux http.Handler, r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, r)
	return rec
}

func signIn(t *testing.T, mux http.Handler) *http.Cookie {
	t.Helper()
	rec := do(mux, httptest.NewRequest("POST", "/session", strings.NewReader(`{"token":"`+opToken+`"}`)))
	if rec.Code != 200 {
		t.Fatalf("sign in: %d %s", rec.Code, rec.Body)
	}
	for _, c := range rec.Result().Cookies() {
		if c.Name == web.CookieName {
			return c
		}
	}
	t.Fatal("sign in set no session cookie")
	return nil
}

func withCookie(r *http.Request, c *http.Cookie) *http.Request {
	r.AddCookie(&http.Cookie{Name: c.Name, Value: c.Value})
	return r
}

func TestSignIn(t *testing.T) {
	_, mux, _ := newWeb(t, web.Config{})
	n := 0
	f := func(contentType, body string, wantStatus int) {
		t.Helper()
		r := httptest.NewRequest("POST", "/session", strings.NewReader(body))
		r.Header.Set("Content-Type", contentType)
		n++ // each case from an address of its own: failures are throttled per source
		r.RemoteAddr = fmt.Sprintf("192.0.2.%d:1234", n)
		rec := do(mux, r)
		if rec.Code != wantStatus {
			t.Errorf("%s %q: status %d, want %d (%s)", contentType, body, rec.Code, wantStatus, rec.Body)
		}
		setsCookie := strings.Contains(rec.Header().Get("Set-Cookie"), web.CookieName+"=")
		if setsCookie != (wantStatus == 200) {
			t.Errorf("%s %q: Set-Cookie %q", contentType, body, rec.Header().Get("Set-Cookie"))
		}
		if wantStatus != 200 && strings.Contains(rec.Body.String(), opToken) {
			t.Errorf("refusal echoes the token")
		}
	}
	f("application/json", `{"token":"`+opToken+`"}`, 200)
	f("application/json", `{"token":" `+opToken+"\\n"+`"}`, 200)
	f("application/x-www-form-urlencoded", "token="+opToken, 200)
	f("application/json", `{"token":"wrong"}`, 401)
	f("application/json", `{"token":"`+opToken+`x"}`, 401)
	f("application/json", `{"token":"`+opToken[:31]+`"}`, 401)
	f("application/json", `{"token":""}`, 401)
	f("application/json", `{}`, 401)
	f("application/json", `{"token":`, 400)
	f("application/x-www-form-urlencoded", "token=wrong", 401)
	f("application/json", `{"token":"`+strings.Repeat("a", 5000)+`"}`, 413)
}

func TestEmptyOperatorTokenRefusesEveryone(t *testing.T) {
	w := web.New(web.Config{}, nil)
	mux := http.NewServeMux()
	w.Mount(mux)
	if rec := do(mux, httptest.NewRequest("POST", "/session", strings.NewReader(`{"token":""}`))); rec.Code != 401 {
		t.Fatalf("empty token signed in: %d", rec.Code)
	}
}

func TestCookieAttributes(t *testing.T) {
	_, mux, _ := newWeb(t, web.Config{})
	c := signIn(t, mux)
	if !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Path != "/" || c.Secure {
		t.Errorf("cookie %+v: want HttpOnly, SameSite=Strict, Path=/, not Secure over plain HTTP", c)
	}
	if len(c.Value) < 40 {
		t.Errorf("session id %q too short to be unguessable", c.Value)
	}
	r := httptest.NewRequest("POST", "https://kettle.example/session", strings.NewReader(`{"token":"`+opToken+`"}`))
	rec := do(mux, r)
	if !strings.Contains(rec.Header().Get("Set-Cookie"), "Secure") {
		t.Errorf("over TLS the cookie must be Secure: %q", rec.Header().Get("Set-Cookie"))
	}
	// Behind a balancer that terminates TLS: plain HTTP here, https outside.
	_, mux, _ = newWeb(t, web.Config{SecureCookie: true})
	if c := signIn(t, mux); !c.Secure {
		t.Errorf("with SecureCookie (the public URL is https) the cookie must be Secure over plain HTTP too: %+v", c)
	}
}

// TestSignInThrottled: a source that keeps failing is told to wait (429 +
// Retry-After), even with the right token, until its allowance returns;
// another source is not affected.
func TestSignInThrottled(t *testing.T) {
	_, mux, clk := newWeb(t, web.Config{})
	try := func(from, tok string) *httptest.ResponseRecorder {
		r := httptest.NewRequest("POST", "/session", strings.NewReader(`{"token":"`+tok+`"}`))
		r.RemoteAddr = from
		return do(mux, r)
	}
	for i := range 5 {
		if rec := try("198.51.100.1:1", "wrong"); rec.Code != 401 {
			t.Fatalf("failure %d: %d, want 401", i+1, rec.Code)
		}
	}
	rec := try("198.51.100.1:2", opToken)
	if rec.Code != 429 || rec.Header().Get("Retry-After") == "" {
		t.Fatalf("after 5 failures, the right token: %d (Retry-After %q), want 429 with Retry-After", rec.Code, rec.Header().Get("Retry-After"))
	}
	if rec := try("198.51.100.2:1", opToken); rec.Code != 200 {
		t.Fatalf("another source: %d, want 200", rec.Code)
	}
	clk.Add(15 * time.Second)
	if rec := try("198.51.100.1:3", opToken); rec.Code != 200 {
		t.Fatalf("after the wait: %d, want 200", rec.Code)
	}
}

func TestSessionLifecycle(t *testing.T) {
	w, mux, clk := newWeb(t, web.Config{SessionTTL: time.Hour})
	isOp := func(r *http.Request, want bool) {
		t.Helper()
		if got := w.IsOperator(r); got != want {
			t.Errorf("IsOperator(%s %s %v) = %v, want %v", r.Method, r.URL, r.Header, got, want)
		}
	}
	isOp(httptest.NewRequest("GET", "/v1/statistics", nil), false)
	isOp(withCookie(httptest.NewRequest("GET", "/v1/statistics", nil), &http.Cookie{Name: web.CookieName, Value: "forged"}), false)

	c := signIn(t, mux)
	isOp(withCookie(httptest.NewRequest("GET", "/v1/statistics", nil), c), true)
	isOp(withCookie(httptest.NewRequest("PUT", "/v1/devices/x/override", nil), c), true)
	// A state-changing request a browser marks as cross-site is refused even
	// if the cookie came along.
	r := withCookie(httptest.NewRequest("PUT", "/v1/devices/x/override", nil), c)
	r.Header.Set("Sec-Fetch-Site", "cross-site")
	isOp(r, false)
	r = withCookie(httptest.NewRequest("DELETE", "http://kettle.example/v1/devices/x/override", nil), c)
	r.Header.Set("Origin", "https://evil.example")
	isOp(r, false)
	r = withCookie(httptest.NewRequest("PUT", "http://kettle.example/v1/devices/x/override", nil), c)
	r.Header.Set("Origin", "http://kettle.example")
	r.Header.Set("Sec-Fetch-Site", "same-origin")
	isOp(r, true)

	// GET /session says so, without an error status either way.
	info := func(r *http.Request, want string) {
		t.Helper()
		rec := do(mux, r)
		if rec.Code != 200 || !strings.Contains(rec.Body.String(), want) {
			t.Errorf("GET /session: %d %s, want %s", rec.Code, rec.Body, want)
		}
	}
	info(withCookie(httptest.NewRequest("GET", "/session", nil), c), `"signed_in":true`)
	info(httptest.NewRequest("GET", "/session", nil), `"signed_in":false`)

	// Expiry.
	clk.Add(59 * time.Minute)
	isOp(withCookie(httptest.NewRequest("GET", "/v1/statistics", nil), c), true)
	clk.Add(time.Minute)
	isOp(withCookie(httptest.NewRequest("GET", "/v1/statistics", nil), c), false)
	info(withCookie(httptest.NewRequest("GET", "/session", nil), c), `"signed_in":false`)

	// Sign out forgets the session on the server: a copied cookie is dead.
	c = signIn(t, mux)
	isOp(withCookie(httptest.NewRequest("GET", "/", nil), c), true)
	rec := do(mux, withCookie(httptest.NewRequest("DELETE", "/session", nil), c))
	if rec.Code != 204 || !strings.Contains(rec.Header().Get("Set-Cookie"), "Max-Age=0") {
		t.Errorf("sign out: %d, Set-Cookie %q", rec.Code, rec.Header().Get("Set-Cookie"))
	}
	isOp(withCookie(httptest.NewRequest("GET", "/", nil), c), false)
}

func TestCrossSiteSignInRefused(t *testing.T) {
	_, mux, _ := newWeb(t, web.Config{})
	r := httptest.NewRequest("POST", "/session", strings.NewReader(`{"token":"`+opToken+`"}`))
	r.Header.Set("Sec-Fetch-Site", "cross-site")
	if rec := do(mux, r); rec.Code != 403 {
		t.Fatalf("cross-site sign-in: %d, want 403", rec.Code)
	}
}

func TestSessionTableBounded(t *testing.T) {
	w, mux, clk := newWeb(t, web.Config{MaxSessions: 3})
	var cs []*http.Cookie
	for range 5 {
		cs = append(cs, signIn(t, mux))
		clk.Add(time.Second)
	}
	if n := w.Sessions(); n != 3 {
		t.Fatalf("%d sessions held, want the bound 3", n)
	}
	// The oldest went first; the newest live on.
	for i, c := range cs {
		want := i >= 2
		if got := w.IsOperator(withCookie(httptest.NewRequest("GET", "/", nil), c)); got != want {
			t.Errorf("session %d live = %v, want %v", i, got, want)
		}
	}
}

func TestPageAndAssets(t *testing.T) {
	_, mux, _ := newWeb(t, web.Config{})
	get := func(path string, gz bool) *httptest.ResponseRecorder {
		r := httptest.NewRequest("GET", path, nil)
		if gz {
			r.Header.Set("Accept-Encoding", "gzip, deflate, br")
		}
		return do(mux, r)
	}
	rec := get("/", true)
	if rec.Code != 200 || rec.Header().Get("Content-Encoding") != "gzip" || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") {
		t.Fatalf("GET /: %d %v", rec.Code, rec.Header())
	}
	for _, h := range []string{"Content-Security-Policy", "X-Content-Type-Options", "X-Frame-Options"} {
		if rec.Header().Get(h) == "" {
			t.Errorf("GET / lacks %s", h)
		}
	}
	zr, err := gzip.NewReader(rec.Body)
	if err != nil {
		t.Fatal(err)
	}
	html, _ := io.ReadAll(zr)
	total := rec.Body.Len()
	// Every asset the page names is stamped with its hash, served, cached for
	// good, and the whole first page stays under budget.
	refs := regexp.MustCompile(`"(/assets/[^"?]+)\?v=([0-9a-f]{8})"`).FindAllStringSubmatch(string(html), -1)
	if len(refs) < 3 {
		t.Fatalf("page names %d hashed assets: %s", len(refs), html)
	}
	seen := map[string]bool{}
	for _, m := range refs {
		if seen[m[1]] {
			continue
		}
		seen[m[1]] = true
		a := get(m[1]+"?v="+m[2], true)
		if a.Code != 200 || !strings.Contains(a.Header().Get("Cache-Control"), "immutable") {
			t.Errorf("GET %s: %d, Cache-Control %q", m[1], a.Code, a.Header().Get("Cache-Control"))
		}
		if nc := get(m[1]+"?v=00000000", false); nc.Header().Get("Cache-Control") != "no-cache" {
			t.Errorf("a stale hash of %s must not be cached for good", m[1])
		}
		total += a.Body.Len()
	}
	if total > 300<<10 {
		t.Errorf("first page is %d bytes gzipped, budget 300 KB", total)
	}
	t.Logf("first page: %d bytes gzipped (%d assets)", total, len(seen))
	if rec := get("/assets/nope.js", false); rec.Code != 404 {
		t.Errorf("unknown asset: %d", rec.Code)
	}
	if rec := get("/assets/app.js", false); rec.Header().Get("Content-Encoding") != "" || !strings.Contains(rec.Header().Get("Content-Type"), "javascript") {
		t.Errorf("plain GET of app.js: %v", rec.Header())
	}
	r := httptest.NewRequest("GET", "/assets/app.css", nil)
	r.Header.Set("If-None-Match", get("/assets/app.css", false).Header().Get("ETag"))
	if rec := do(mux, r); rec.Code != 304 {
		t.Errorf("If-None-Match: %d, want 304", rec.Code)
	}
}
