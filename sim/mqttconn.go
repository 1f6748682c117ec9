package sim

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/kettlefleet/kettlefleet/internal/rawio"
)

// mqConn is one MQTT connection of a kettle: the packets are paho.golang's
// codec (packets), the client logic is ours. One goroutine per connection
// reads it (readLoop); everything else — publishes, PINGREQs, the PUBACK of a
// QoS 1 command — is written by whoever holds the kettle's lock, mostly the
// scheduler, without a goroutine or a timer of its own: a write is one
// non-blocking attempt (tryWrite), and only when the socket buffer is full
// does a flusher goroutine take the rest, with a deadline. Its fields are
// guarded by the kettle's mu (nc and br excepted: set once; br is the
// reader's).
type mqConn struct {
	nc       net.Conn
	rc       syscall.RawConn // nc's, for the non-blocking write; nil: blocking writes with a deadline
	br       *bufio.Reader
	wbuf     []byte // bytes the flusher still has to write, in order
	flushing bool   // a flusher owns the writes until wbuf is empty
	dead     bool   // a write failed or the run ended: closed, the reader reports it
	hard     bool   // it died of a timeout or a busy server: reconnect with the longer backoff
}

func newMQConn(nc net.Conn) *mqConn {
	c := &mqConn{nc: nc}
	var r io.Reader = nc
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
			if rawio.Enabled {
				r = newRawConn(rc)
			}
		}
	}
	c.br = bufio.NewReaderSize(r, 256)
	return c
}

// write sends one or more whole packets, in order with earlier writes. A
// connection that cannot take them is closed; its reader then reports the
// loss. k.mu held (k being the connection's kettle).
func (s *mqttTransport) mqWrite(k *kettleState, c *mqConn, b []byte) {
	if c.dead || len(b) == 0 {
		return
	}
	if c.flushing {
		c.wbuf = append(c.wbuf, b...)
		return
	}
	n, err := c.tryWrite(b)
	if err != nil {
		c.kill()
		return
	}
	if n < len(b) {
		// The socket buffer is full (a server not reading, or a big batch):
		// hand the rest to a flusher rather than block the scheduler.
		c.wbuf = append(c.wbuf[:0], b[n:]...)
		c.flushing = true
		s.readers.Add(1)
		go s.flush(k, c)
	}
}

// flush writes what mqWrite could not, with the request timeout as deadline.
func (s *mqttTransport) flush(k *kettleState, c *mqConn) {
	defer s.readers.Done()
	for {
		k.mu.Lock()
		b := c.wbuf
		c.wbuf = nil
		if len(b) == 0 || c.dead {
			c.flushing = false
			k.mu.Unlock()
			return
		}
		k.mu.Unlock()
		_ = c.nc.SetWriteDeadline(time.Now().Add(s.cfg.Timeout))
		if _, err := c.nc.Write(b); err != nil {
			k.mu.Lock()
			c.flushing = false
			c.hard = c.hard || isTimeout(err)
			c.kill()
			k.mu.Unlock()
			return
		}
	}
}

// tryWrite writes what the socket takes now without waiting: n < len(b)
// means the rest must wait for the socket to drain.
func (c *mqConn) tryWrite(b []byte) (n int, err error) {
	if c.rc == nil {
		_ = c.nc.SetWriteDeadline(time.Now().Add(10 * time.Second))
		return c.nc.Write(b)
	}
	var werr error
	err = c.rc.Write(func(fd uintptr) bool {
		for n < len(b) {
			m, e := rawio.Write(fd, b[n:])
			if e == syscall.EINTR {
				continue
			}
			if e == syscall.EAGAIN {
				break
			}
			if e != 0 {
				werr = e
				break
			}
			n += m
		}
		return true // never wait: the caller hands the rest to a flusher
	})
	if err == nil {
		err = werr
	}
	return n, err
}

// kill closes the connection; its reader sees the error and reports the loss.
func (c *mqConn) kill() {
	if !c.dead {
		c.dead = true
		c.nc.Close()
	}
}

// mqEncode returns packet cp in wire format, appended to dst.
func mqEncode(dst []byte, cp *packets.ControlPacket) []byte {
	b := bytes.NewBuffer(dst)
	_, _ = cp.WriteTo(b) // a bytes.Buffer does not fail
	return b.Bytes()
}
