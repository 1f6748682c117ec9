package sim

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestSwarmMQTTAgainstServer: a short MQTT swarm against the real server
// (embedded store, MQTT listener on): every kettle connects, receives its
// retained command by subscription, publishes QoS 1 on schedule, and the
// audit over the HTTP operator API finds every PUBACKed reading stored once.
func TestSwarmMQTTAgainstServer(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	srv, err := server.Start(ctx, server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + dir + "/k.db", DataDir: dir,
		MQTT:   mqttapi.Config{Addr: "127.0.0.1:0"},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })

	f := func(devices, inflight, batch int) {
		t.Helper()
		res, err := Run(ctx, Config{
			Target: srv.URL(), Protocol: ProtocolMQTT, MQTTTarget: srv.MQTTAddr(), MQTTInflight: inflight,
			Devices: devices, Interval: time.Second, Jitter: 100 * time.Millisecond, Duration: 5 * time.Second,
			Batch: batch, Secret: srv.Secret(), Operator: srv.OperatorToken(), Seed: 7,
			ReserveFDs: 1000, Progress: io.Discard, Log: io.Discard,
		})
		if err != nil {
			t.Fatal(err)
		}
		tot := res.Totals
		pub := tot.Endpoints[EPMQTTPublish]
		con := tot.Endpoints[EPMQTTConnect]
		if pub == nil || con == nil || tot.Endpoints[EPMeasurement] != nil {
			t.Fatalf("endpoints %v, want only %s and %s", keys(tot.Endpoints), EPMQTTConnect, EPMQTTPublish)
		}
		t.Logf("devices %d inflight %d batch %d: publishes %d p50 %.1fms p99 %.1fms, connects %d p99 %.1fms, readings %d acked %d buffered %d, commands %d, errors %v, audit %s",
			devices, inflight, batch, pub.Requests, pub.P50Ms, pub.P99Ms, con.Requests, con.P99Ms, tot.Readings, tot.Acked, tot.Unacked, tot.CommandsReceived, tot.ErrorsByKind, res.Audit.Line())
		if tot.Errors != 0 {
			t.Errorf("errors %v", tot.ErrorsByKind)
		}
		if con.Requests != int64(devices) || tot.Dials != int64(devices) {
			t.Errorf("connects %d, dials %d, want %d each", con.Requests, tot.Dials, devices)
		}
		// ~5 readings per kettle; all acknowledged but the last (batch 1) or
		// those short of a full batch.
		if tot.Readings < int64(4*devices) || tot.Acked < tot.Readings-int64(devices*batch) || tot.Acked+tot.Unacked != tot.Readings {
			t.Errorf("readings %d, acked %d", tot.Readings, tot.Acked)
		}
		if wantPub := tot.Acked / int64(batch); pub.Requests < wantPub {
			t.Errorf("%d publishes for %d acked readings in batches of %d", pub.Requests, tot.Acked, batch)
		}
		if tot.CommandsReceived < int64(devices) {
			t.Errorf("commands received %d, want ≥ %d (the retained one on subscribe)", tot.CommandsReceived, devices)
		}
		a := res.Audit
		if a == nil || a.Lost != 0 || a.Duplicated != 0 || a.Acked != tot.Acked || a.Stored != a.Acked {
			t.Errorf("audit %+v, acked %d", a, tot.Acked)
		}
	}
	f(50, 1, 1)
	f(20, 4, 3) // a wider window and batched payloads
}

// TestCheckLoopbackAddr: the MQTT target must be this machine.
func TestCheckLoopbackAddr(t *testing.T) {
	f := func(in, want string, ok bool) {
		t.Helper()
		got, err := CheckLoopbackAddr(in)
		if (err == nil) != ok || got != want {
			t.Errorf("CheckLoopbackAddr(%q) = %q, %v; want %q ok=%v", in, got, err, want, ok)
		}
	}
	f("127.0.0.1:1883", "127.0.0.1:1883", true)
	f("tcp://localhost:1883", "127.0.0.1:1883", true)
	f("mqtt://127.0.0.5:18830", "127.0.0.5:18830", true)
	f("[::1]:1883", "[::1]:1883", true)
	f("10.0.0.1:1883", "", false)
	f("example.com:1883", "", false)
	f("127.0.0.1", "", false)
}

func keys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// TestSwarmMQTTReconnects: the server restarts in the middle of a run; the
// kettles redial with backoff, resend what was not acknowledged, and the
// audit still finds every PUBACKed reading stored exactly once.
func TestSwarmMQTTReconnects(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	cfg := server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + dir + "/k.db", DataDir: dir,
		MQTT:   mqttapi.Config{Addr: "127.0.0.1:0"},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	srv, err := server.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The second server takes the same addresses and data dir.
	cfg.Addr, cfg.MQTT.Addr = srv.Addr(), srv.MQTTAddr()
	url, secret, op := srv.URL(), srv.Secret(), srv.OperatorToken()
	var srv2 *server.Server
	restarted := make(chan error, 1)
	go func() {
		time.Sleep(2500 * time.Millisecond)
		srv.Close()
		time.Sleep(500 * time.Millisecond)
		var err error
		srv2, err = server.Start(ctx, cfg)
		restarted <- err
	}()
	res, err := Run(ctx, Config{
		Target: url, Protocol: ProtocolMQTT, MQTTTarget: cfg.MQTT.Addr,
		Devices: 20, Interval: time.Second, Jitter: 100 * time.Millisecond, Duration: 9 * time.Second,
		Secret: secret, Operator: op, Seed: 3, Timeout: 3 * time.Second,
		ReserveFDs: 1000, Progress: io.Discard, Log: io.Discard,
	})
	if rerr := <-restarted; rerr != nil {
		t.Fatalf("restart: %v", rerr)
	}
	t.Cleanup(func() { srv2.Close() })
	if err != nil {
		t.Fatal(err)
	}
	tot := res.Totals
	t.Logf("readings %d acked %d buffered %d, dials %d, lost conns %d, errors %v, audit %s",
		tot.Readings, tot.Acked, tot.Unacked, tot.Dials, tot.ConnsLost, tot.ErrorsByKind, res.Audit.Line())
	if tot.ConnsLost < 20 || tot.Dials < 40 {
		t.Errorf("lost %d connections, dialed %d: want every kettle to lose and redial its connection", tot.ConnsLost, tot.Dials)
	}
	// After the restart every kettle is back and its buffered readings are
	// acknowledged: at most the last one or two per kettle are not.
	if tot.Acked < tot.Readings-40 {
		t.Errorf("readings %d, acked %d: kettles did not recover", tot.Readings, tot.Acked)
	}
	if a := res.Audit; a == nil || a.Lost != 0 || a.Duplicated != 0 || a.Stored != a.Acked {
		t.Errorf("audit %+v", a)
	}
}
