package web

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// CookieName is the session cookie. It is HttpOnly, so the page's scripts
// never see it; the browser sends it with the page's API calls.
const CookieName = "kettle_session"

// crossOrigin refuses state-changing requests that a browser marks as coming
// from another site (Sec-Fetch-Site, else Origin against Host); SameSite=Strict
// already keeps the cookie off them, this is the second lock.
var crossOrigin = http.NewCrossOriginProtection()

// IsOperator reports whether r carries a live operator session. The API's
// operator check accepts it in place of the bearer token. A state-changing
// request that a browser says comes from another origin is never an
// operator's, cookie or not.
func (w *Web) IsOperator(r *http.Request) bool {
	c, err := r.Cookie(CookieName)
	if err != nil || c.Value == "" {
		return false
	}
	if crossOrigin.Check(r) != nil {
		return false
	}
	_, ok := w.session(c.Value)
	return ok
}

// session returns the expiry of a live session, forgetting it if expired.
func (w *Web) session(id string) (time.Time, bool) {
	key := sha256.Sum256([]byte(id))
	now := w.cfg.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	exp, ok := w.sessions[key]
	if !ok {
		return time.Time{}, false
	}
	if !now.Before(exp) {
		delete(w.sessions, key)
		return time.Time{}, false
	}
	return exp, true
}

// newSession stores a session and returns its id. The table keeps only
// sha256(id), so a memory dump does not hand out live sessions, and is
// bounded: expired sessions go first, then the one closest to expiry.
func (w *Web) newSession() (string, time.Time) {
	var b [32]byte
	rand.Read(b[:]) // never returns an error (crypto/rand, Go ≥ 1.24)
	id := base64.RawURLEncoding.EncodeToString(b[:])
	now := w.cfg.Now()
	exp := now.Add(w.cfg.SessionTTL)
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.sessions) >= w.cfg.MaxSessions {
		for k, e := range w.sessions {
			if !now.Before(e) {
				delete(w.sessions, k)
			}
		}
	}
	for len(w.sessions) >= w.cfg.MaxSessions {
		var oldest [32]byte
		var oldestExp time.Time
		for k, e := range w.sessions {
			if oldestExp.IsZero() || e.Before(oldestExp) {
				oldest, oldestExp = k, e
			}
		}
		delete(w.sessions, oldest)
	}
	w.sessions[sha256.Sum256([]byte(id))] = exp
	return id, exp
}

// Sessions is the number of sessions held (live or not yet swept).
func (w *Web) Sessions() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.sessions)
}

// tokenOK compares in constant time; hashing first also hides the length.
func (w *Web) tokenOK(tok string) bool {
	if w.cfg.OperatorToken == "" || tok == "" {
		return false
	}
	a, b := sha256.Sum256([]byte(tok)), sha256.Sum256([]byte(w.cfg.OperatorToken))
	if subtle.ConstantTimeCompare(a[:], b[:]) == 1 {
		return true
	}
	if w.cfg.PreviousOperatorToken == "" {
		return false
	}
	p := sha256.Sum256([]byte(w.cfg.PreviousOperatorToken))
	if subtle.ConstantTimeCompare(a[:], p[:]) != 1 {
		return false
	}
	if w.cfg.OnPreviousToken != nil {
		w.cfg.OnPreviousToken()
	}
	return true
}

type sessionJSON struct {
	SignedIn      bool       `json:"signed_in"`
	ExpiresAt     *time.Time `json:"expires_at,omitempty"`
	OfflineAfterS int        `json:"offline_after_s"`
}

type errorJSON struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

func writeJSON(rw http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	rw.Header().Set("Content-Type", "application/json")
	rw.Header().Set("Cache-Control", "no-store")
	rw.WriteHeader(status)
	rw.Write(append(b, '\n'))
}

func (w *Web) info(exp time.Time, ok bool) sessionJSON {
	s := sessionJSON{SignedIn: ok, OfflineAfterS: int(w.cfg.OfflineAfter / time.Second)}
	if ok {
		s.ExpiresAt = &exp
	}
	return s
}

// sessionInfo tells the page whether it is signed in. It answers 200 either
// way: not being signed in is the normal first visit, not an error.
func (w *Web) sessionInfo(rw http.ResponseWriter, r *http.Request) {
	var exp time.Time
	ok := false
	if c, err := r.Cookie(CookieName); err == nil {
		exp, ok = w.session(c.Value)
	}
	writeJSON(rw, http.StatusOK, w.info(exp, ok))
}

// signIn takes the operator token as JSON {"token": "…"} or a form field
// "token" and answers with a session cookie.
func (w *Web) signIn(rw http.ResponseWriter, r *http.Request) {
	if err := crossOrigin.Check(r); err != nil {
		writeJSON(rw, http.StatusForbidden, errorJSON{"forbidden", "sign in from the dashboard's own page"})
		return
	}
	src := sourceAddr(r)
	if d := w.throttle.wait(src, w.cfg.Now()); d > 0 {
		secs := int((d + time.Second - 1) / time.Second)
		rw.Header().Set("Retry-After", strconv.Itoa(secs))
		writeJSON(rw, http.StatusTooManyRequests, errorJSON{"too_many_requests", fmt.Sprintf("too many failed sign-ins from this address; retry after %d s", secs)})
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, 4<<10))
	if err != nil {
		writeJSON(rw, http.StatusRequestEntityTooLarge, errorJSON{"too_large", "sign-in body over 4 KiB"})
		return
	}
	var tok string
	ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch ct {
	case "application/x-www-form-urlencoded":
		v, err := url.ParseQuery(string(body))
		if err != nil {
			writeJSON(rw, http.StatusBadRequest, errorJSON{"invalid", "malformed form body"})
			return
		}
		tok = v.Get("token")
	default:
		var req struct {
			Token string `json:"token"`
		}
		if err := json.Unmarshal(body, &req); err != nil {
			writeJSON(rw, http.StatusBadRequest, errorJSON{"invalid", `send {"token": "<operator token>"} as JSON or token=… as a form`})
			return
		}
		tok = req.Token
	}
	tok = strings.TrimSpace(tok)
	if !w.tokenOK(tok) {
		w.throttle.failed(src, w.cfg.Now())
		if ok, skipped := w.refusedLog.Allow(time.Now()); ok {
			w.log.Warn("dashboard sign-in refused", "remote", r.RemoteAddr, "refusals_not_logged_since_last_line", skipped)
		}
		writeJSON(rw, http.StatusUnauthorized, errorJSON{"unauthorized", "wrong operator token (kettle serve prints the file it is kept in)"})
		return
	}
	id, exp := w.newSession()
	http.SetCookie(rw, &http.Cookie{
		Name: CookieName, Value: id, Path: "/",
		Expires: exp, MaxAge: int(w.cfg.SessionTTL / time.Second),
		HttpOnly: true, Secure: r.TLS != nil || w.cfg.SecureCookie, SameSite: http.SameSiteStrictMode,
	})
	w.log.Info("dashboard sign-in", "remote", r.RemoteAddr, "expires", exp)
	writeJSON(rw, http.StatusOK, w.info(exp, true))
}

// signOut forgets the session on the server (a copied cookie is dead too)
// and clears it in the browser.
func (w *Web) signOut(rw http.ResponseWriter, r *http.Request) {
	if c, err := r.Cookie(CookieName); err == nil {
		key := sha256.Sum256([]byte(c.Value))
		w.mu.Lock()
		delete(w.sessions, key)
		w.mu.Unlock()
	}
	http.SetCookie(rw, &http.Cookie{
		Name: CookieName, Value: "", Path: "/", MaxAge: -1,
		HttpOnly: true, Secure: r.TLS != nil || w.cfg.SecureCookie, SameSite: http.SameSiteStrictMode,
	})
	rw.WriteHeader(http.StatusNoContent)
}

// sourceAddr is the request's client address (kettle serve has already put
// a trusted balancer's X-Forwarded-For there); the zero Addr when it is
// not an address.
func sourceAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap()
}
