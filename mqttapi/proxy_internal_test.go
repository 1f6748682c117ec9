package mqttapi

import (
	"bytes"
	"net"
	"strings"
	"testing"

	"github.com/pires/go-proxyproto"
)

// proxyHeader is a PROXY v2 header from src to dst as HAProxy's
// send-proxy-v2 writes it.
func proxyHeader(t testing.TB, cmd proxyproto.ProtocolVersionAndCommand, src, dst string) []byte {
	t.Helper()
	s, _ := net.ResolveTCPAddr("tcp", src)
	d, _ := net.ResolveTCPAddr("tcp", dst)
	h := proxyproto.HeaderProxyFromAddrs(2, s, d)
	h.Command = cmd
	b, err := h.Format()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReadProxyHeader: the client's address from a header, nothing read
// past it, and a clear refusal of anything else.
func TestReadProxyHeader(t *testing.T) {
	const next = "\x10\x20MQTT" // what the kettle sends after the header
	f := func(name string, in []byte, wantAddr, wantErr string) {
		t.Helper()
		r := bytes.NewReader(append(in, next...))
		a, err := readProxyHeader(r)
		switch {
		case wantErr != "":
			if err == nil || !strings.Contains(err.Error(), wantErr) {
				t.Errorf("%s: err %v, want one with %q", name, err, wantErr)
			}
			return
		case err != nil:
			t.Errorf("%s: %v", name, err)
			return
		}
		got := ""
		if a != nil {
			got = a.String()
		}
		if got != wantAddr {
			t.Errorf("%s: address %q, want %q", name, got, wantAddr)
		}
		if rest := r.Len(); rest != len(next) {
			t.Errorf("%s: %d bytes left after the header, want the kettle's %d untouched", name, rest, len(next))
		}
	}
	f("ipv4", proxyHeader(t, proxyproto.PROXY, "192.0.2.7:40000", "10.0.0.21:1883"), "192.0.2.7:40000", "")
	f("ipv6", proxyHeader(t, proxyproto.PROXY, "[2001:db8::7]:40000", "[2001:db8::21]:1883"), "[2001:db8::7]:40000", "")
	f("local", proxyHeader(t, proxyproto.LOCAL, "192.0.2.7:40000", "10.0.0.21:1883"), "", "")
	f("mqtt-without-header", []byte("\x10\x2a\x00\x04MQTT\x05\x02\x00\x1e"), "", "send-proxy-v2")
	f("v1-text", []byte("PROXY TCP4 192.0.2.7 10.0.0.21 40000 1883\r\n"), "", "send-proxy-v2")
	f("empty", nil, "", "send-proxy-v2")
	long := proxyHeader(t, proxyproto.PROXY, "192.0.2.7:40000", "10.0.0.21:1883")
	long[14], long[15] = 0xff, 0xff
	f("too-long", long, "", "at most")
	cut := proxyHeader(t, proxyproto.PROXY, "192.0.2.7:40000", "10.0.0.21:1883")
	f("cut-short", cut[:20], "", "cut short")
	udp := proxyHeader(t, proxyproto.PROXY, "192.0.2.7:40000", "10.0.0.21:1883")
	udp[13] = byte(proxyproto.UDPv4)
	f("udp", udp, "", "want TCP")
}

// FuzzReadProxyHeader: no input panics the header's reader, and what it
// accepts it read to the header's end and no further.
func FuzzReadProxyHeader(f *testing.F) {
	f.Add(proxyHeader(f, proxyproto.PROXY, "192.0.2.7:40000", "10.0.0.21:1883"))
	f.Add(proxyHeader(f, proxyproto.PROXY, "[2001:db8::7]:40000", "[2001:db8::21]:1883"))
	f.Add(proxyHeader(f, proxyproto.LOCAL, "192.0.2.7:40000", "10.0.0.21:1883"))
	f.Add([]byte("PROXY TCP4 192.0.2.7 10.0.0.21 40000 1883\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := bytes.NewReader(in)
		if _, err := readProxyHeader(r); err == nil && len(in) >= 16 {
			n := 16 + (int(in[14])<<8 | int(in[15]))
			if read := len(in) - r.Len(); read != n {
				t.Fatalf("accepted a header of %d bytes after reading %d", n, read)
			}
		}
	})
}
