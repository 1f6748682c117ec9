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
// sessions drop their in-flight messages anyway). QoS 0 also keeps the push
// worker away from everything that can block in mochi v2.7.9: a QoS 1
// publish takes the subscriber's client lock (NextPacketID), which mochi
// holds across the socket write, so one kettle that stopped reading stalled
// every push; and it adds to the client's inflight map, whose
// NextImmediate read-locks it twice (on the client's read goroutine, after
// every packet while a message is unacknowledged): a push arriving between
// the two deadlocks that map for good — the push worker, mochi's expiry
// loop and any takeover of that session (ClearInflights: no CONNACK) wait
// forever. That was the 18,000-kettle run's stall. Measurements are capped
// at QoS 1 (Maximum QoS 1 in CONNACK) so that no message ever stays in an
// inflight map. A push that does not fit the kettle's write queue
// (OnPublishDropped) is published again at the next command tick.
//
// Every write to a kettle has its own deadline (Config.WriteTimeout; mochi
// sets only the keepalive's, shared with reads); a kettle that does not
// take a packet off its socket for that long is disconnected. When a kettle
// reconnects, its old connection gets at most one second to take mochi's
// DISCONNECT, so a stuck old connection does not hold back the new CONNACK.
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
// # Engines
//
// The embedded listener has two engines (Config.Engine). The default,
// EngineDevice (device.go, device_conn.go), serves kettles and nothing
// else on mochi's packets codec (decode, validate, encode: no packet
// parsing of our own) with this package's logic: hook.authenticate, the
// ACL, ack.go's ordered PUBACKs after the commit, commands.go's pusher.
// It has one goroutine per connection, waiting in a read through frames
// small enough for Go's 2 KiB minimum stack; each packet is decoded and
// handled on a goroutine that ends with it, so the stack that handling
// grows is not kept by an idle connection. No writer goroutine: a packet
// is written whole, in one Write (the socket serialises them) under its
// own deadline, by whoever has it — the reader (CONNACK, SUBACK and the
// command, PINGRESP), the commit (PUBACKs), a short-lived goroutine per
// command push. A session is a devConn (a few hundred bytes with its
// socket); a persistent one outlives its connection as a device id, an
// expiry and whether it had subscribed. No inflight maps: commands go out
// at QoS 0 and QoS 1 in is answered by the acker.
//
// EngineMochi is github.com/mochi-mqtt/server/v2 (v2.7.9, MIT) with this
// package's hooks: OnConnect (our own CONNACK codes), OnACLCheck,
// OnPublish (runs on the connection's read goroutine, so blocking in it is
// per-connection backpressure and its return decides the PUBACK). It was
// the only engine first, for what it gives tested: both protocol
// versions, keepalive, session takeover, QoS 1 flows, retained delivery
// after SUBACK. Its price: no release since 2025-03, a configuration tuned
// for a general broker (Start shrinks per-client queues and limits), locks
// held across socket writes and a deadlock in its outbound QoS 1
// bookkeeping (see Commands; we avoid both), a once-a-second scan of all
// clients (housekeeping.go slows it), a TCP listener that stops for good on
// the first Accept error (listener.go replaces it), and two goroutines per
// connection whose reader's stack grows to 16–32 KiB with each packet (mochi
// passes its ~800-byte Packet by value down the call chain) and cannot
// shrink below 16 KiB while idle (its waiting frames, attachClient and
// Client.Read, hold about 4.5 KiB of locals, and Go halves a stack only
// while under a quarter of it is in use). Config.StackTrim forces
// collections to get stacks back to that floor, for CPU. That floor is why
// the device engine exists: bench/mqtt-memory.sh puts both engines and a
// bare Mosquitto side by side. The tests drive both over real TCP with
// real MQTT clients (TestMochiEngine).
//
// Over Config.MaxConns the listener still reads the CONNECT and answers
// with a reason (0x97 quota exceeded, 0x9C use another server with
// Config.ServerReference; 3.1.1: 0x03), as OnConnect does while the node
// sheds load (0x89): a kettle told why backs off, one whose connection is
// just closed retries at once. At most maxRefusing refusals run at once;
// past that the listener stops accepting and the kernel's queue holds the
// rest.
package mqttapi
