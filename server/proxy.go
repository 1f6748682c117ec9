package server

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// TrustedProxies are the peers whose word on a client's address is taken:
// a balancer in front of the nodes (HAProxy's option forwardfor). Without
// them every kettle behind a balancer has the balancer's address, and a
// per-source limit throttles the whole fleet at once or nobody.
type TrustedProxies []netip.Prefix

// ParseTrustedProxies reads --trusted-proxies: comma-separated CIDRs or
// single addresses.
func ParseTrustedProxies(s string) (TrustedProxies, error) {
	var tp TrustedProxies
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !strings.Contains(f, "/") {
			a, err := netip.ParseAddr(f)
			if err != nil {
				return nil, fmt.Errorf("--trusted-proxies %q: want CIDRs or addresses, e.g. 10.0.0.0/8,192.0.2.7", f)
			}
			tp = append(tp, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return nil, fmt.Errorf("--trusted-proxies %q: want CIDRs or addresses, e.g. 10.0.0.0/8,192.0.2.7", f)
		}
		tp = append(tp, p.Masked())
	}
	return tp, nil
}

func (tp TrustedProxies) trusts(a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range tp {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// clientAddr is the client of r: its peer, unless the peer is a trusted
// proxy, then the nearest address of X-Forwarded-For that is not one
// (walking from the right, as each proxy appends the peer it saw: what a
// client wrote itself at the left is not believed). A header from a peer
// that is not trusted is ignored.
func (tp TrustedProxies) clientAddr(r *http.Request) (netip.AddrPort, bool) {
	peer, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil || !tp.trusts(peer.Addr()) {
		return netip.AddrPort{}, false
	}
	hops := r.Header.Values("X-Forwarded-For")
	if len(hops) == 0 {
		return netip.AddrPort{}, false
	}
	all := strings.Split(strings.Join(hops, ","), ",")
	for i := len(all) - 1; i >= 0; i-- {
		h := strings.TrimSpace(all[i])
		a, err := netip.ParseAddr(h)
		if err != nil {
			// An address we cannot read ends the chain: nothing left of it
			// can be believed either.
			return netip.AddrPort{}, false
		}
		if !tp.trusts(a) || i == 0 {
			return netip.AddrPortFrom(a.Unmap(), 0), true
		}
	}
	return netip.AddrPort{}, false
}

// forwarded rewrites each request's RemoteAddr to its client's address
// (clientAddr) before anything reads it: the per-source login limit, the
// access log, the dashboard's sign-in throttle.
func (tp TrustedProxies) forwarded(h http.Handler) http.Handler {
	if len(tp) == 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a, ok := tp.clientAddr(r); ok {
			r2 := *r
			r2.RemoteAddr = net.JoinHostPort(a.Addr().String(), "0")
			r = &r2
		}
		h.ServeHTTP(w, r)
	})
}
