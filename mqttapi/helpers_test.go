package mqttapi_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var secret = []byte("test-secret")

// env is one kettle serve's MQTT side on a real SQLite file.
type env struct {
	path   string
	store  *sqlite.Store
	svc    *fleet.Service
	broker *mqttapi.Broker
}

func testLog(t testing.TB) *slog.Logger {
	if os.Getenv("MQTT_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func start(t testing.TB, fc fleet.Config) *env {
	t.Helper()
	return startLog(t, fc, testLog(t))
}

// startLog is start with the log written to log.
func startLog(t testing.TB, fc fleet.Config, log *slog.Logger) *env {
	t.Helper()
	return startWith(t, fc, mqttapi.Config{}, log)
}

// startWith is startLog with the listener configured by mc (Addr and
// CommandTick are set here).
func startWith(t testing.TB, fc fleet.Config, mc mqttapi.Config, log *slog.Logger) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{path: t.TempDir() + "/k.db"}
	var err error
	e.store, err = sqlite.Open(ctx, e.path)
	if err != nil {
		t.Fatal(err)
	}
	e.svc, err = fleet.New(ctx, e.store, fc, log, nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	mc.Addr, mc.CommandTick = "127.0.0.1:0", 100*time.Millisecond
	e.broker, err = mqttapi.Start(ctx, mc, e.svc, secret, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.broker.Close()
		e.svc.Close()
		e.store.Close()
	})
	return e
}

func (e *env) history(t testing.TB, id kettle.DeviceID) []kettle.Measurement {
	t.Helper()
	ms, err := e.store.History(context.Background(), kettle.HistoryQuery{Device: id, Limit: 10000})
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// reading is a valid v1 payload at device time at.
func reading(at time.Time, level float64) []byte {
	return fmt.Appendf(nil, `{"time":%q,"battery_charge_mwh":500,"battery_full_mwh":1000,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":60,"water_level_ml":%g}`,
		at.UTC().Format(time.RFC3339Nano), level)
}

// raw is an MQTT client built from mochi's packet codec, so that tests
// control every byte (DUP flags, packet ids, protocol 3.1.1 and 5) and see
// every packet the server sends.
type raw struct {
	t       testing.TB
	mu      sync.Mutex // send may be called from two goroutines
	conn    net.Conn
	br      *bufio.Reader
	version byte
	recvMax uint16 // MQTT 5 Receive Maximum sent in CONNECT (0: none)
	will    string // a retained Will message on this topic in CONNECT ("": none)
}

func dial(t testing.TB, addr string, version byte) *raw {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &raw{t: t, conn: conn, br: bufio.NewReader(conn), version: version}
}

func (r *raw) send(pk packets.Packet) {
	r.t.Helper()
	pk.ProtocolVersion = r.version
	var buf bytes.Buffer
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connect:
		err = pk.ConnectEncode(&buf)
	case packets.Publish:
		err = pk.PublishEncode(&buf)
	case packets.Subscribe:
		err = pk.SubscribeEncode(&buf)
	case packets.Puback:
		err = pk.PubackEncode(&buf)
	case packets.Disconnect:
		err = pk.DisconnectEncode(&buf)
	case packets.Pingreq:
		err = pk.PingreqEncode(&buf)
	}
	if err != nil {
		r.t.Fatal(err)
	}
	r.mu.Lock()
	_, err = r.conn.Write(buf.Bytes())
	r.mu.Unlock()
	if err != nil {
		r.t.Error(err) // Error, not Fatal: send may run outside the test goroutine
	}
}

// read returns the next packet, or an error (timeout, closed connection).
func (r *raw) read(timeout time.Duration) (packets.Packet, error) {
	r.conn.SetReadDeadline(time.Now().Add(timeout))
	var fh packets.FixedHeader
	b, err := r.br.ReadByte()
	if err != nil {
		return packets.Packet{}, err
	}
	if err := fh.Decode(b); err != nil {
		return packets.Packet{}, err
	}
	n, _, err := packets.DecodeLength(r.br)
	if err != nil {
		return packets.Packet{}, err
	}
	fh.Remaining = n
	buf := make([]byte, n)
	if _, err := io.ReadFull(r.br, buf); err != nil {
		return packets.Packet{}, err
	}
	pk := packets.Packet{FixedHeader: fh, ProtocolVersion: r.version}
	switch fh.Type {
	case packets.Connack:
		err = pk.ConnackDecode(buf)
	case packets.Puback:
		err = pk.PubackDecode(buf)
	case packets.Suback:
		err = pk.SubackDecode(buf)
	case packets.Publish:
		err = pk.PublishDecode(buf)
	case packets.Disconnect:
		err = pk.DisconnectDecode(buf)
	}
	return pk, err
}

func (r *raw) must(typ byte) packets.Packet {
	r.t.Helper()
	pk, err := r.read(10 * time.Second)
	if err != nil {
		r.t.Fatalf("waiting for packet type %d: %v", typ, err)
	}
	if pk.FixedHeader.Type != typ {
		r.t.Fatalf("got packet type %d (%+v), want %d", pk.FixedHeader.Type, pk, typ)
	}
	return pk
}

// connect sends CONNECT and returns the CONNACK code.
func (r *raw) connect(user, pass, clientID string) byte {
	r.t.Helper()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}}
	pk.Connect = packets.ConnectParams{
		ProtocolName:     []byte("MQTT"),
		Clean:            true,
		Keepalive:        30,
		ClientIdentifier: clientID,
		UsernameFlag:     user != "",
		Username:         []byte(user),
		PasswordFlag:     pass != "",
		Password:         []byte(pass),
	}
	if r.version == 4 {
		pk.Connect.ProtocolName = []byte("MQTT")
	}
	if r.version == 5 && r.recvMax > 0 {
		pk.Properties.ReceiveMaximum = r.recvMax
	}
	if r.will != "" {
		pk.Connect.WillFlag, pk.Connect.WillTopic, pk.Connect.WillRetain = true, r.will, true
		pk.Connect.WillPayload = []byte(`{"charge":"ChargeBattery","fill":"FillReservoir","flush":{"tag":"FlushReservoir","contents":100}}`)
	}
	r.send(pk)
	return r.must(packets.Connack).ReasonCode
}

// kettle connects as device id (a fresh one if Nil) and fails on refusal.
func kettleConn(t testing.TB, addr string, version byte, id kettle.DeviceID) (*raw, kettle.DeviceID) {
	t.Helper()
	if id == uuid.Nil {
		id = uuid.New()
	}
	r := dial(t, addr, version)
	if code := r.connect(id.String(), kettle.DeviceToken(secret, id), id.String()); code != 0 {
		t.Fatalf("connect refused: 0x%02x", code)
	}
	return r, id
}

func (r *raw) publish(topic string, qos byte, pid uint16, dup bool, payload []byte) {
	r.t.Helper()
	r.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos, Dup: dup},
		TopicName:   topic,
		PacketID:    pid,
		Payload:     payload,
	})
}

func (r *raw) subscribe(pid uint16, filter string) packets.Packet {
	r.t.Helper()
	r.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1},
		PacketID:    pid,
		Filters:     packets.Subscriptions{{Filter: filter, Qos: 1}},
	})
	return r.must(packets.Suback)
}

// command reads the next command publish, acknowledging it.
func (r *raw) command(timeout time.Duration) (map[string]any, packets.Packet, error) {
	for {
		pk, err := r.read(timeout)
		if err != nil {
			return nil, pk, err
		}
		if pk.FixedHeader.Type != packets.Publish {
			continue
		}
		if pk.FixedHeader.Qos > 0 {
			r.send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
		var m map[string]any
		if err := json.Unmarshal(pk.Payload, &m); err != nil {
			return nil, pk, fmt.Errorf("command payload %q: %v", pk.Payload, err)
		}
		return m, pk, nil
	}
}
