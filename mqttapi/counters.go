package mqttapi

import (
	"log/slog"
	"sync/atomic"
)

// Counters are the MQTT adapter's counts since start, for the metrics
// package to read (Snapshot) and export. All fields are safe for concurrent
// use; labels stay bounded (QoS 0..2, never a device id).
type Counters struct {
	Connections     atomic.Int64    // open device connections now (gauge); external mode: 1 while connected to the broker
	ConnectsRefused atomic.Int64    // CONNECTs refused (bad credentials, wrong client id)
	Publishes       [3]atomic.Int64 // measurement PUBLISHes received, by QoS
	Readings        atomic.Int64    // readings committed (stored or duplicate) from MQTT
	Invalid         atomic.Int64    // payloads refused by validation (0x99 on v5, dropped on 3.1.1)
	ACLDenied       atomic.Int64    // publishes or subscriptions outside the device's own topics
	Withheld        atomic.Int64    // QoS ≥ 1 messages whose PUBACK was held back because ingest was unavailable (queue full, store down); once per message
	Dropped         atomic.Int64    // QoS 0 messages dropped because ingest was unavailable
	Unacked         atomic.Int64    // QoS ≥ 1 messages given up without PUBACK (client gone or shutdown); the client redelivers
	CommandsPushed  atomic.Int64    // command messages published (on subscribe and on change)
	// CommandsDropped counts command pushes whose write failed (the
	// kettle stopped reading past the write timeout, or its connection
	// ended); the kettle gets the current command when it subscribes again.
	CommandsDropped atomic.Int64
	// Malformed counts connections closed because a packet crashed the
	// packet codec's decoder (contained: the process survives).
	Malformed atomic.Int64
	// Shed counts CONNECTs refused for capacity, by the reason an MQTT 5
	// kettle is told (ShedReason; 3.1.1 kettles get 0x03 for each).
	Shed [shedReasons]atomic.Int64
	// MaxConns is the connection cap (gauge), beside Connections.
	MaxConns atomic.Int64
}

// ShedReason is why a CONNECT was refused for capacity.
type ShedReason int

// The capacity refusals, each with its MQTT 5 CONNACK reason code.
const (
	ShedQuota    ShedReason = iota // over the connection cap: 0x97 quota exceeded
	ShedBusy                       // the node is shedding load: 0x89 server busy
	ShedRedirect                   // either, with a server reference configured: 0x9C use another server
	shedReasons
)

// ShedReasonNames are the metric labels of the ShedReasons, in order.
var ShedReasonNames = [shedReasons]string{"quota_exceeded", "server_busy", "use_another_server"}

// Stats is a plain copy of Counters.
type Stats struct {
	Connections, ConnectsRefused int64
	Publishes                    [3]int64
	Readings, Invalid, ACLDenied int64
	Withheld, Dropped, Unacked   int64
	CommandsPushed               int64
	CommandsDropped              int64
	Malformed                    int64
	Shed                         [shedReasons]int64
	MaxConns                     int64
}

// Snapshot copies the counters.
func (c *Counters) Snapshot() Stats {
	s := Stats{
		Connections:     c.Connections.Load(),
		ConnectsRefused: c.ConnectsRefused.Load(),
		Readings:        c.Readings.Load(),
		Invalid:         c.Invalid.Load(),
		ACLDenied:       c.ACLDenied.Load(),
		Withheld:        c.Withheld.Load(),
		Dropped:         c.Dropped.Load(),
		Unacked:         c.Unacked.Load(),
		CommandsPushed:  c.CommandsPushed.Load(),
		CommandsDropped: c.CommandsDropped.Load(),
		Malformed:       c.Malformed.Load(),
	}
	for i := range s.Publishes {
		s.Publishes[i] = c.Publishes[i].Load()
	}
	for i := range s.Shed {
		s.Shed[i] = c.Shed[i].Load()
	}
	s.MaxConns = c.MaxConns.Load()
	return s
}

// LogValue makes a Stats loggable as one group.
func (s Stats) LogValue() slog.Value {
	return slog.GroupValue(
		slog.Int64("connections", s.Connections),
		slog.Int64("connects_refused", s.ConnectsRefused),
		slog.Int64("publishes_qos0", s.Publishes[0]),
		slog.Int64("publishes_qos1", s.Publishes[1]),
		slog.Int64("publishes_qos2", s.Publishes[2]),
		slog.Int64("readings", s.Readings),
		slog.Int64("invalid", s.Invalid),
		slog.Int64("acl_denied", s.ACLDenied),
		slog.Int64("withheld", s.Withheld),
		slog.Int64("dropped", s.Dropped),
		slog.Int64("unacked", s.Unacked),
		slog.Int64("commands_pushed", s.CommandsPushed),
		slog.Int64("commands_dropped", s.CommandsDropped),
		slog.Int64("malformed", s.Malformed),
		slog.Int64("shed_quota_exceeded", s.Shed[ShedQuota]),
		slog.Int64("shed_server_busy", s.Shed[ShedBusy]),
		slog.Int64("shed_use_another_server", s.Shed[ShedRedirect]),
	)
}
