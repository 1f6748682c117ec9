// Package blackhole is a TCP proxy that can stop forwarding without closing
// anything, as a network that drops packets does: a database host that is
// unreachable rather than shut down. Tests and make chaos put it between
// kettle serve and PostgreSQL.
package blackhole

import (
	"net"
	"sync"
	"testing"
)

// Proxy forwards connections on its listener to a target. While blocked,
// bytes read from either side are held and new connections are accepted but
// not connected onward; on unblock they flow again, as TCP's retransmissions
// would deliver them.
type Proxy struct {
	ln              net.Listener
	network, target string

	mu      sync.Mutex
	cond    *sync.Cond
	blocked bool
	closed  bool
	conns   []net.Conn
	wg      sync.WaitGroup
}

// Listen starts a proxy on addr (e.g. 127.0.0.1:0) to target, dialled with
// network ("tcp", or "unix" for a socket path). Close stops it.
func Listen(addr, network, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, network: network, target: target}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's listen address.
func (p *Proxy) Addr() net.Addr { return p.ln.Addr() }

// Block stops (true) or resumes (false) forwarding.
func (p *Proxy) Block(blocked bool) {
	p.mu.Lock()
	p.blocked = blocked
	p.cond.Broadcast()
	p.mu.Unlock()
}

// pass waits while blocked; false once closed.
func (p *Proxy) pass() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.blocked && !p.closed {
		p.cond.Wait()
	}
	return !p.closed
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns = append(p.conns, c)
	return true
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			if !p.pass() { // a SYN into the void: no answer until forwarding resumes
				c.Close()
				return
			}
			up, err := net.Dial(p.network, p.target)
			if err != nil {
				c.Close()
				return
			}
			if !p.track(up) {
				c.Close()
				return
			}
			p.wg.Add(2)
			go p.pipe(up, c)
			go p.pipe(c, up)
		}()
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.pass() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Close stops accepting, closes every connection and waits for its
// goroutines.
func (p *Proxy) Close() {
	p.ln.Close()
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

// Target is where a PostgreSQL DSN's server listens, as Listen dials it: a
// Unix socket when host is a directory (libpq's convention), else
// host:port. It reads the keyword/value form and postgres:// URLs.
func Target(dsn string) (network, addr string) {
	host, port := hostPort(dsn)
	if len(host) > 0 && host[0] == '/' {
		return "unix", host + "/.s.PGSQL." + port
	}
	return "tcp", net.JoinHostPort(host, port)
}

// Via is dsn with its host and port replaced by the proxy's.
func Via(dsn string, proxy net.Addr) string {
	host, port, _ := net.SplitHostPort(proxy.String())
	if u, ok := pgURL(dsn); ok {
		u.Host = net.JoinHostPort(host, port)
		return u.String()
	}
	return dsn + " host=" + host + " port=" + port // a later keyword wins
}

// ForDSN starts a proxy on 127.0.0.1 in front of dsn's server for a test,
// closed when the test ends, and returns it with dsn through it.
func ForDSN(t testing.TB, dsn string) (*Proxy, string) {
	t.Helper()
	network, target := Target(dsn)
	p, err := Listen("127.0.0.1:0", network, target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, Via(dsn, p.Addr())
}
