package httpapi

import (
	"sync"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// tokenCacheMax bounds the verified-token cache (≈150 bytes an entry).
const tokenCacheMax = 1 << 16

// tokenCache remembers device tokens verified recently, so that a kettle's
// poll or upload costs a comparison instead of an HMAC (under overload the
// HMAC was ~5% of the server's CPU). A device's token is a pure function of
// the secret and its id, so a cached token is exactly as valid as a freshly
// verified one; revocation is checked separately on every request. Bounded:
// when full it is emptied and devices verify once more.
//
// While the secret is rotated (--secret-previous) a token of the secret
// being retired is accepted too, and every use of one (cached or not) is
// reported to onPrevious.
type tokenCache struct {
	secrets    [][]byte // in force, then the one being retired (empty: none)
	onPrevious func(kettle.DeviceID)
	mu         sync.RWMutex
	m          map[kettle.DeviceID]cachedToken
}

type cachedToken struct {
	tok      string
	previous bool // made with the secret being retired
}

func newTokenCache(secret, previous []byte, onPrevious func(kettle.DeviceID)) *tokenCache {
	return &tokenCache{secrets: [][]byte{secret, previous}, onPrevious: onPrevious, m: make(map[kettle.DeviceID]cachedToken)}
}

// verify is kettle.VerifyDeviceTokens with the cache in front.
func (c *tokenCache) verify(tok string) (kettle.DeviceID, bool) {
	if len(tok) > 37 && tok[36] == '.' {
		if id, err := uuid.Parse(tok[:36]); err == nil {
			c.mu.RLock()
			want, ok := c.m[id]
			c.mu.RUnlock()
			if ok && equalConstantTime(want.tok, tok) {
				if want.previous {
					c.previous(id)
				}
				return id, true
			}
		}
	}
	id, which := kettle.VerifyDeviceTokens(tok, c.secrets...)
	if which < 0 {
		return id, false
	}
	c.mu.Lock()
	if len(c.m) >= tokenCacheMax {
		clear(c.m)
	}
	c.m[id] = cachedToken{tok, which == 1}
	c.mu.Unlock()
	if which == 1 {
		c.previous(id)
	}
	return id, true
}

func (c *tokenCache) previous(id kettle.DeviceID) {
	if c.onPrevious != nil {
		c.onPrevious(id)
	}
}

// equalConstantTime compares two strings in time independent of where they
// differ (as hmac.Equal does), without converting them to byte slices.
func equalConstantTime(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	var v byte
	for i := 0; i < len(a); i++ {
		v |= a[i] ^ b[i]
	}
	return v == 0
}
