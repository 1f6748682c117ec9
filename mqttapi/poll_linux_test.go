//go:build linux

package mqttapi_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestPollerFailureHandsConnectionsBack: when the poller can no longer wait
// on its epoll set, every connection it held — a quiet one, and one whose
// packet is being handled (waiting for its window) — gets a reading
// goroutine of its own: their readings are still read, stored and
// acknowledged, and new kettles still connect.
func TestPollerFailureHandsConnectionsBack(t *testing.T) {
	e := startWith(t, fleet.Config{}, mqttapi.Config{ConnWindow: 1}, testLog(t))
	addr := e.broker.Addr()
	t0 := time.Now().Add(-time.Hour).Truncate(time.Second)
	quiet, quietID := kettleConn(t, addr, 5, uuid.Nil)
	quiet.publish(mqttapi.MeasurementTopic(quietID), 1, 1, false, reading(t0, 100))
	quiet.must(packets.Puback)

	// busy's first reading waits for a commit, its second for the window
	// of one: the turn reading busy waits in its handler.
	busy, busyID := kettleConn(t, addr, 4, uuid.Nil)
	unlock := lockStore(t, e)
	busy.publish(mqttapi.MeasurementTopic(busyID), 1, 1, false, reading(t0, 100))
	busy.publish(mqttapi.MeasurementTopic(busyID), 1, 2, false, reading(t0.Add(time.Second), 101))
	time.Sleep(300 * time.Millisecond) // both read: the second waits in acquire

	if !mqttapi.BreakPoller(e.broker) {
		t.Fatal("the listener runs no poller on Linux")
	}
	time.Sleep(100 * time.Millisecond)
	unlock()
	for pid := uint16(1); pid <= 2; pid++ {
		if got := busy.must(packets.Puback).PacketID; got != pid {
			t.Fatalf("busy: PUBACK %d, want %d", got, pid)
		}
	}
	quiet.publish(mqttapi.MeasurementTopic(quietID), 1, 2, false, reading(t0.Add(time.Second), 99))
	quiet.must(packets.Puback)
	busy.publish(mqttapi.MeasurementTopic(busyID), 1, 3, false, reading(t0.Add(2*time.Second), 102))
	busy.must(packets.Puback)
	late, lateID := kettleConn(t, addr, 5, uuid.Nil)
	late.publish(mqttapi.MeasurementTopic(lateID), 1, 1, false, reading(t0, 50))
	late.must(packets.Puback)

	f := func(id uuid.UUID, want int) {
		t.Helper()
		if got := len(e.history(t, id)); got != want {
			t.Errorf("device %s: %d readings stored, want %d", id, got, want)
		}
	}
	f(quietID, 2)
	f(busyID, 3)
	f(lateID, 1)
}
