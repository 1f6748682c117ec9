package sim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestSwarmMQTTAgainstServer: a short MQTT swarm against the real server
// (embedded store, MQTT listener on): every kettle connects, receives its
// retained command by subscription, publishes QoS 1 on schedule, and the
// audit over the HTTP operator API finds every PUBACKed reading stored once.
func TestSwarmMQTTAgainstServer(t *testing.T) {
	ctx := context.Background()
	srv := startServer(t, mqttapi.Config{Addr: "127.0.0.1:0"})

	f := func(devices, inflight, batch int) {
		t.Helper()
		res, err := Run(ctx, Config{
			TargetConfig:    TargetConfig{Target: srv.URL(), Secret: srv.Secret(), Operator: srv.OperatorToken()},
			FleetConfig:     FleetConfig{Devices: devices, Seed: 7},
			ScheduleConfig:  ScheduleConfig{Interval: time.Second, Jitter: 100 * time.Millisecond, Duration: 5 * time.Second},
			TransportConfig: TransportConfig{Protocol: ProtocolMQTT, MQTTTarget: srv.MQTTAddr(), MQTTInflight: inflight, Batch: batch, ReserveFDs: 1000},
			OutputConfig:    OutputConfig{Progress: io.Discard, Log: io.Discard},
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
	ctx := context.Background()
	cfg := serverConfig(t, mqttapi.Config{Addr: "127.0.0.1:0"})
	srv, err := server.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The second server takes the same addresses and data dir.
	cfg.Addr, cfg.MQTT.Addr = srv.Addr(), srv.MQTTAddr()
	url, secret, op := srv.URL(), srv.Secret(), srv.OperatorToken()
	var srv2 *server.Server
	var restartErr error
	restarted := make(chan struct{}) // closed once the second server is up (or could not start)
	go func() {
		defer close(restarted)
		// The restart once every kettle is connected and the server has
		// taken two readings a kettle, so each has something acknowledged
		// before and something to resend after.
		c := srv.MQTTCounters()
		if !testkit.Poll(20*time.Second, 10*time.Millisecond, func() bool { return c.Connections.Load() == 20 && c.Readings.Load() >= 40 }) {
			srv.Close()
			restartErr = fmt.Errorf("after 20 s the server has %d connections and %d readings, want 20 and 40 before the restart", c.Connections.Load(), c.Readings.Load())
			return
		}
		srv.Close()
		// The same ports again: on a busy machine another process's
		// outgoing connection may hold one of them (an ephemeral port) for
		// a moment.
		testkit.Poll(30*time.Second, 50*time.Millisecond, func() bool {
			srv2, restartErr = server.Start(ctx, cfg)
			return !errors.Is(restartErr, syscall.EADDRINUSE)
		})
	}()
	res, err := Run(ctx, Config{
		TargetConfig:    TargetConfig{Target: url, Secret: secret, Operator: op},
		FleetConfig:     FleetConfig{Devices: 20, Seed: 3},
		ScheduleConfig:  ScheduleConfig{Interval: time.Second, Jitter: 100 * time.Millisecond, Duration: 9 * time.Second},
		TransportConfig: TransportConfig{Protocol: ProtocolMQTT, MQTTTarget: cfg.MQTT.Addr, Timeout: 3 * time.Second, ReserveFDs: 1000},
		OutputConfig:    OutputConfig{Progress: io.Discard, Log: io.Discard},
		// The audit reads the second server: on a loaded machine the
		// restart may still be under way when the run ends.
		AuditConfig: AuditConfig{AuditAfter: func(ctx context.Context) error {
			select {
			case <-restarted:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}},
	})
	<-restarted
	if restartErr != nil {
		t.Fatalf("restart: %v", restartErr)
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

// fakeBroker is an MQTT 5 server for the client's timeouts and keepalive:
// it accepts every CONNECT and SUBSCRIBE, answers PUBLISH with PUBACK after
// pubackAfter (never if < 0) and PINGREQ only if pings, and counts what it
// received.
type fakeBroker struct {
	ln                  net.Listener
	pubackAfter         time.Duration
	pings               bool
	conns, closed       atomic.Int64
	publishes, pingreqs atomic.Int64
	maxPublishesPerConn atomic.Int64
	wg                  sync.WaitGroup
}

func startFakeBroker(t *testing.T, pubackAfter time.Duration, pings bool) *fakeBroker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &fakeBroker{ln: ln, pubackAfter: pubackAfter, pings: pings}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			b.conns.Add(1)
			b.wg.Add(1)
			go func() { defer b.wg.Done(); b.serve(nc) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); b.wg.Wait() })
	return b
}

func (b *fakeBroker) serve(nc net.Conn) {
	defer b.closed.Add(1)
	defer nc.Close()
	var wmu sync.Mutex
	write := func(cp *packets.ControlPacket) {
		wmu.Lock()
		defer wmu.Unlock()
		cp.WriteTo(nc)
	}
	var pubs int64
	var timers sync.WaitGroup
	defer timers.Wait()
	br := bufio.NewReader(nc)
	for {
		p, err := packets.ReadPacket(br)
		if err != nil {
			return
		}
		switch q := p.Content.(type) {
		case *packets.Connect:
			write(packets.NewControlPacket(packets.CONNACK))
		case *packets.Subscribe:
			sa := packets.NewControlPacket(packets.SUBACK)
			sa.Content.(*packets.Suback).PacketID = q.PacketID
			sa.Content.(*packets.Suback).Reasons = []byte{1}
			write(sa)
		case *packets.Publish:
			b.publishes.Add(1)
			if pubs++; pubs > b.maxPublishesPerConn.Load() {
				b.maxPublishesPerConn.Store(pubs)
			}
			if b.pubackAfter >= 0 {
				timers.Add(1)
				time.AfterFunc(b.pubackAfter, func() { defer timers.Done(); write(pubackFor(q)) })
			}
		case *packets.Pingreq:
			b.pingreqs.Add(1)
			if b.pings {
				write(packets.NewControlPacket(packets.PINGRESP))
			}
		}
	}
}

// TestSwarmMQTTTimeouts: a publish not acknowledged in time counts as a
// timeout but is not sent again on the same connection, and its late PUBACK
// still acknowledges its readings; a kettle that has nothing to send pings,
// and a connection whose PINGREQ goes unanswered is closed and counted lost.
func TestSwarmMQTTTimeouts(t *testing.T) {
	run := func(b *fakeBroker, devices int) *Results {
		t.Helper()
		res, err := Run(context.Background(), Config{
			TargetConfig:    TargetConfig{Target: "http://127.0.0.1:1", Secret: []byte("s")},
			FleetConfig:     FleetConfig{Devices: devices, Seed: 1},
			ScheduleConfig:  ScheduleConfig{Interval: time.Second, Jitter: 1, Duration: 5500 * time.Millisecond, HatchRate: 1000},
			TransportConfig: TransportConfig{Protocol: ProtocolMQTT, MQTTTarget: b.ln.Addr().String(), MQTTKeepAlive: 2 * time.Second, Timeout: time.Second, ReserveFDs: 1000},
			AuditConfig:     AuditConfig{NoAudit: true},
			OutputConfig:    OutputConfig{Progress: io.Discard, Log: io.Discard},
		})
		if err != nil {
			t.Fatal(err)
		}
		tot := res.Totals
		t.Logf("conns %d publishes %d (max %d per conn) pingreqs %d; readings %d acked %d, conns lost %d, errors %v",
			b.conns.Load(), b.publishes.Load(), b.maxPublishesPerConn.Load(), b.pingreqs.Load(), tot.Readings, tot.Acked, tot.ConnsLost, tot.ErrorsByKind)
		return res
	}

	// PUBACKs 1.5 s late with a 1 s timeout: one publish at a time, each a
	// timeout, each late PUBACK acknowledging its readings; the readings due
	// meanwhile go out together. Pings are answered: no connection lost.
	b := startFakeBroker(t, 1500*time.Millisecond, true)
	tot := run(b, 10).Totals
	if tot.ErrorsByKind["timeout"] < 10 || tot.ErrorsByKind["timeout"] != tot.Errors || tot.ConnsLost != 0 || b.conns.Load() != 10 {
		t.Errorf("errors %v, conns lost %d, conns %d: want timeouts only, one connection per kettle", tot.ErrorsByKind, tot.ConnsLost, b.conns.Load())
	}
	if tot.Acked < int64(b.publishes.Load()) || tot.Acked < tot.Readings/2 {
		t.Errorf("acked %d of %d readings in %d publishes: late PUBACKs should acknowledge", tot.Acked, tot.Readings, b.publishes.Load())
	}
	if got := b.publishes.Load(); got > 10*4 {
		t.Errorf("%d publishes from 10 kettles in 5.5 s at 1.5 s per PUBACK: readings were resent on the same connection", got)
	}

	// No PUBACK, no PINGRESP: one publish per connection, a PINGREQ two
	// seconds (the keepalive) after it, the connection closed a second
	// later; the backoff after that timeout is longer than the rest of the
	// run.
	b = startFakeBroker(t, -1, false)
	tot = run(b, 10).Totals
	if b.maxPublishesPerConn.Load() != 1 || b.pingreqs.Load() < 10 || tot.ConnsLost != 10 || b.conns.Load() != 10 {
		t.Errorf("max publishes per connection %d, pingreqs %d, conns lost %d, conns %d: want 1, ≥ 10, 10, 10",
			b.maxPublishesPerConn.Load(), b.pingreqs.Load(), tot.ConnsLost, b.conns.Load())
	}
	if tot.Acked != 0 || tot.Unacked != tot.Readings {
		t.Errorf("acked %d, unacked %d of %d", tot.Acked, tot.Unacked, tot.Readings)
	}
}
