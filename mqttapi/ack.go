package mqttapi

import (
	"strings"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Pipelined QoS 1: a connection keeps reading while its earlier messages
// wait for their commit. devConn.publish hands each decoded message to
// ingest on its own goroutine, which records the outcome in the
// connection's acker, which writes the
// PUBACKs in the order the PUBLISHes arrived (MQTT 3.1.1 §4.6, MQTT 5
// §4.6), each only after the commit that holds its readings. Before, a
// connection was not read while one message waited for its commit, so one
// connection could have one message per commit cycle in the store's hands
// (bench/mqtt.sh: 7,796 msgs/s with 2,000 connections × 4 in flight).
//
// Bounded twice: a connection has at most Config.ConnWindow messages
// waiting (then its reader blocks: per-connection backpressure, as before),
// and the whole listener at most Config.MaxPendingRows readings (then every
// reader that needs more blocks until a commit frees some). So the
// goroutines and decoded readings held are at most MaxPendingRows, whatever
// the number of connections.

// acker orders one connection's PUBACKs.
type acker struct {
	mu       sync.Mutex
	q        []*pendingAck // arrival order; the head is the next PUBACK to write
	slots    chan struct{} // one per message waiting (ConnWindow)
	flushing bool          // a goroutine is writing PUBACKs (complete)
	due      []*pendingAck // the flusher's scratch
}

// pendingAck is one QoS 1 message awaiting its PUBACK.
type pendingAck struct {
	pid  uint16
	rows int                    // of the listener-wide budget
	user []packets.UserProperty // echoed on the PUBACK [MQTT-3.4.2]
	code packets.Code
	done bool // outcome known
	skip bool // no PUBACK: given up (client gone, shutdown); it redelivers
}

// acker returns the connection's acker, made at its first QoS 1 message.
// Called on the connection's read goroutine only.
func (c *conn) acker(window int) *acker {
	if c.ack == nil {
		c.ack = &acker{slots: make(chan struct{}, window)}
	}
	return c.ack
}

// acquire takes a per-connection slot and n rows of the listener-wide
// budget for one message, blocking (and so not reading the connection)
// while either is exhausted. It fails when the broker shuts down or the
// client is gone.
func (b *Broker) acquire(dc *devConn, a *acker, n int) bool {
	select {
	case a.slots <- struct{}{}:
	default:
		if !b.wait(dc, func(abort <-chan struct{}) bool {
			select {
			case a.slots <- struct{}{}:
				return true
			case <-abort:
				return false
			}
		}) {
			return false
		}
	}
	if !b.rows.tryAcquire(n) {
		b.counters.Withheld.Add(1) // its PUBACK waits for room, as for a full ingest queue
		if !b.wait(dc, func(abort <-chan struct{}) bool { return b.rows.acquire(n, abort) }) {
			<-a.slots
			return false
		}
	}
	return true
}

// wait runs get, which blocks until it has what it waits for (true) or
// abort is closed (false); abort is closed when the broker shuts down or
// the client is gone.
func (b *Broker) wait(dc *devConn, get func(abort <-chan struct{}) bool) bool {
	abort := make(chan struct{})
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-b.ctx.Done():
			case <-t.C:
				if !dc.Closed() {
					continue
				}
			}
			close(abort)
			return
		}
	}()
	return get(abort)
}

// rowBudget is a fair (first come, first served) weighted semaphore of
// readings waiting for their commit. It is kept below the ingest queue's
// capacity so that messages seldom meet a full queue (whose retries
// sleep): a connection waits here instead, and the first in line is handed
// its rows as soon as a commit frees them (no herd of waiters retrying).
type rowBudget struct {
	mu      sync.Mutex
	used    int
	limit   int
	waiters []*rowWaiter
}

type rowWaiter struct {
	n     int
	ready chan struct{} // closed when the rows are granted
}

func newRowBudget(limit int) *rowBudget { return &rowBudget{limit: max(limit, 1)} }

// tryAcquire takes n rows if they are free and nobody waits (a message
// larger than the whole budget takes all of it).
func (r *rowBudget) tryAcquire(n int) bool {
	n = min(n, r.limit)
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.waiters) > 0 || r.used+n > r.limit {
		return false
	}
	r.used += n
	return true
}

// acquire waits in line for n rows, or until abort is closed.
func (r *rowBudget) acquire(n int, abort <-chan struct{}) bool {
	n = min(n, r.limit)
	r.mu.Lock()
	if len(r.waiters) == 0 && r.used+n <= r.limit {
		r.used += n
		r.mu.Unlock()
		return true
	}
	w := &rowWaiter{n: n, ready: make(chan struct{})}
	r.waiters = append(r.waiters, w)
	r.mu.Unlock()
	select {
	case <-w.ready:
		return true
	case <-abort:
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-w.ready: // granted meanwhile: give the rows back
		r.used -= n
		r.grant()
		return false
	default:
	}
	for i, x := range r.waiters {
		if x == w {
			r.waiters = append(r.waiters[:i], r.waiters[i+1:]...)
			break
		}
	}
	r.grant() // the head may have changed
	return false
}

func (r *rowBudget) release(n int) {
	n = min(n, r.limit)
	r.mu.Lock()
	r.used -= n
	r.grant()
	r.mu.Unlock()
}

// grant hands free rows to the waiters in line. r.mu held.
func (r *rowBudget) grant() {
	k := 0
	for k < len(r.waiters) && r.used+r.waiters[k].n <= r.limit {
		r.used += r.waiters[k].n
		close(r.waiters[k].ready)
		r.waiters[k] = nil
		k++
	}
	if k > 0 {
		r.waiters = append(r.waiters[:0], r.waiters[k:]...)
	}
}

// enqueue appends a message to the connection's PUBACK order. Its user
// properties (echoed in the PUBACK) are copied: the codec's decoded strings
// point into the packet's buffer, and one of a few bytes would keep a whole
// packet (up to a MiB) alive until the commit.
func (a *acker) enqueue(pid uint16, rows int, user []packets.UserProperty) *pendingAck {
	p := &pendingAck{pid: pid, rows: rows, user: cloneUser(user)}
	a.mu.Lock()
	a.q = append(a.q, p)
	a.mu.Unlock()
	return p
}

// complete records p's outcome and writes every PUBACK now due, in order,
// releasing their slots. One goroutine at a time writes a connection's
// PUBACKs (the flusher); acks that become due meanwhile are picked up by
// its next round, so a commit that completes several of a connection's
// messages costs one write, not one each.
func (b *Broker) complete(dc *devConn, a *acker, p *pendingAck, code packets.Code, skip bool) {
	a.mu.Lock()
	p.code, p.skip, p.done = code, skip, true
	if a.flushing {
		a.mu.Unlock()
		return
	}
	a.flushing = true
	for {
		n := 0
		for n < len(a.q) && a.q[n].done {
			n++
		}
		if n == 0 {
			a.flushing = false
			a.mu.Unlock()
			return
		}
		due := append(a.due[:0], a.q[:n]...)
		clear(a.q[:n])
		a.q = append(a.q[:0], a.q[n:]...)
		if cap(a.q) > 64 && len(a.q) < 8 {
			a.q = append([]*pendingAck(nil), a.q...) // do not keep a burst's backing array
		}
		a.mu.Unlock()
		dc.writeAcks(due)
		for i, h := range due {
			<-a.slots
			b.rows.release(h.rows)
			due[i] = nil
		}
		if cap(due) <= 64 {
			a.due = due[:0]
		}
		a.mu.Lock()
	}
}

// cloneUser copies user properties out of the packet buffer they point into.
func cloneUser(user []packets.UserProperty) []packets.UserProperty {
	if len(user) == 0 {
		return nil
	}
	c := make([]packets.UserProperty, len(user))
	for i, u := range user {
		c[i] = packets.UserProperty{Key: strings.Clone(u.Key), Val: strings.Clone(u.Val)}
	}
	return c
}
