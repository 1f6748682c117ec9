package mqttapi_test

import (
	"net"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// FuzzMQTTPayload: any payload published QoS 1 to a kettle's own topic, over
// MQTT 5 or 3.1.1, through the real embedded listener, gets a PUBACK (0x00
// or, on MQTT 5, 0x99 payload format invalid), and the connection goes on
// working: a valid reading right after is acknowledged 0x00.
func FuzzMQTTPayload(f *testing.F) {
	e := start(f, fleet.Config{})
	now := time.Now()
	for _, s := range []string{
		string(reading(now.Add(-time.Minute), 500)),
		"[" + string(reading(now.Add(-2*time.Minute), 1)) + "," + string(reading(now.Add(-3*time.Minute), 2)) + "]",
		`{}`, `[]`, `null`, `not json`, "\xff\xfe", `{"time":"2026-01-01T00:00:00Z","water_level_ml":NaN}`,
		`{"time":"9999-12-31T23:59:59Z","battery_charge_mwh":1e400}`, `[[[[[[[[[[[[]]]]]]]]]]]]`,
		`{"time":"'; DROP TABLE measurements; --"}`,
	} {
		f.Add(true, []byte(s))
		f.Add(false, []byte(s))
	}
	f.Fuzz(func(t *testing.T, v5 bool, payload []byte) {
		version := byte(4)
		if v5 {
			version = 5
		}
		r, id := kettleConn(t, e.broker.Addr(), version, uuid.Nil)
		r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, payload)
		ack := r.must(packets.Puback)
		switch {
		case ack.ReasonCode == 0:
		case v5 && ack.ReasonCode == packets.ErrPayloadFormatInvalid.Code:
			if ack.Properties.ReasonString == "" {
				t.Fatalf("PUBACK 0x99 without a reason string for %q", payload)
			}
		default:
			t.Fatalf("v%d payload %q: PUBACK 0x%02x", version, payload, ack.ReasonCode)
		}
		r.publish(mqttapi.MeasurementTopic(id), 1, 2, false, reading(time.Now().Add(-time.Hour), 5))
		if ack := r.must(packets.Puback); ack.ReasonCode != 0 {
			t.Fatalf("after payload %q the connection no longer works: PUBACK 0x%02x", payload, ack.ReasonCode)
		}
	})
}

// FuzzMQTTPacket: raw bytes on a connection — as its first packet, or after
// a valid CONNECT — never take the listener down: afterwards a kettle still
// connects and its reading is acknowledged.
func FuzzMQTTPacket(f *testing.F) {
	e := start(f, fleet.Config{})
	for _, s := range [][]byte{
		{0x30, 0x02, 0x00, 0x00},                  // PUBLISH with an empty topic
		{0x32, 0xff, 0xff, 0xff, 0x7f},            // PUBLISH claiming 256 MB
		{0x82, 0x05, 0x00, 0x01, 0x00, 0x01, '#'}, // SUBSCRIBE '#' without options
		{0x10, 0x00},             // an empty CONNECT
		{0xe0, 0x00},             // DISCONNECT
		{0x00, 0x00},             // reserved type
		{0x62, 0x02, 0x00, 0x00}, // PUBREL for packet id 0
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), // another protocol
	} {
		f.Add(true, s)
		f.Add(false, s)
	}
	f.Fuzz(func(t *testing.T, afterConnect bool, data []byte) {
		var c net.Conn
		if afterConnect {
			r, _ := kettleConn(t, e.broker.Addr(), 5, uuid.Nil)
			c = r.conn
		} else {
			var err error
			if c, err = net.Dial("tcp", e.broker.Addr()); err != nil {
				t.Fatal(err)
			}
			defer c.Close()
		}
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(data) // the server may have closed it already: fine
		c.Close()
		r, id := kettleConn(t, e.broker.Addr(), 4, uuid.Nil)
		r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, reading(time.Now().Add(-time.Hour), 5))
		if ack := r.must(packets.Puback); ack.ReasonCode != 0 {
			t.Fatalf("after %q a kettle's reading got PUBACK 0x%02x", data, ack.ReasonCode)
		}
	})
}
