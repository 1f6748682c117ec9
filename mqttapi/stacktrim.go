package mqttapi

import (
	"context"
	"runtime"
	"time"
)

// Why a node forces garbage collections (Config.StackTrim): mochi v2.7.9
// handles each packet on the connection's read goroutine through a chain of
// calls that pass its ~800-byte Packet by value, so handling one PUBLISH
// grows that goroutine's stack from 2 KiB to 16–32 KiB, and it keeps that
// size until a garbage collection finds it mostly unused and halves it (one
// halving per collection). A kettle sends a packet every 30 s, and a node
// whose heap barely grows collects rarely: most connections then sit on a
// stack sized for their last packet, which was most of a node's memory per
// connection (kettle_mqtt_connections beside go_memstats_stack_inuse_bytes).
// A collection every few seconds brings an idle connection back to 2 KiB
// within a few seconds of its packet, and keeps the heap near its live size;
// its price is the CPU of marking the heap and scanning every goroutine's
// stack that often (bench/mqtt-memory.sh measures both sides).
func (b *Broker) trimStacks(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if b.counters.Connections.Load() > 0 {
				runtime.GC()
			}
		}
	}
}
