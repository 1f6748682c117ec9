package httpapi

import (
	"crypto/subtle"
	"errors"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/google/uuid"

	kettle "github.com/kettlefleet/kettlefleet"
)

func bearer(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	if len(h) > 7 && strings.EqualFold(h[:7], "bearer ") {
		return strings.TrimSpace(h[7:]), true
	}
	return "", false
}

func (a *API) isOperator(tok string) bool {
	if subtle.ConstantTimeCompare([]byte(tok), []byte(a.cfg.OperatorToken)) == 1 {
		return true
	}
	if a.cfg.PreviousOperatorToken != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(a.cfg.PreviousOperatorToken)) == 1 {
		a.previousUsed("operator", uuid.Nil)
		return true
	}
	return false
}

// isDeviceToken reports whether tok is a device's token (of either secret).
func (a *API) isDeviceToken(tok string) bool {
	_, which := kettle.VerifyDeviceTokens(tok, a.cfg.Secret, a.cfg.PreviousSecret)
	return which >= 0
}

func (a *API) previousUsed(kind string, id kettle.DeviceID) {
	if a.cfg.OnPreviousCredential != nil {
		a.cfg.OnPreviousCredential(kind, id)
	}
}

// operator guards operator endpoints: the operator token, nothing else.
func (a *API) operator(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tok, ok := bearer(r)
		if !ok && a.cfg.OperatorSession != nil && a.cfg.OperatorSession(r) {
			h(w, r)
			return
		}
		if !ok {
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "operator token required: send Authorization: Bearer <token> (kettle serve prints where it is kept)"))
			return
		}
		if !a.isOperator(tok) {
			if a.isDeviceToken(tok) {
				a.writeError(w, kettle.Errorf(kettle.EForbidden, "a device token cannot use operator endpoints"))
				return
			}
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "wrong operator token"))
			return
		}
		h(w, r)
	}
}

// device authenticates a v1 device token (no store round trip) and takes
// the request against the device's rate (--device-rate: 429 over it).
func (a *API) device(r *http.Request) (kettle.DeviceID, error) {
	tok, ok := bearer(r)
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "device token required: send Authorization: Bearer <device token>")
	}
	id, ok := a.tokens.verify(tok)
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "invalid device token")
	}
	if a.registry.Revoked(id) {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "device %s is revoked", id)
	}
	return id, a.allow(r, id)
}

// rateHold is how long a request refused for a rate is held before it is
// answered 429.
const rateHold = time.Second

// allow takes the request against device id's rate (--device-rate); see
// holdOverRate.
func (a *API) allow(r *http.Request, id kettle.DeviceID) error {
	return holdOverRate(r, a.limits.Allow(id))
}

// holdOverRate holds a request refused for a rate (ETooMany: --device-rate,
// --login-rate) for rateHold before it is answered 429, and takes that off
// its Retry-After; any other err is returned at once. A client that retries
// at once, in a loop, is then answered once a second a connection instead
// of as often as it can send (bench/device-rate.sh: answered at once, one
// runaway kettle on 16 connections was refused 31,767 times a second, and
// the fleet's p99 rose with the CPU that took). The hold is the whole
// second even when the wait is shorter: the wait of a shared rate
// (--login-rate 100: 10 ms) is no bound on how often a loop comes back.
func holdOverRate(r *http.Request, err error) error {
	if err == nil { // every request: no allocation, inlined
		return nil
	}
	return holdRefusal(r, err)
}

// holdRefusal is holdOverRate's slow path.
func holdRefusal(r *http.Request, err error) error {
	var ke *kettle.Error
	if !errors.As(err, &ke) || ke.Code != kettle.ETooMany {
		return err
	}
	t := time.NewTimer(rateHold)
	select {
	case <-t.C:
		ke.RetryAfter -= rateHold // ≤ 0: Retry-After 1
	case <-r.Context().Done():
		t.Stop()
	}
	return ke
}

// remoteAddr is the client's address (the zero Addr if RemoteAddr is not
// an address and port, as under a test's handler).
func remoteAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr()
}

// deviceOrOperator lets the operator read any device and a device read only
// itself.
func (a *API) deviceOrOperator(h func(w http.ResponseWriter, r *http.Request, id kettle.DeviceID)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, ok := a.pathDevice(w, r)
		if !ok {
			return
		}
		tok, ok := bearer(r)
		if !ok && a.cfg.OperatorSession != nil && a.cfg.OperatorSession(r) {
			h(w, r, id)
			return
		}
		if !ok {
			a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "token required: send Authorization: Bearer <operator or device token>"))
			return
		}
		if !a.isOperator(tok) {
			dev, ok := a.tokens.verify(tok)
			if !ok || a.registry.Revoked(dev) {
				a.writeError(w, kettle.Errorf(kettle.EUnauthorized, "invalid or revoked token"))
				return
			}
			if dev != id {
				a.writeError(w, kettle.Errorf(kettle.EForbidden, "a device may read only its own data"))
				return
			}
			if err := a.allow(r, id); err != nil { // a device's reads count against its rate
				a.writeError(w, err)
				return
			}
		}
		h(w, r, id)
	}
}

// admitIngest asks Config.AdmitIngest; ok false means the refusal is written.
func (a *API) admitIngest(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	if a.cfg.AdmitIngest == nil {
		return func() {}, true
	}
	release, err := a.cfg.AdmitIngest(r)
	if err != nil {
		a.writeError(w, err)
		return nil, false
	}
	return release, true
}
