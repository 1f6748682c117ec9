package sim

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/rawio"
)

// The swarm speaks HTTP/1.1 over plain keep-alive connections it owns, with no
// transport goroutines: an idle kettle connection costs one file descriptor
// and a small read buffer, which is what lets one process hold ~19,000
// connections (the fd limit) for 100,000 kettles in well under 1 GB.
// Responses are parsed by readResponse, straight from the read buffer.

// conn is one keep-alive connection.
type conn struct {
	nc     net.Conn
	br     *bufio.Reader
	last   scratch // the last answer's body and ETag (readResponse reuses it)
	reused bool
	raw    *rawConn // plain TCP on Linux: reads and writes by rawio
}

// newConn wraps a dialed connection.
func newConn(nc net.Conn) *conn {
	c := &conn{nc: nc}
	var r io.Reader = nc
	if sc, ok := nc.(syscall.Conn); ok && rawio.Enabled {
		if rc, err := sc.SyscallConn(); err == nil {
			c.raw = newRawConn(rc)
			r = c.raw
		}
	}
	c.br = bufio.NewReaderSize(r, 2048)
	return c
}

// rawConn reads and writes a socket with rawio.Read and rawio.Write, waiting for
// readiness (and honouring deadlines) through the runtime's poller as
// net.Conn does. Its callbacks are made once, so a request allocates
// nothing. One goroutine may read while another writes, as on a net.Conn.
type rawConn struct {
	rc     syscall.RawConn
	rd, wr rawOp
}

// rawOp is the state of a read or a write in progress, and its callback.
type rawOp struct {
	b   []byte
	n   int
	err error
	f   func(fd uintptr) bool
}

func newRawConn(rc syscall.RawConn) *rawConn {
	r := &rawConn{rc: rc}
	r.rd.f = func(fd uintptr) bool {
		op := &r.rd
		n, e := rawio.Read(fd, op.b)
		for e == syscall.EINTR {
			n, e = rawio.Read(fd, op.b)
		}
		switch {
		case e == syscall.EAGAIN:
			return false
		case e != 0:
			op.err = e
		case n == 0:
			op.err = io.EOF
		}
		op.n = n
		return true
	}
	// The write loop is mqttapi's writeNow's (poll_linux.go) but for
	// EAGAIN: here it returns false, so that RawConn.Write waits in the
	// runtime's poller for the socket to drain; mqttapi's returns true and
	// hands the rest to a write under a deadline.
	r.wr.f = func(fd uintptr) bool {
		op := &r.wr
		for op.n < len(op.b) {
			m, e := rawio.Write(fd, op.b[op.n:])
			switch e {
			case 0:
				op.n += m
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false
			default:
				op.err = e
				return true
			}
		}
		return true
	}
	return r
}

func (r *rawConn) Read(b []byte) (int, error) {
	op := &r.rd
	op.b, op.n, op.err = b, 0, nil
	err := r.rc.Read(op.f)
	op.b = nil
	if err != nil {
		return 0, err
	}
	return op.n, op.err
}

func (r *rawConn) Write(b []byte) (int, error) {
	op := &r.wr
	op.b, op.n, op.err = b, 0, nil
	err := r.rc.Write(op.f)
	op.b = nil
	if err == nil {
		err = op.err
	}
	return op.n, err
}

// slot holds at most one connection; a nil conn is dialed on first use.
type slot struct{ c *conn }

// pool hands out slots. Per-device mode: kettle i owns slot i mod n (each
// slot is its own channel of one, so two kettles that share a slot take
// turns). Shared mode: any free slot of n.
type pool struct {
	perDevice []chan *slot
	shared    chan *slot
	dial      func(*pool) (net.Conn, error)
	open      atomic.Int64 // connections open now
	dials     atomic.Int64 // connections ever dialed
	// TLS handshakes completed, and those of them the server resumed.
	handshakes, resumed atomic.Int64
}

func newPool(n int, perDevice bool, dial func(*pool) (net.Conn, error)) *pool {
	p := &pool{dial: dial}
	if perDevice {
		p.perDevice = make([]chan *slot, n)
		for i := range p.perDevice {
			ch := make(chan *slot, 1)
			ch <- &slot{}
			p.perDevice[i] = ch
		}
	} else {
		p.shared = make(chan *slot, n)
		for range n {
			p.shared <- &slot{}
		}
	}
	return p
}

func (p *pool) ch(k int) chan *slot {
	if p.perDevice != nil {
		return p.perDevice[k%len(p.perDevice)]
	}
	return p.shared
}

// get waits for kettle k's slot until the deadline.
func (p *pool) get(k int, deadline time.Time) (*slot, error) {
	ch := p.ch(k)
	select {
	case s := <-ch:
		return s, nil
	default:
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case s := <-ch:
		return s, nil
	case <-t.C:
		return nil, errPoolTimeout
	}
}

func (p *pool) put(k int, s *slot) { p.ch(k) <- s }

// closeAll closes every idle connection (at the end of a run).
func (p *pool) closeAll() {
	drain := func(ch chan *slot) {
		for {
			select {
			case s := <-ch:
				if s.c != nil {
					s.c.nc.Close()
					s.c = nil
					p.open.Add(-1)
				}
				defer func() { ch <- s }()
			default:
				return
			}
		}
	}
	if p.shared != nil {
		drain(p.shared)
	}
	for _, ch := range p.perDevice {
		drain(ch)
	}
}

var errPoolTimeout = errors.New("no free connection before the request deadline")

// scratch is storage an answer's body and ETag are read into.
type scratch struct{ body, etag []byte }

// response is one HTTP answer as the swarm acts on it.
type response struct {
	status     int
	body       []byte
	retryAfter time.Duration
	etag       []byte // valid as long as body

	maxAge time.Duration // Cache-Control max-age; 0: none
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// do sends the requests in raw (request j ends at ends[j]) on the slot's
// connection in one write — HTTP/1.1 pipelining: a kettle's reading and
// its poll cost one write, not two — and reads their answers in order,
// handing each to got before it reads the next (an answer's body is valid
// only during got). It dials when the slot is empty. A reused connection
// that the server closed while idle is redialed once and the unanswered
// requests resent (every request the swarm sends is idempotent on the
// server); after an answer with Connection: close the rest go on a new
// connection.
func (p *pool) do(s *slot, raw []byte, ends []int, deadline time.Time, got func(j int, r response, err error)) {
	next, retried := 0, false
	for next < len(ends) {
		if s.c == nil {
			nc, err := p.dial(p)
			if err != nil {
				for ; next < len(ends); next++ {
					got(next, response{}, err)
				}
				return
			}
			p.open.Add(1)
			p.dials.Add(1)
			s.c = newConn(nc)
		}
		c := s.c
		from := 0
		if next > 0 {
			from = ends[next-1]
		}
		first, reused := next, c.reused
		err := c.write(raw[from:], deadline)
		for err == nil && next < len(ends) {
			var r rawResponse
			if r, err = readResponse(c.br, &c.last); err != nil {
				break
			}
			c.reused = true
			got(next, r.response, nil)
			next++
			if r.close {
				p.discard(s)
				break
			}
		}
		if err == nil {
			continue
		}
		p.discard(s)
		if !retried && reused && next == first && staleConn(err) {
			retried = true
			continue
		}
		for ; next < len(ends); next++ {
			got(next, response{}, err)
		}
		return
	}
}

func (p *pool) discard(s *slot) {
	if s.c != nil {
		s.c.nc.Close()
		s.c = nil
		p.open.Add(-1)
	}
}

func staleConn(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

type rawResponse struct {
	response
	close bool
}

func (c *conn) write(raw []byte, deadline time.Time) error {
	if err := c.nc.SetDeadline(deadline); err != nil {
		return err
	}
	var err error
	if c.raw != nil {
		_, err = c.raw.Write(raw)
	} else {
		_, err = c.nc.Write(raw)
	}
	return err
}

// maxBody bounds a response body the swarm reads.
const maxBody = 4 << 20

// readResponse reads one HTTP/1.1 response: the status, the few headers the
// swarm acts on, and the body (Content-Length or chunked), body and ETag
// into sc's storage when it is large enough (nil: new storage). It is the hot
// path of every request, so it reads straight from the connection's buffer
// without building a header map; anything it does not understand is an
// error, counted as such.
func readResponse(br *bufio.Reader, sc *scratch) (rawResponse, error) {
	var r rawResponse
	if sc == nil {
		sc = new(scratch)
	}
	line, err := readLine(br)
	if err != nil {
		return r, err
	}
	// HTTP/1.1 200 OK
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return r, fmt.Errorf("malformed status line %q", line)
	}
	code, err := strconv.Atoi(string(line[9:12]))
	if err != nil || code < 100 {
		return r, fmt.Errorf("malformed status line %q", line)
	}
	r.status = code
	r.close = line[7] == '0' // HTTP/1.0 closes unless told otherwise
	length, chunked := int64(-1), false
	for {
		line, err = readLine(br)
		if err != nil {
			return r, err
		}
		if len(line) == 0 {
			break
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			return r, fmt.Errorf("malformed header line %q", line)
		}
		value = bytes.TrimSpace(value)
		switch {
		case headerIs(name, "Content-Length"):
			if length, err = strconv.ParseInt(string(value), 10, 64); err != nil || length < 0 {
				return r, fmt.Errorf("bad Content-Length %q", value)
			}
		case headerIs(name, "Transfer-Encoding"):
			chunked = bytes.EqualFold(value, []byte("chunked"))
			if !chunked {
				return r, fmt.Errorf("unsupported Transfer-Encoding %q", value)
			}
		case headerIs(name, "Connection"):
			r.close = bytes.EqualFold(value, []byte("close"))
		case headerIs(name, "ETag"):
			sc.etag = append(sc.etag[:0], value...)
			r.etag = sc.etag
		case headerIs(name, "Retry-After"):
			if sec, err := strconv.Atoi(string(value)); err == nil && sec >= 0 {
				r.retryAfter = time.Duration(sec) * time.Second
			}
		case headerIs(name, "Cache-Control"):
			r.maxAge = maxAge(string(value))
		}
	}
	switch {
	case r.status == 204 || r.status == 304 || r.status/100 == 1:
		return r, nil
	case chunked:
		r.body, err = readChunked(br)
	case length >= 0:
		if length > maxBody {
			return r, fmt.Errorf("response body of %d bytes: more than %d", length, maxBody)
		}
		if length > 0 {
			if int64(cap(sc.body)) < length {
				sc.body = make([]byte, length)
			}
			r.body = sc.body[:length]
			_, err = io.ReadFull(br, r.body)
		}
	default: // until the server closes
		r.close = true
		r.body, err = io.ReadAll(io.LimitReader(br, maxBody))
	}
	return r, err
}

// headerIs compares a header name case-insensitively.
func headerIs(name []byte, want string) bool {
	return len(name) == len(want) && strings.EqualFold(string(name), want)
}

// readLine reads a CRLF- (or LF-) terminated line, without it. The line is
// valid until the next read.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		return nil, errors.New("response header line longer than the read buffer")
	}
	if err != nil {
		if err == io.EOF && len(line) > 0 {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return bytes.TrimRight(line, "\r\n"), nil
}

// readChunked reads a chunked body and its (ignored) trailers.
func readChunked(br *bufio.Reader) ([]byte, error) {
	var body []byte
	for {
		line, err := readLine(br)
		if err != nil {
			return nil, err
		}
		if i := bytes.IndexByte(line, ';'); i >= 0 {
			line = line[:i]
		}
		n, err := strconv.ParseInt(string(bytes.TrimSpace(line)), 16, 64)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("bad chunk size %q", line)
		}
		if n == 0 {
			for { // trailers, up to the empty line
				if line, err = readLine(br); err != nil || len(line) == 0 {
					return body, err
				}
			}
		}
		if int64(len(body))+n > maxBody {
			return nil, fmt.Errorf("chunked response body: more than %d bytes", maxBody)
		}
		start := len(body)
		body = append(body, make([]byte, n)...)
		if _, err := io.ReadFull(br, body[start:]); err != nil {
			return nil, err
		}
		if line, err = readLine(br); err != nil || len(line) != 0 {
			return nil, fmt.Errorf("chunk not followed by CRLF: %v", err)
		}
	}
}

// maxAge is the max-age directive of a Cache-Control value (0: none, or
// no-cache).
func maxAge(cc string) time.Duration {
	for _, d := range strings.Split(cc, ",") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(d), "max-age="); ok {
			if sec, err := strconv.Atoi(v); err == nil && sec > 0 {
				return time.Duration(sec) * time.Second
			}
		}
	}
	return 0
}

// appendRequestLine appends an HTTP/1.1 request's line and Host header to
// dst; its other headers, then endRequest, follow.
func appendRequestLine(dst []byte, method, host, base, path string) []byte {
	dst = append(dst, method...)
	dst = append(dst, ' ')
	dst = append(dst, base...)
	dst = append(dst, path...)
	dst = append(dst, " HTTP/1.1\r\nHost: "...)
	dst = append(dst, host...)
	return append(dst, "\r\n"...)
}

// endRequest appends the body's headers, the end of the header and the
// body (nil: a request without one) to a request begun by
// appendRequestLine.
func endRequest(dst, body []byte) []byte {
	if body != nil {
		dst = append(dst, "Content-Type: application/json\r\nContent-Length: "...)
		dst = strconv.AppendInt(dst, int64(len(body)), 10)
		dst = append(dst, "\r\n"...)
	}
	dst = append(dst, "\r\n"...)
	return append(dst, body...)
}

// errKind classifies a failed request for the error counters.
func errKind(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errPoolTimeout):
		return "pool_timeout"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE):
		return "fd_limit"
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return "no_ports"
	default:
		return "conn"
	}
}

// checkSourcePorts warns when n connections are too many for the source
// addresses src. With none, the kernel picks address and port at connect():
// ~28,000 ephemeral ports toward one server port. With some, each dial
// binds its address with port 0 first, and Linux gives bind() ports of one
// parity (connect() takes the other): past ~14,000 connections from one
// address every bind searches the whole used half, in the kernel, under its
// locks (bench/mqtt-fleet.sh with one address per swarm: the machine half
// in the kernel and the fleet stalled from 14,000 connections per swarm
// until the connects ended).
func checkSourcePorts(log io.Writer, n int, src []net.IP) {
	per, why := 28000, "ephemeral ports toward one server port"
	if len(src) > 0 {
		per, why = 14000, "bind takes half the ephemeral ports"
	}
	if n > per*max(len(src), 1) {
		fmt.Fprintf(log, "swarm: %d connections from %d source address(es): more than ~%d each (%s) makes dialing slow; consider --source-ips %d or more --source-addrs\n",
			n, max(len(src), 1), per, why, n/14000+1)
	}
}

// dialer returns a dial function for a loopback target, spreading
// connections round-robin over the source addresses src (see
// checkSourcePorts); none: the kernel picks. With tlsCfg each connection
// is TLS, its handshake done within timeout, counted in p.handshakes and,
// when the server resumed a session, p.resumed.
func dialer(addr string, src []net.IP, timeout time.Duration, tlsCfg *tls.Config) func(*pool) (net.Conn, error) {
	var next atomic.Uint32
	return func(p *pool) (net.Conn, error) {
		d := net.Dialer{Timeout: timeout, KeepAlive: -1}
		if len(src) > 0 {
			d.LocalAddr = &net.TCPAddr{IP: src[next.Add(1)%uint32(len(src))]}
		}
		c, err := d.DialContext(context.Background(), "tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("dial %s: %w", addr, err)
		}
		if tlsCfg == nil {
			return c, nil
		}
		tc := tls.Client(c, tlsCfg)
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if err := tc.HandshakeContext(ctx); err != nil {
			c.Close()
			return nil, fmt.Errorf("TLS handshake with %s: %w", addr, err)
		}
		p.handshakes.Add(1)
		if tc.ConnectionState().DidResume {
			p.resumed.Add(1)
		}
		return tc, nil
	}
}

// sourceAddrs is the list of source addresses a run dials from: cfg.SourceAddrs
// if given, else 127.0.0.1..SourceIPs when SourceIPs > 1 and the target is
// IPv4, else none.
func sourceAddrs(cfg *Config, addr string) []net.IP {
	if len(cfg.SourceAddrs) > 0 {
		return cfg.SourceAddrs
	}
	host, _, _ := net.SplitHostPort(addr)
	ip := net.ParseIP(host)
	if cfg.SourceIPs <= 1 || ip == nil || ip.To4() == nil {
		return nil
	}
	out := make([]net.IP, cfg.SourceIPs)
	for j := range out {
		n := j + 1
		out[j] = net.IPv4(127, byte(n>>16), byte(n>>8), byte(n))
	}
	return out
}

// ParseSourceAddrs parses --source-addrs: comma-separated loopback IPv4
// addresses or ranges (127.0.0.11-127.0.0.13).
func ParseSourceAddrs(s string) ([]net.IP, error) {
	var out []net.IP
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(f, "-")
		a, b := net.ParseIP(lo).To4(), net.ParseIP(lo).To4()
		if isRange {
			b = net.ParseIP(hi).To4()
		}
		if a == nil || b == nil || !a.IsLoopback() || !b.IsLoopback() {
			return nil, fmt.Errorf("--source-addrs %q: want loopback IPv4 addresses or ranges, e.g. 127.0.0.11,127.0.0.20-127.0.0.22", s)
		}
		x, y := binary.BigEndian.Uint32(a), binary.BigEndian.Uint32(b)
		if y < x || y-x >= 1<<16 {
			return nil, fmt.Errorf("--source-addrs: range %q is empty or too large", f)
		}
		for v := x; v <= y; v++ {
			out = append(out, net.IPv4(byte(v>>24), byte(v>>16), byte(v>>8), byte(v)))
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--source-addrs %q: no address", s)
	}
	return out, nil
}

func ipStrings(ips []net.IP) []string {
	var s []string
	for _, ip := range ips {
		s = append(s, ip.String())
	}
	return s
}

// FDBudget is how many connections the swarm may open: the fd limit less a
// reserve for everything else in the process.
func FDBudget(reserve int) int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 1000
	}
	if rl.Cur < rl.Max { // Go raises the soft limit at start; be sure
		rl.Cur = rl.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
	}
	n := int(rl.Cur) - 200 - reserve
	if n < 1 {
		n = 1
	}
	return n
}
