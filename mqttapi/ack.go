package mqttapi

import (
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Pipelined QoS 1: a connection keeps reading while its earlier messages
// wait for their commit. OnPublish hands each decoded message to ingest on
// its own goroutine and tells mochi to write nothing (ErrRejectPacket); the
// goroutine records the outcome in the connection's acker, which writes the
// PUBACKs in the order the PUBLISHes arrived (MQTT 3.1.1 §4.6, MQTT 5
// §4.6), each only after the commit that holds its readings. Before, a
// connection was not read while one message waited for its commit, so one
// connection could have one message per commit cycle in the store's hands
// (bench/mqtt.sh: 7,796 msgs/s with 2,000 connections × 4 in flight).
//
// Bounded twice: a connection has at most Config.ConnWindow messages
// waiting (then its reader blocks: per-connection backpressure, as before),
// and the whole listener at most Config.MaxPending (then every reader that
// needs another slot blocks). So the goroutines and decoded readings held
// are at most MaxPending, whatever the number of connections.

// acker orders one connection's PUBACKs.
type acker struct {
	mu    sync.Mutex
	q     []*pendingAck // arrival order; the head is the next PUBACK to write
	slots chan struct{} // one per message waiting (ConnWindow)
}

// pendingAck is one QoS 1 message awaiting its PUBACK.
type pendingAck struct {
	pid  uint16
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

// acquire takes a per-connection and a listener-wide slot for one message,
// blocking (and so not reading the connection) while either is exhausted.
// It fails when the broker shuts down or the client is gone.
func (b *Broker) acquire(cl *mqtt.Client, a *acker) bool {
	for _, ch := range []chan struct{}{a.slots, b.pending} {
		select {
		case ch <- struct{}{}:
			continue
		default:
		}
		t := time.NewTicker(250 * time.Millisecond)
	wait:
		for {
			select {
			case ch <- struct{}{}:
				break wait
			case <-b.ctx.Done():
			case <-t.C:
				if !cl.Closed() {
					continue
				}
			}
			t.Stop()
			if ch == b.pending { // the connection slot was taken
				<-a.slots
			}
			return false
		}
		t.Stop()
	}
	return true
}

// enqueue appends a message to the connection's PUBACK order.
func (a *acker) enqueue(pid uint16) *pendingAck {
	p := &pendingAck{pid: pid}
	a.mu.Lock()
	a.q = append(a.q, p)
	a.mu.Unlock()
	return p
}

// complete records p's outcome and writes every PUBACK now due, in order,
// releasing their slots.
func (b *Broker) complete(cl *mqtt.Client, a *acker, p *pendingAck, code packets.Code, skip bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	p.code, p.skip, p.done = code, skip, true
	n := 0
	for n < len(a.q) && a.q[n].done {
		h := a.q[n]
		if !h.skip {
			ack := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: h.pid, ReasonCode: h.code.Code}
			if h.code.Code >= packets.ErrUnspecifiedError.Code {
				ack.Properties.ReasonString = h.code.Reason // MQTT 5 only; dropped if the client asked for no problem info
			}
			_ = cl.WritePacket(ack) // a failed write closes the connection; the client redelivers
		}
		a.q[n] = nil
		n++
		<-a.slots
		<-b.pending
	}
	if n > 0 {
		a.q = append(a.q[:0], a.q[n:]...)
		if cap(a.q) > 64 && len(a.q) < 8 {
			a.q = append([]*pendingAck(nil), a.q...) // do not keep a burst's backing array
		}
	}
}
