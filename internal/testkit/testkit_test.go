package testkit_test

import (
	"net"
	"testing"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// TestFreeAddr: the address is on loopback and free to listen on.
func TestFreeAddr(t *testing.T) {
	addr := testkit.FreeAddr(t)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	l.Close()
	if host, _, _ := net.SplitHostPort(addr); host != "127.0.0.1" {
		t.Fatalf("FreeAddr = %s, want 127.0.0.1:port", addr)
	}
}
