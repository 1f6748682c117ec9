//go:build linux

package mqttapi

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// poller holds the device engine's idle plain-TCP connections in one epoll
// set, so that a connected kettle between two packets costs no goroutine:
// a goroutine parked in a read is a 2 KiB stack and a ~400-byte
// descriptor per connection, a third of a node's memory per kettle at a
// reading every 30 s. Each connection is registered one-shot: when bytes
// (or its end) arrive, the poller starts a goroutine that reads and
// handles one packet and then re-arms it, so a connection is handled by one
// goroutine at a time and in order, as by a reader of its own (the
// handler goroutines are reused: dispatch), and a
// connection whose handling waits (its window of PUBACKs full, --device-rate)
// is not read meanwhile. Level-triggered: bytes already waiting at the
// re-arm fire at once. Reads and writes still go through the net.Conn
// (Go's own poller, deadlines); this set only says when to start reading.
type poller struct {
	epfd int
	// mu guards conns: the connection registered on each fd, with the
	// generation its events carry, so that an event of a connection that
	// ended (its fd closed, the number reused) is not taken for the next.
	mu    sync.Mutex
	conns []*devConn // by fd
	gen   uint32
	stop  atomic.Bool
	done  chan struct{}
	onErr func(error)

	// work hands a ready connection to an idle handler goroutine; with
	// none idle, a new one starts. A handler keeps the stack its packets
	// grew (a fresh goroutine starts at 2 KiB and copies its stack at each
	// doubling, for every packet), and ends after handlerIdle without work.
	work     chan *devConn
	quit     chan struct{}
	handlers sync.WaitGroup
}

// handlerIdle is how long a handler goroutine waits for more work.
const handlerIdle = 2 * time.Second

// newPoller starts the poller's goroutine (stopped by close).
func newPoller(onErr func(error)) (*poller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	p := &poller{epfd: fd, done: make(chan struct{}), onErr: onErr, work: make(chan *devConn), quit: make(chan struct{})}
	go p.run()
	return p, nil
}

// pollWaitMillis bounds one epoll wait, so that close is seen that soon.
const pollWaitMillis = 250

func (p *poller) run() {
	defer close(p.done)
	events := make([]syscall.EpollEvent, 256)
	for !p.stop.Load() {
		n, err := syscall.EpollWait(p.epfd, events, pollWaitMillis)
		if err != nil {
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			p.onErr(err)
			return
		}
		p.mu.Lock()
		for _, ev := range events[:n] {
			if fd := int(ev.Fd); fd < len(p.conns) {
				if dc := p.conns[fd]; dc != nil && dc.pollGen == uint32(ev.Pad) {
					p.dispatch(dc)
				}
			}
		}
		p.mu.Unlock()
	}
}

// dispatch hands dc to an idle handler, or starts one.
func (p *poller) dispatch(dc *devConn) {
	select {
	case p.work <- dc:
	default:
		p.handlers.Add(1)
		go p.handle(dc)
	}
}

func (p *poller) handle(dc *devConn) {
	defer p.handlers.Done()
	idle := time.NewTimer(handlerIdle)
	defer idle.Stop()
	for {
		dc.ready()
		idle.Reset(handlerIdle)
		select {
		case dc = <-p.work:
		case <-idle.C:
			return
		case <-p.quit:
			return
		}
	}
}

// close stops the poller's goroutines once every connection has ended.
func (p *poller) close() {
	p.stop.Store(true)
	<-p.done
	close(p.quit)
	p.handlers.Wait()
	syscall.Close(p.epfd)
}

// rawConn is dc's socket when the poller can hold it (plain TCP).
func rawConn(dc *devConn) (syscall.RawConn, bool) {
	tc, ok := dc.c.Conn.(*net.TCPConn)
	if !ok {
		return nil, false
	}
	rc, err := tc.SyscallConn()
	return rc, err == nil
}

// add registers dc, whose reading goroutine then ends: from here on its
// packets are read on goroutines the poller starts. False: not held (not
// plain TCP, or closed); its reading goroutine goes on reading.
func (p *poller) add(dc *devConn) bool {
	rc, ok := rawConn(dc)
	if !ok {
		return false
	}
	var err error
	if cerr := rc.Control(func(fd uintptr) {
		p.mu.Lock()
		p.gen++
		dc.pollFD, dc.pollGen = int32(fd), p.gen
		if int(fd) >= len(p.conns) {
			p.conns = append(p.conns, make([]*devConn, int(fd)+1-len(p.conns)+len(p.conns)/2)...)
		}
		p.conns[fd] = dc
		p.mu.Unlock()
		if err = p.ctl(syscall.EPOLL_CTL_ADD, dc); err != nil {
			p.remove(dc)
		}
	}); cerr != nil {
		p.remove(dc)
		return false
	}
	return err == nil
}

// rearm lets dc's next bytes start a goroutine again. An error means the
// connection is closed (or the set refused it): the caller ends it.
func (p *poller) rearm(dc *devConn) error {
	rc, ok := rawConn(dc)
	if !ok {
		return net.ErrClosed
	}
	var err error
	if cerr := rc.Control(func(uintptr) { err = p.ctl(syscall.EPOLL_CTL_MOD, dc) }); cerr != nil {
		return cerr
	}
	return err
}

func (p *poller) ctl(op int, dc *devConn) error {
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT, Fd: dc.pollFD, Pad: int32(dc.pollGen)}
	return syscall.EpollCtl(p.epfd, op, int(dc.pollFD), &ev)
}

// remove forgets dc before its fd is closed (closing the fd takes it out of
// the epoll set).
func (p *poller) remove(dc *devConn) {
	p.mu.Lock()
	if fd := int(dc.pollFD); fd < len(p.conns) && p.conns[fd] == dc {
		p.conns[fd] = nil
	}
	p.mu.Unlock()
}
