package httpapi

import (
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

func TestTokenCache(t *testing.T) {
	secret := []byte("s3cret")
	c := newTokenCache(secret, nil, nil)
	id := uuid.New()
	good := kettle.DeviceToken(secret, id)
	f := func(tok string, wantOK bool) {
		t.Helper()
		for pass := range 2 { // first verified, then (if valid) from the cache
			got, ok := c.verify(tok)
			if ok != wantOK || (ok && got != id) {
				t.Fatalf("pass %d: verify(%q) = %v, %v; want %v, %v", pass, tok, got, ok, id, wantOK)
			}
		}
	}
	f(good, true)
	// Another MAC for a cached id: its first character, which carries six
	// bits of the MAC (the last one's low bits are base64 padding, so
	// flipping it failed the test for the 1 in 16 tokens ending in 'A').
	f(good[:37]+flip(good[37])+good[38:], false)
	f(kettle.DeviceToken([]byte("other"), id), false) // another secret's token
	f(strings.ToUpper(good[:36])+good[36:], true)     // uuid.Parse accepts upper case: so does the cache
	f(good+"x", false)
	f("", false)
	f(good[:36], false)
	f(strings.Repeat("-", 36)+"."+good[37:], false)
	if len(c.m) != 1 {
		t.Fatalf("cache holds %d entries, want 1 (the last valid token of the one device)", len(c.m))
	}
}

func flip(b byte) string {
	if b == 'A' {
		return "B"
	}
	return "A"
}

func TestTokenCacheBounded(t *testing.T) {
	secret := []byte("s3cret")
	c := newTokenCache(secret, nil, nil)
	for range tokenCacheMax + 10 {
		if _, ok := c.verify(kettle.DeviceToken(secret, uuid.New())); !ok {
			t.Fatal("valid token refused")
		}
	}
	if len(c.m) > tokenCacheMax {
		t.Fatalf("cache holds %d entries, bound %d", len(c.m), tokenCacheMax)
	}
}

func BenchmarkTokenVerify(b *testing.B) {
	secret := []byte("s3cret")
	tok := kettle.DeviceToken(secret, uuid.New())
	b.Run("hmac", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			kettle.VerifyDeviceToken(secret, tok)
		}
	})
	b.Run("cached", func(b *testing.B) {
		c := newTokenCache(secret, nil, nil)
		b.ReportAllocs()
		for b.Loop() {
			c.verify(tok)
		}
	})
}
