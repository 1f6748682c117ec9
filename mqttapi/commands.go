package mqttapi

import (
	"context"
	"encoding/json"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/minheap"
	"github.com/kettlefleet/kettlefleet/wire"
)

// CommandTopic is where device id's command is published.
func CommandTopic(id kettle.DeviceID) string { return "kettles/" + id.String() + "/command" }

// MeasurementTopic is where device id publishes its readings.
func MeasurementTopic(id kettle.DeviceID) string {
	return "kettles/" + id.String() + "/measurements"
}

// commandHash hashes what a kettle acts on: charge, fill and flush. The
// reason is prose that quotes the latest reading ("battery 57%", "level
// 812 mL"), so it changes with almost every reading; hashing it (as the
// HTTP ETag does) published a retained command after nearly every reading,
// as many publishes out as readings in. A change of reason alone is not a
// new command: the kettle gets the current reason with the next change, on
// subscribe, or by polling.
func commandHash(c kettle.Command) uint64 {
	var buf [64]byte
	h := fnv.New64a()
	h.Write(c.AppendActions(buf[:0]))
	return h.Sum64() | 1 // | 1: 0 means "nothing published yet"
}

// commandBody renders a command exactly as GET /v1/command does; next is
// when the time-driven part of the policy may change the answer by itself.
func commandBody(c kettle.Command, next time.Duration) []byte {
	body, _ := json.Marshal(wire.NewCommandJSON(c, next))
	return body
}

// commandJSON is a device's current command: its body, its commandHash and
// when the time-driven part of the policy may change it by itself.
func commandJSON(svc Commands, id kettle.DeviceID) (body []byte, hash uint64, next time.Duration) {
	c, next := svc.Command(id)
	return commandBody(c, next), commandHash(c), next
}

// pushTarget is what the pusher knows of one device: the hash of the
// command last published, when the policy may change by itself, and who
// subscribed (embedded mode: the connection; nil in external mode).
type pushTarget struct {
	hash  uint64
	due   time.Time
	owner any
}

// pusher publishes a device's command when it changes. OnChange marks ids
// dirty (never blocks the committing goroutine); one worker goroutine
// evaluates dirty ids at once and every target whose due time passed. Due
// times are kept in a min-heap, so a wake-up costs O(dirty + due · log n),
// not a scan of every subscribed kettle: the worker wakes after every
// commit, and a full scan there was quadratic in the fleet (17,000 kettles
// at ~500 commits/s per node: half the node's CPU in the 100,000-kettle run).
type pusher struct {
	svc     Commands
	log     *slog.Logger
	publish func(id kettle.DeviceID, body []byte) error
	pushed  *Counters
	// trackAll: external mode, where subscriptions are invisible; every
	// changed device becomes a target.
	trackAll bool

	mu      sync.Mutex
	targets map[kettle.DeviceID]*pushTarget
	dirty   map[kettle.DeviceID]struct{}
	// dues holds (due time, id) for targets, lazily: an entry whose time
	// is no longer its target's due (re-evaluated, untracked) is skipped
	// when popped; compacted when stale entries outnumber live ones.
	dues minheap.Heap[dueEntry]
	wake chan struct{}
	tick time.Duration
	done chan struct{}
}

func newPusher(svc Commands, log *slog.Logger, c *Counters, tick time.Duration, trackAll bool, publish func(kettle.DeviceID, []byte) error) *pusher {
	if tick <= 0 {
		tick = time.Second
	}
	p := &pusher{
		svc: svc, log: log, publish: publish, pushed: c, trackAll: trackAll,
		targets: make(map[kettle.DeviceID]*pushTarget),
		dirty:   make(map[kettle.DeviceID]struct{}),
		wake:    make(chan struct{}, 1),
		tick:    tick,
		done:    make(chan struct{}),
	}
	svc.OnChange(p.changed)
	return p
}

// changed is the fleet.ChangeFunc: it runs on the committing goroutine, so
// it only marks ids dirty. The dirty set is bounded by the tracked devices.
func (p *pusher) changed(ids []kettle.DeviceID) {
	n := 0
	p.mu.Lock()
	for _, id := range ids {
		if _, ok := p.targets[id]; ok || p.trackAll {
			p.dirty[id] = struct{}{}
			n++
		}
	}
	p.mu.Unlock()
	if n > 0 {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
}

// track registers a subscriber whose current command was just delivered
// (hash) or must be delivered (hash 0: mark it dirty).
func (p *pusher) track(id kettle.DeviceID, owner any, hash uint64, next time.Duration) {
	p.mu.Lock()
	tg := &pushTarget{hash: hash, due: p.svc.Now().Add(next), owner: owner}
	p.targets[id] = tg
	p.schedule(id, tg)
	if hash == 0 {
		p.dirty[id] = struct{}{}
	}
	p.mu.Unlock()
	if hash == 0 {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
}

// untrack forgets a subscriber, unless another connection of the same
// device took its place; it reports whether owner was the subscriber.
func (p *pusher) untrack(id kettle.DeviceID, owner any) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.targets[id]; ok && t.owner == owner {
		delete(p.targets, id)
		delete(p.dirty, id)
		return true
	}
	return false
}

// schedule records tg's due time in the heap. p.mu held.
func (p *pusher) schedule(id kettle.DeviceID, tg *pushTarget) {
	p.dues.Push(dueEntry{at: tg.due.UnixNano(), id: id})
	if n := len(p.dues); n > 2*len(p.targets)+1024 {
		// Mostly stale entries: rebuild from the live targets.
		p.dues = p.dues[:0]
		for id, tg := range p.targets {
			p.dues.Push(dueEntry{at: tg.due.UnixNano(), id: id})
		}
	}
}

// dueEntry is one scheduled re-evaluation.
type dueEntry struct {
	at int64 // unix ns
	id kettle.DeviceID
}

// When orders the scheduler's heap.
func (e dueEntry) When() int64 { return e.at }

// tracked is the number of devices whose command is being watched.
func (p *pusher) tracked() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.targets)
}

// run is the worker; it returns when ctx is cancelled.
func (p *pusher) run(ctx context.Context) {
	defer close(p.done)
	t := time.NewTicker(p.tick)
	defer t.Stop()
	var ids []kettle.DeviceID
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
		case <-t.C:
		}
		now := p.svc.Now()
		ids = ids[:0]
		p.mu.Lock()
		for id := range p.dirty {
			ids = append(ids, id)
		}
		clear(p.dirty)
		for nowNs := now.UnixNano(); len(p.dues) > 0 && p.dues[0].at <= nowNs; {
			e := p.dues.Pop()
			if tg, ok := p.targets[e.id]; ok && tg.due.UnixNano() == e.at {
				ids = append(ids, e.id) // may repeat a dirty id: harmless, the hash decides
			}
		}
		p.mu.Unlock()
		for _, id := range ids {
			if ctx.Err() != nil {
				return
			}
			p.evaluate(id)
		}
	}
}

// evaluate publishes id's command if it differs from the one last published.
// The body is rendered only then: most evaluations (one per committed
// reading) find the command unchanged.
func (p *pusher) evaluate(id kettle.DeviceID) {
	c, next := p.svc.Command(id)
	h := commandHash(c)
	due := p.svc.Now().Add(next)
	p.mu.Lock()
	tg, ok := p.targets[id]
	if !ok {
		if !p.trackAll {
			p.mu.Unlock()
			return
		}
		tg = &pushTarget{}
		p.targets[id] = tg
	}
	tg.due = due
	p.schedule(id, tg)
	if tg.hash == h {
		p.mu.Unlock()
		return
	}
	old := tg.hash
	tg.hash = h
	p.mu.Unlock()
	if err := p.publish(id, commandBody(c, next)); err != nil {
		p.log.Warn("mqtt: command publish failed; retried when due", "device", id, "err", err)
		p.mu.Lock()
		if tg2, ok := p.targets[id]; ok && tg2 == tg && tg.hash == h {
			tg.hash = old
			tg.due = p.svc.Now().Add(p.tick)
			p.schedule(id, tg)
		}
		p.mu.Unlock()
		return
	}
	p.pushed.CommandsPushed.Add(1)
}
