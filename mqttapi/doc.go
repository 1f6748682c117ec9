// Package mqttapi is kettlefleet's MQTT adapter, in two modes.
//
// Embedded (Start): kettle serve listens for kettles itself, MQTT 3.1.1 and 5.
// A kettle connects with username = its device id and password = its device
// token; its client id must be empty or its device id (one session per
// kettle, so one kettle can never take over another's session). It may
// publish only to kettles/{id}/measurements and subscribe only to
// kettles/{id}/command. A measurement payload is the v1 JSON body (one
// reading or an array of up to kettle.MaxBatch), decoded by wire.DecodeV1
// and handed to fleet.Service.Ingest. A QoS 1 PUBACK is written only after
// Ingest returned, i.e. after the commit, in the order the PUBLISHes came
// (ack.go): a connection is read on while up to Config.ConnWindow of its
// messages wait for their commit (at most Config.MaxPendingRows readings over all
// connections), and past that it is not read at all. Memory is therefore
// bounded by one packet per connection (Config.MaxPacketBytes) plus
// MaxPendingRows decoded readings (and the user properties of the messages
// awaiting their PUBACK, copied out of their packets, which are not kept),
// and a full queue is backpressure, not a buffer. QoS 0 is ingested on the read goroutine. Invalid payloads are answered PUBACK 0x99
// (payload format invalid) with a reason string naming the field on MQTT 5;
// on 3.1.1, which has no error PUBACK, they are dropped, counted and logged,
// and acknowledged so that the client does not redeliver a message that can
// never be stored. The connection survives either way.
//
// Commands: when a kettle subscribes to its command topic it receives the
// current command (the body of GET /v1/command) as a retained message, and
// again whenever the policy's answer changes: after a committed reading or an
// override (fleet.Service.OnChange, handed to one worker through a coalescing
// set of dirty ids) and when the time-driven part of the policy is due (tea
// windows, override expiry: kettle.NextChange, re-checked at least every
// fleet PollInterval). A push happens only when charge, fill or flush
// changed: what the kettle acts on. Not the reason, whose prose quotes the
// latest reading and so changes with nearly every one (hashing it, as the
// HTTP ETag does, pushed a command after almost every reading), nor
// poll_after_s. An override that leaves all three as they were is
// therefore not pushed either. Only subscribed devices are tracked (device
// id → hash, next due time, connection).
//
// Commands go out at QoS 0, whatever QoS the kettle subscribed with: a
// command is state, not an event — only the latest matters, and it is
// delivered again on every subscribe and session resume, so a push lost
// with its connection costs nothing a QoS 1 retry would have saved (clean
// sessions drop their in-flight messages anyway). So no message of ours is
// ever in flight to a kettle: no inflight map, no retry queue, and nothing
// a push must wait for (in a general broker, a QoS 1 push took the
// subscriber's lock across its socket write and its inflight map's: the
// 18,000-kettle run's stall, TestPushWhileKettleAcksSlowly).
// Measurements are capped at QoS 1 (Maximum QoS 1 in CONNACK).
//
// Every write to a kettle has its own deadline (Config.WriteTimeout); a
// kettle that does not take a packet off its socket for that long is
// disconnected. When a kettle reconnects, its old connection gets at most
// one second to take its DISCONNECT, so a stuck old connection does not
// hold back the new CONNACK.
//
// External broker (Consume): kettle serve consumes measurements from an
// existing broker through the MQTT 5 shared subscription
// $share/{group}/kettles/+/measurements with manual acknowledgement, so
// several kettle nodes split the stream, and a message is acknowledged to the
// broker only after its commit. The device id is taken from the topic: in
// this mode the broker authenticates devices and enforces the topic ACL (e.g.
// Mosquitto's dynamic-security or a password file plus a pattern ACL
// "pattern write kettles/%u/measurements", "pattern read kettles/%u/command").
// Commands are published retained through the broker by the node that saw the
// change.
//
// # The listener
//
// The embedded listener (device.go, device_conn.go, poll_linux.go) serves
// kettles and nothing else, on mochi-mqtt's packets codec (decode,
// validate, encode: no packet parsing of our own) with this package's
// logic: Broker.authenticate, the ACL, ack.go's ordered PUBACKs after the
// commit, commands.go's pusher. On Linux over plain TCP a quiet kettle
// costs no goroutine: its connection waits in one epoll set, and bytes
// arriving give it a turn on a pooled goroutine (poll_linux.go); elsewhere
// and over TLS it has one goroutine, waiting in a read through frames
// small enough for Go's 2 KiB minimum stack. Either way each packet is
// decoded and handled on a goroutine that ends with it, so the stack that
// handling grows is not kept by an idle connection. No writer goroutine:
// a packet is written whole, in one Write (the socket serialises them)
// under its own deadline, by whoever has it — the reader (CONNACK, SUBACK
// and the command, PINGRESP), the commit (PUBACKs), a short-lived
// goroutine per command push. A session is a devConn (a few hundred bytes
// with its socket); a persistent one outlives its connection as a device
// id, an expiry and whether it had subscribed. bench/mqtt-memory.sh puts
// it beside a bare Mosquitto; the tests drive it over real TCP with real
// MQTT clients.
//
// Over Config.MaxConns the listener still reads the CONNECT and answers
// with a reason (0x97 quota exceeded, 0x9C use another server with
// Config.ServerReference; 3.1.1: 0x03), as devConn.connect does while the node
// sheds load (0x89): a kettle told why backs off, one whose connection is
// just closed retries at once. At most maxRefusing refusals run at once;
// past that the listener stops accepting and the kernel's queue holds the
// rest.
package mqttapi
