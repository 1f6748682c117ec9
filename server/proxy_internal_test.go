package server

import (
	"net/http/httptest"
	"testing"
)

func TestClientAddr(t *testing.T) {
	tp, err := ParseTrustedProxies("10.0.0.0/8, 192.0.2.7")
	if err != nil {
		t.Fatal(err)
	}
	f := func(peer string, xff []string, want string) {
		t.Helper()
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = peer
		for _, v := range xff {
			r.Header.Add("X-Forwarded-For", v)
		}
		got := ""
		if a, ok := tp.clientAddr(r); ok {
			got = a.Addr().String()
		}
		if got != want {
			t.Errorf("peer %s, X-Forwarded-For %q: %q, want %q", peer, xff, got, want)
		}
	}
	f("10.1.2.3:5000", []string{"198.51.100.9"}, "198.51.100.9")              // through the balancer
	f("203.0.113.5:5000", []string{"198.51.100.9"}, "")                       // a forged header from outside: ignored
	f("10.1.2.3:5000", []string{"6.6.6.6, 198.51.100.9"}, "198.51.100.9")     // what the client wrote is left of its own address
	f("10.1.2.3:5000", []string{"198.51.100.9, 10.9.9.9"}, "198.51.100.9")    // two trusted proxies in a row
	f("10.1.2.3:5000", []string{"198.51.100.9", "192.0.2.7"}, "198.51.100.9") // the header twice
	f("10.1.2.3:5000", []string{"10.9.9.9"}, "10.9.9.9")                      // every hop trusted: the leftmost
	f("10.1.2.3:5000", []string{"bogus, 198.51.100.9"}, "198.51.100.9")
	f("10.1.2.3:5000", []string{"198.51.100.9, bogus"}, "")
	f("10.1.2.3:5000", nil, "")
	f("[::ffff:10.1.2.3]:5000", []string{"2001:db8::1"}, "2001:db8::1")
	if _, err := ParseTrustedProxies("10.0.0.0/33"); err == nil {
		t.Error("a bad CIDR accepted")
	}
}
