//go:build linux

package mqttapi

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kettlefleet/kettlefleet/internal/rawio"
)

// poller holds the listener's idle plain-TCP connections in one epoll
// set, so that a connected kettle between two packets costs no goroutine:
// a goroutine parked in a read is a 2 KiB stack and a ~400-byte
// descriptor per connection, a third of a node's memory per kettle at a
// reading every 30 s. When bytes (or its end) arrive, the poller hands the
// connection to a handler goroutine (reused: dispatch) for a turn that
// reads and handles every whole packet there (devConn.turn); a
// connection's pollState lets one turn run at a time, so its packets are
// handled in order, as by a reader of its own, and a connection whose
// handling waits (its window of PUBACKs full, --device-rate) is not read
// meanwhile.
//
// The set's own descriptor sits in Go's netpoller: the poller's goroutine
// parks there between events instead of holding a thread in a blocking
// epoll_wait (whose return, on a process that had gone idle, costs the
// scheduler a thread handoff and a wakeup of its monitor thread), and
// collects the events with a non-blocking epoll_wait made without the
// scheduler's syscall bookkeeping (RawSyscall), as the connections' reads
// and writes are (rawio.Read, conn.Write). Connections are registered once,
// edge-triggered: no epoll_ctl per packet. An edge comes with every arrival
// of bytes, so a turn ends once a read has left the socket empty, and an
// edge that arrives during a turn makes it read again (pollAgain).
//
// If epoll_wait fails (nothing in its contract fails on a valid set; a bug
// or a closed descriptor), every connection is handed back to a reading
// goroutine of its own (fail): more memory per kettle, but every kettle is
// still read, kept alive and acknowledged, and the node says so.
type poller struct {
	epfd int
	ep   *os.File        // epfd as the netpoller sees it
	raw  syscall.RawConn // of ep
	// mu guards conns: the connection registered on each fd, with the
	// generation its events carry, so that an event of a connection that
	// ended (its fd closed, the number reused) is not taken for the next.
	mu     sync.Mutex
	conns  []*devConn // by fd
	gen    uint32
	failed bool // epoll_wait failed: add refuses, every connection has a reader
	stop   atomic.Bool
	done   chan struct{}
	// onErr reports the failure and how many connections got a reader.
	onErr func(err error, handedBack int)

	// work hands a ready connection to an idle handler goroutine; with
	// none idle, a new one starts. A handler keeps the stack its packets
	// grew (a fresh goroutine starts at 2 KiB and copies its stack at each
	// doubling, for every packet) and its read buffer, and ends after
	// handlerIdle without work.
	work     chan *devConn
	quit     chan struct{}
	handlers sync.WaitGroup
}

// A connection's pollState: who reads it.
const (
	pollIdle       uint32 = iota // in the set, nobody reading: its next edge starts a turn
	pollBusy                     // a turn is reading or handling it
	pollAgain                    // a turn is, and an edge came meanwhile: it reads again
	pollOut                      // a goroutine of its own reads it (the poller failed)
	pollOutPending               // a turn is, and the poller failed: the turn hands it over
)

// handlerIdle is how long a handler goroutine waits for more work.
const handlerIdle = 2 * time.Second

// turnBufBytes is a turn's read buffer: a kettle's PUBLISH of one reading
// (~300 bytes) and whatever follows it in one read.
const turnBufBytes = 2 << 10

// newPoller starts the poller's goroutine (stopped by close).
func newPoller(onErr func(err error, handedBack int)) (*poller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	ep := os.NewFile(uintptr(fd), "mqtt-epoll")
	raw, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return nil, err
	}
	p := &poller{epfd: fd, ep: ep, raw: raw, done: make(chan struct{}), onErr: onErr,
		work: make(chan *devConn), quit: make(chan struct{})}
	go p.run()
	return p, nil
}

func (p *poller) run() {
	defer close(p.done)
	events := make([]syscall.EpollEvent, 256)
	var n int
	var werr error
	wait := func(fd uintptr) bool {
		for {
			r, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, fd, uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), 0, 0, 0)
			switch e {
			case 0:
				n = int(r)
				return n > 0 // none: wait in the netpoller for the set's next edge
			case syscall.EINTR:
			default:
				werr = e
				return true
			}
		}
	}
	for {
		n, werr = 0, nil
		err := p.raw.Read(wait)
		if p.stop.Load() {
			return
		}
		if err == nil {
			err = werr
		}
		if err != nil {
			p.fail(err)
			return
		}
		p.mu.Lock()
		for _, ev := range events[:n] {
			if fd := int(ev.Fd); fd < len(p.conns) {
				if dc := p.conns[fd]; dc != nil && dc.pollGen == uint32(ev.Pad) {
					p.ready(dc)
				}
			}
		}
		p.mu.Unlock()
	}
}

// ready starts a turn for dc, or tells the turn in progress to read again.
func (p *poller) ready(dc *devConn) {
	for {
		switch s := dc.pollState.Load(); s {
		case pollIdle:
			if dc.pollState.CompareAndSwap(s, pollBusy) {
				p.dispatch(dc)
				return
			}
		case pollBusy:
			if dc.pollState.CompareAndSwap(s, pollAgain) {
				return
			}
		default:
			return
		}
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
	t := newTurnReader()
	idle := time.NewTimer(handlerIdle)
	defer idle.Stop()
	for {
		dc.turn(t)
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

// endTurn reports whether dc's turn is over (false: an edge came during
// it, read again). A connection the failed poller handed over meanwhile
// gets its reading goroutine here.
func (p *poller) endTurn(dc *devConn) bool {
	for {
		switch s := dc.pollState.Load(); s {
		case pollBusy:
			if dc.pollState.CompareAndSwap(s, pollIdle) {
				return true
			}
		case pollAgain:
			if dc.pollState.CompareAndSwap(s, pollBusy) {
				return false
			}
		case pollOutPending:
			if dc.pollState.CompareAndSwap(s, pollOut) {
				go dc.readOwn()
				return true
			}
		default:
			return true
		}
	}
}

// fail hands every connection to a reading goroutine of its own: the set
// is not waited on any more.
func (p *poller) fail(err error) {
	p.mu.Lock()
	p.failed = true
	var conns []*devConn
	for fd, dc := range p.conns {
		if dc != nil {
			conns = append(conns, dc)
			p.conns[fd] = nil
		}
	}
	p.mu.Unlock()
	for _, dc := range conns {
		handBack(dc)
	}
	p.onErr(err, len(conns))
}

// handBack gives dc a reading goroutine of its own, now if no turn runs,
// else at the end of the turn.
func handBack(dc *devConn) {
	for {
		switch s := dc.pollState.Load(); s {
		case pollIdle:
			if dc.pollState.CompareAndSwap(s, pollOut) {
				go dc.readOwn()
				return
			}
		case pollBusy, pollAgain:
			if dc.pollState.CompareAndSwap(s, pollOutPending) {
				return
			}
		default:
			return
		}
	}
}

// close stops the poller's goroutines once every connection has ended.
func (p *poller) close() {
	p.stop.Store(true)
	p.ep.Close() // wakes run
	<-p.done
	close(p.quit)
	p.handlers.Wait()
}

// add registers dc, whose reading goroutine then ends: from here on its
// packets are read in turns on the poller's handlers. False: not held (not
// plain TCP, closed, or the poller failed); its reading goroutine goes on
// reading.
func (p *poller) add(dc *devConn) bool {
	rc := dc.c.raw
	if rc == nil {
		return false
	}
	// No read deadline: a turn's first read must not fail on the connect
	// timeout's; expire keeps the kettle to its keepalive, and a turn that
	// waits for the rest of a packet sets one (turnReader.fill).
	if dc.c.Conn.SetReadDeadline(time.Time{}) != nil {
		return false
	}
	if !p.register(dc, rc) {
		_ = dc.refreshDeadline() // its reading goroutine reads under the keepalive
		return false
	}
	return true
}

// register puts dc in the set; false: the caller reads it.
func (p *poller) register(dc *devConn, rc syscall.RawConn) bool {
	dc.pollState.Store(pollIdle)
	var err error
	if cerr := rc.Control(func(fd uintptr) {
		p.mu.Lock()
		if p.failed {
			p.mu.Unlock()
			err = errPollerFailed
			return
		}
		p.gen++
		dc.pollFD, dc.pollGen = int32(fd), p.gen
		if int(fd) >= len(p.conns) {
			p.conns = append(p.conns, make([]*devConn, int(fd)+1-len(p.conns)+len(p.conns)/2)...)
		}
		p.conns[fd] = dc
		p.mu.Unlock()
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP | epollET, Fd: dc.pollFD, Pad: int32(dc.pollGen)}
		err = syscall.EpollCtl(p.epfd, syscall.EPOLL_CTL_ADD, int(fd), &ev)
	}); cerr != nil {
		err = cerr
	}
	if err == nil {
		return true
	}
	p.remove(dc)
	// A poller that failed meanwhile may have handed dc to a reading
	// goroutine already (pollOut): then that one reads it, not the caller.
	return !dc.pollState.CompareAndSwap(pollIdle, pollOut)
}

// epollET is EPOLLET, which package syscall spells as a negative int.
const epollET = 1 << 31

var errPollerFailed = errors.New("mqtt: the connection poller failed")

// remove forgets dc before its fd is closed (closing the fd takes it out of
// the epoll set).
func (p *poller) remove(dc *devConn) {
	p.mu.Lock()
	if fd := int(dc.pollFD); fd < len(p.conns) && p.conns[fd] == dc {
		p.conns[fd] = nil
	}
	p.mu.Unlock()
}

// rawConnOf is nc's descriptor when the listener may read and write it with
// raw system calls (plain TCP).
func rawConnOf(nc net.Conn) syscall.RawConn {
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// turn reads and handles every whole packet waiting on a poller
// connection, on a handler goroutine (pollState makes it the connection's
// only reader), then leaves the connection to its next edge, or ends it.
func (dc *devConn) turn(t *turnReader) {
	p := dc.d.poll
	// While its packets are handled the kettle is not overdue (expire).
	due := dc.due.Swap(0)
	t.begin(dc)
	var err error
	for {
		if t.r == t.w {
			if t.drained {
				dc.due.Store(due)
				t.end()
				if p.endTurn(dc) {
					return // dc may be another goroutine's now
				}
				dc.due.Store(0)
				t.begin(dc)
			}
			if err = t.fill(false); err == errWouldBlock {
				t.drained, err = true, nil
				continue
			}
			if err != nil {
				break
			}
			continue
		}
		var hdr [2]byte
		if _, err = io.ReadFull(t, hdr[:]); err != nil {
			break
		}
		if err = dc.guard(func() error { return dc.packet(hdr, t) }); err != nil {
			break
		}
		due = dc.nextDue()
	}
	t.end()
	p.remove(dc)
	dc.finish()
}

// turnReader is a handler goroutine's reader of one connection's turn:
// whatever the socket holds is read at once into buf (usually one
// packet, whole, in one read(2)), and packets are taken from there.
type turnReader struct {
	dc   *devConn
	buf  []byte
	r, w int
	// drained: the last read returned less than it asked for, so it left
	// the socket empty; bytes arriving after it bring an edge.
	drained bool
	// deadline: a read deadline is set on dc (the turn waited for the
	// rest of a packet); end clears it.
	deadline bool

	dst   []byte // of the read in progress
	block bool
	n     int
	err   error
	read  func(fd uintptr) bool
}

// errWouldBlock: the socket holds nothing to read now.
var errWouldBlock = errors.New("mqtt: nothing to read")

func newTurnReader() *turnReader {
	t := &turnReader{buf: make([]byte, turnBufBytes)}
	t.read = func(fd uintptr) bool {
		for {
			n, e := rawio.Read(fd, t.dst)
			switch e {
			case 0:
				t.n = n
				if n == 0 {
					t.err = io.EOF
				}
				return true
			case syscall.EINTR:
			case syscall.EAGAIN:
				if !t.block {
					t.err = errWouldBlock
					return true
				}
				return false // wait in the netpoller, within the read deadline
			default:
				t.err = e
				return true
			}
		}
	}
	return t
}

func (t *turnReader) begin(dc *devConn) {
	t.dc, t.r, t.w, t.drained = dc, 0, 0, false
}

// end clears the read deadline a wait set: the connection's next turn
// begins with a read that must not fail on it.
func (t *turnReader) end() {
	if t.deadline {
		_ = t.dc.c.Conn.SetReadDeadline(time.Time{})
		t.deadline = false
	}
}

// fill reads what the socket holds into the empty buffer. Without block it
// returns errWouldBlock when the socket holds nothing; with block it waits
// for bytes within one and a half keepalives (the rest of a packet).
func (t *turnReader) fill(block bool) error {
	n, err := t.readInto(t.buf, block)
	t.r, t.w = 0, n
	return err
}

func (t *turnReader) readInto(b []byte, block bool) (int, error) {
	if block && !t.deadline && t.dc.keepalive > 0 {
		_ = t.dc.c.Conn.SetReadDeadline(time.Unix(0, t.dc.nextDue()))
		t.deadline = true
	}
	t.dst, t.block, t.n, t.err = b, block, 0, nil
	err := t.dc.c.raw.Read(t.read)
	t.dst = nil
	if err == nil {
		err = t.err
	}
	if err != nil {
		return 0, err
	}
	t.drained = t.n < len(b)
	return t.n, nil
}

// Read serves the buffer, then waits for more: a packet's rest. A read
// at least as large as the buffer goes straight into p (a large packet's
// body).
func (t *turnReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if t.r == t.w {
		if len(p) >= len(t.buf) {
			return t.readInto(p, true)
		}
		if err := t.fill(true); err != nil {
			return 0, err
		}
	}
	n := copy(p, t.buf[t.r:t.w])
	t.r += n
	return n, nil
}

// rawWriteOp is one conn.Write's non-blocking attempt (writeNow); pooled
// with its callback, so that a write allocates nothing.
type rawWriteOp struct {
	b   []byte
	n   int
	err error
	f   func(fd uintptr) bool
}

var rawWriteOps = sync.Pool{New: func() any {
	op := &rawWriteOp{}
	op.f = func(fd uintptr) bool {
		for op.n < len(op.b) {
			m, e := rawio.Write(fd, op.b[op.n:])
			switch e {
			case 0:
				op.n += m
			case syscall.EINTR:
			case syscall.EAGAIN:
				return true // the rest: conn.write, under a deadline
			default:
				op.err = e
				return true
			}
		}
		return true
	}
	return op
}}

// writeNow writes as much of b as the socket takes now, without waiting.
// A past write deadline (of an earlier write that had to wait) is no
// error here: the caller writes the rest under a new one.
func writeNow(rc syscall.RawConn, b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	op := rawWriteOps.Get().(*rawWriteOp)
	op.b, op.n, op.err = b, 0, nil
	err := rc.Write(op.f)
	n := op.n
	if err == nil {
		err = op.err
	}
	op.b, op.err = nil, nil
	rawWriteOps.Put(op)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = nil
	}
	return n, err
}
