package mqttapi

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	"github.com/pires/go-proxyproto"
)

// maxProxyHeader bounds a PROXY v2 header's address block and TLVs: HAProxy's
// send-proxy-v2 sends 12 bytes of IPv4 or 36 of IPv6 addresses, and a few
// TLVs at most.
const maxProxyHeader = 1024

var errNoProxyHeader = errors.New("no PROXY protocol v2 header: the balancer's MQTT server lines need send-proxy-v2")

// trusts reports whether a is one of the proxies whose PROXY header names
// the client (Config.TrustedProxies).
func (l *listener) trusts(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	if !ok || len(l.proxies) == 0 {
		return false
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	if !ok {
		return false
	}
	ip = ip.Unmap()
	for _, p := range l.proxies {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// client is the address nc's kettle connects from: its peer's, or, when
// the peer is a trusted proxy, the source its PROXY protocol v2 header
// names (a LOCAL header, the proxy's own connection: the peer's). From a
// trusted proxy the header is required: an error refuses the connection.
// The header is read before TLS, under the connect timeout set at accept.
func (l *listener) client(nc net.Conn) (net.Addr, error) {
	peer := nc.RemoteAddr()
	if !l.trusts(peer) {
		return peer, nil
	}
	src, err := readProxyHeader(nc)
	if err != nil {
		l.refuseProxy(peer, "from a trusted proxy: "+err.Error())
		return nil, err
	}
	if src == nil {
		return peer, nil
	}
	return src, nil
}

// readProxyHeader reads a PROXY protocol v2 header from r to its last byte
// and no further, then parses it with go-proxyproto: nothing of what the
// kettle sends after it is read here, so a plain connection stays a socket
// the poller reads with system calls (poll_linux.go). It returns the source
// address of a PROXY header over TCP, nil for a LOCAL one.
func readProxyHeader(r io.Reader) (net.Addr, error) {
	var fixed [16]byte // signature, version and command, family, length
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return nil, fmt.Errorf("%w (%w)", errNoProxyHeader, err)
	}
	if !bytes.Equal(fixed[:12], proxyproto.SIGV2) {
		return nil, errNoProxyHeader
	}
	n := int(binary.BigEndian.Uint16(fixed[14:]))
	if n > maxProxyHeader {
		return nil, fmt.Errorf("PROXY v2 header of %d bytes: at most %d accepted", n+16, maxProxyHeader+16)
	}
	buf := make([]byte, 16+n)
	copy(buf, fixed[:])
	if _, err := io.ReadFull(r, buf[16:]); err != nil {
		return nil, fmt.Errorf("PROXY v2 header cut short: %w", err)
	}
	h, err := proxyproto.Read(bufio.NewReaderSize(bytes.NewReader(buf), len(buf)))
	if err != nil {
		return nil, fmt.Errorf("malformed PROXY v2 header: %w", err)
	}
	if h.Command.IsLocal() {
		return nil, nil
	}
	src, _, ok := h.TCPAddrs()
	if !ok {
		return nil, fmt.Errorf("PROXY v2 header for address family and protocol %#02x: want TCP over IPv4 or IPv6", byte(h.TransportProtocol))
	}
	return src, nil
}

// isProxyHeader reports whether a connection's first two bytes are those
// of a PROXY protocol header (v2's CR LF, v1's "PR"): neither begins an
// MQTT packet (type 0 is reserved; "P" is a PUBREL with wrong flags).
func isProxyHeader(hdr [2]byte) bool {
	return bytes.HasPrefix(proxyproto.SIGV2, hdr[:]) || bytes.HasPrefix(proxyproto.SIGV1, hdr[:])
}

// refuseProxy logs (thinned) a connection refused for its PROXY header:
// missing or malformed from a trusted proxy, or sent by a peer that is not
// one (whose claim about the client is not believed).
func (l *listener) refuseProxy(peer net.Addr, why string) {
	if ok, skipped := l.proxyLog.Allow(time.Now()); ok {
		l.log.Warn("mqtt: connection refused: PROXY protocol header "+why, "peer", peer.String(),
			"trusted_proxies", len(l.proxies), "not_logged_since_last_line", skipped)
	}
}
