package server_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestMQTTWiring: kettle serve with --mqtt-addr takes a QoS 1 reading from a
// real MQTT client, acknowledges it after the commit (the HTTP API sees it
// at once), and shuts down cleanly.
func TestMQTTWiring(t *testing.T) {
	srv := start(t, "sqlite:"+t.TempDir()+"/k.db", func(c *server.Config) { c.MQTT.Addr = "127.0.0.1:0" })
	id := uuid.New()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl := mqttDevice(ctx, t, srv, id)
	ts := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + id.String() + "/measurements", QoS: 1, Payload: []byte(v1Body(ts, 5, 10, 1, 20, 70, 500))})
	if err != nil || pr.ReasonCode != 0 {
		t.Fatalf("publish: %v %+v", err, pr)
	}
	c := newClient(t, srv)
	var d httpapi.DeviceJSON
	c.do("GET", "/v1/devices/"+id.String(), bearer(srv.OperatorToken()), "").json(t, &d)
	if d.Measurements != 1 || d.Latest == nil || !d.Latest.Time.Equal(ts) {
		t.Errorf("after PUBACK the store holds %+v", d)
	}
	m := c.do("GET", "/metrics", nil, "")
	for _, want := range []string{`kettle_mqtt_publishes_total{qos="1"} 1`, `kettle_mqtt_readings_total 1`, `kettle_mqtt_connections 1`, `kettle_mqtt_connections_max `, `kettle_mqtt_connects_shed_total{reason="quota_exceeded"} 0`} {
		if !strings.Contains(string(m.body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// mqttDevice connects device id to srv's MQTT listener (mqttDeviceOn) and
// disconnects it at the end of the test.
func mqttDevice(ctx context.Context, t *testing.T, srv *server.Server, id uuid.UUID) *paho.Client {
	t.Helper()
	conn, err := net.Dial("tcp", srv.MQTTAddr())
	if err != nil {
		t.Fatal(err)
	}
	cl, err := mqttDeviceOn(ctx, srv, conn, id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Disconnect(&paho.Disconnect{}) })
	return cl
}

// mqttDeviceOn sends device id's CONNECT (its token as the password) on conn
// and waits for a successful CONNACK. The conn is wrapped in paho's
// ThreadSafeConn: paho writes a packet in several Writes, and its pinger
// sends a PINGREQ right after the CONNACK from a goroutine of its own, so
// over TLS (whose Conn is no sync.Locker and writes each piece as a record)
// that PINGREQ could land inside the test's first PUBLISH, which the server
// then rightly refuses (0x99 "body is not valid UTF-8", or a malformed packet).
func mqttDeviceOn(ctx context.Context, srv *server.Server, conn net.Conn, id uuid.UUID) (*paho.Client, error) {
	cl := paho.NewClient(paho.ClientConfig{Conn: packets.NewThreadSafeConn(conn), ClientID: id.String()})
	ca, err := cl.Connect(ctx, &paho.Connect{
		ClientID: id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: id.String(),
		PasswordFlag: true, Password: []byte(kettle.DeviceToken(srv.Secret(), id)),
	})
	if err == nil && ca.ReasonCode != 0 {
		err = fmt.Errorf("CONNACK reason %#x", ca.ReasonCode)
	}
	if err != nil {
		return nil, fmt.Errorf("MQTT connect: %w", err)
	}
	return cl, nil
}

// TestStartFailureUndoes: when Start fails late (the HTTP address is taken),
// what it had started is stopped again: the MQTT listener's port is free
// and the store can be opened by the next Start.
func TestStartFailureUndoes(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mqttAddr := free.Addr().String()
	free.Close()
	dir := t.TempDir()
	cfg := server.Config{Addr: taken.Addr().String(), DB: "sqlite:" + dir + "/k.db", DataDir: dir, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	cfg.MQTT.Addr = mqttAddr
	if _, err := server.Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "listen on") {
		t.Fatalf("Start on a taken address: %v, want a listen error", err)
	}
	l, err := net.Listen("tcp", mqttAddr)
	if err != nil {
		t.Fatalf("the failed Start left its MQTT listener open: %v", err)
	}
	l.Close()
	cfg.Addr = "127.0.0.1:0"
	srv, err := server.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Start after a failed one: %v", err)
	}
	srv.Close()
}
