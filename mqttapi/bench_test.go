package mqttapi_test

import (
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// BenchmarkQoS1 publishes single readings at QoS 1 from many connections
// (one message in flight each, as a kettle does) into the real SQLite file
// and counts acknowledged messages per second: every PUBACK follows the
// commit that holds its reading. -cpu sets nothing here; -benchtime the
// number of messages. Connections: GOMAXPROCS × MQTT_BENCH_PAR (default 16).
func BenchmarkQoS1(b *testing.B) {
	e := start(b, fleet.Config{})
	var seq atomic.Int64
	base := time.Now().Add(-24 * time.Hour)
	b.SetParallelism(parallelism)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		r, id := kettleConn(b, e.broker.Addr(), 4, uuid.Nil)
		topic := mqttapi.MeasurementTopic(id)
		pid := uint16(0)
		for pb.Next() {
			pid++
			if pid == 0 {
				pid = 1
			}
			n := seq.Add(1)
			r.publish(topic, 1, pid, false, reading(base.Add(time.Duration(n)*time.Millisecond), 500))
			if ack := r.must(packets.Puback); ack.ReasonCode != 0 {
				b.Fatalf("PUBACK 0x%02x", ack.ReasonCode)
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	stored, dups := e.svc.Counters()
	if stored+dups != int64(b.N) {
		b.Errorf("stored %d + dups %d, want %d", stored, dups, b.N)
	}
}

var parallelism = func() int {
	if n, err := strconv.Atoi(os.Getenv("MQTT_BENCH_PAR")); err == nil && n > 0 {
		return n
	}
	return 16
}()
