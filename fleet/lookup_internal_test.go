package fleet

import (
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
)

// TestMissCacheBounded: the remembered misses never exceed maxMisses (the
// one closest to expiry goes first), expire after LookupMissTTL, and an id
// remembered again keeps its newer expiry when its older entry is dropped.
func TestMissCacheBounded(t *testing.T) {
	var c missCache
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC).UnixNano()
	ids := make([]kettle.DeviceID, maxMisses+100)
	for i := range ids {
		ids[i] = uuid.New()
		c.add(ids[i], now+int64(i))
		if len(c.until) > maxMisses || len(c.order) > maxMisses {
			t.Fatalf("after %d misses: %d remembered, %d in order; want ≤ %d", i+1, len(c.until), len(c.order), maxMisses)
		}
	}
	last := now + int64(len(ids))
	if c.has(ids[99], last) || !c.has(ids[100], last) || !c.has(ids[len(ids)-1], last) {
		t.Errorf("full: the oldest 100 should be gone and the rest kept")
	}
	ttl := int64(LookupMissTTL)
	if c.has(ids[len(ids)-1], now+int64(len(ids)-1)+ttl) {
		t.Error("a miss is remembered past LookupMissTTL")
	}
	// All expired: the next add drops them all.
	later := last + ttl
	c.add(ids[0], later)
	if len(c.until) != 1 || len(c.order) != 1 || !c.has(ids[0], later) {
		t.Errorf("after every entry expired and one add: %d remembered, %d in order; want 1, 1", len(c.until), len(c.order))
	}
	// Remembered again before its first entry goes: the first entry's
	// removal keeps the second.
	c.add(ids[0], later+ttl/2)
	c.add(ids[1], later+ttl) // drops ids[0]'s first entry (expired)
	if !c.has(ids[0], later+ttl) {
		t.Error("an id remembered again was forgotten with its older entry")
	}
}
