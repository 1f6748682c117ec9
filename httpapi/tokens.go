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
type tokenCache struct {
	secret []byte
	mu     sync.RWMutex
	m      map[kettle.DeviceID]string
}

func newTokenCache(secret []byte) *tokenCache {
	return &tokenCache{secret: secret, m: make(map[kettle.DeviceID]string)}
}

// verify is kettle.VerifyDeviceToken with the cache in front.
func (c *tokenCache) verify(tok string) (kettle.DeviceID, bool) {
	if len(tok) > 37 && tok[36] == '.' {
		if id, err := uuid.Parse(tok[:36]); err == nil {
			c.mu.RLock()
			want, ok := c.m[id]
			c.mu.RUnlock()
			if ok && equalConstantTime(want, tok) {
				return id, true
			}
		}
	}
	id, ok := kettle.VerifyDeviceToken(c.secret, tok)
	if ok {
		c.mu.Lock()
		if len(c.m) >= tokenCacheMax {
			clear(c.m)
		}
		c.m[id] = tok
		c.mu.Unlock()
	}
	return id, ok
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
