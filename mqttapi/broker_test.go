package mqttapi_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestConnectRefused: anything but username = device id and password = its
// token, or a CONNECT with a Will message, is refused with the protocol's
// own CONNACK code.
func TestConnectRefused(t *testing.T) {
	e := start(t, fleet.Config{})
	a, b := uuid.New(), uuid.New()
	will := ""
	f := func(version byte, user, pass, clientID string, want byte) {
		t.Helper()
		r := dial(t, e.broker.Addr(), version)
		r.will = will
		if got := r.connect(user, pass, clientID); got != want {
			t.Errorf("v%d connect(%q, %.12q…, %q, will %q) = 0x%02x, want 0x%02x", version, user, pass, clientID, will, got, want)
		}
	}
	for _, v := range []struct {
		version                                byte
		ok, badUserPass, notAuth, badCID, will byte
	}{{4, 0, 0x04, 0x05, 0x02, 0x05}, {5, 0, 0x86, 0x87, 0x85, 0x83}} {
		// A Will is published without the ACL check: here a forged
		// command for another kettle, retained. Refused.
		will = mqttapi.CommandTopic(b)
		f(v.version, a.String(), kettle.DeviceToken(secret, a), a.String(), v.will)
		will = ""
		f(v.version, a.String(), kettle.DeviceToken(secret, a), a.String(), v.ok)
		f(v.version, a.String(), kettle.DeviceToken(secret, a), "", v.ok)                           // client id assigned = device id
		f(v.version, a.String(), kettle.DeviceToken([]byte("other"), a), a.String(), v.badUserPass) // wrong password
		f(v.version, a.String(), "", a.String(), v.badUserPass)                                     // no password
		f(v.version, "kettle-1", kettle.DeviceToken(secret, a), "", v.badUserPass)                  // username not a device id
		f(v.version, strings.ToUpper(a.String()), kettle.DeviceToken(secret, a), "", v.badUserPass) // not the canonical form
		f(v.version, a.String(), kettle.DeviceToken(secret, b), a.String(), v.notAuth)              // another device's token
		f(v.version, a.String(), kettle.DeviceToken(secret, a), b.String(), v.badCID)               // another device's session
	}
	if got := e.broker.Counters().ConnectsRefused.Load(); got != 14 {
		t.Errorf("ConnectsRefused = %d, want 14", got)
	}
}

// TestACL: a kettle publishes only to its measurements topic and subscribes
// only to its command topic.
func TestACL(t *testing.T) {
	e := start(t, fleet.Config{})
	other := uuid.New()

	// MQTT 5: refused per packet, the connection stays.
	r, id := kettleConn(t, e.broker.Addr(), 5, uuid.Nil)
	r.publish(mqttapi.MeasurementTopic(other), 1, 1, false, reading(time.Now(), 100))
	if ack := r.must(packets.Puback); ack.ReasonCode != 0x87 {
		t.Errorf("v5 publish to another device: PUBACK 0x%02x, want 0x87", ack.ReasonCode)
	}
	for i, filter := range []string{mqttapi.CommandTopic(other), "kettles/#", "kettles/+/command", mqttapi.MeasurementTopic(id)} {
		if ack := r.subscribe(uint16(10+i), filter); len(ack.ReasonCodes) != 1 || ack.ReasonCodes[0] < 0x80 {
			t.Errorf("v5 subscribe %s: SUBACK %v, want a refusal", filter, ack.ReasonCodes)
		}
	}
	r.publish(mqttapi.MeasurementTopic(id), 1, 2, false, reading(time.Now(), 100))
	if ack := r.must(packets.Puback); ack.ReasonCode != 0 {
		t.Errorf("own topic after refusals: PUBACK 0x%02x", ack.ReasonCode)
	}
	if n := len(e.history(t, other)); n != 0 {
		t.Errorf("%d readings stored for the other device", n)
	}

	// MQTT 3.1.1: SUBACK 0x80; a QoS 1 publish to another device's topic has
	// no refusal code, so the server closes the connection.
	r3, _ := kettleConn(t, e.broker.Addr(), 4, uuid.Nil)
	if ack := r3.subscribe(1, mqttapi.CommandTopic(other)); ack.ReasonCodes[0] != 0x80 {
		t.Errorf("v3 subscribe to another device: SUBACK 0x%02x, want 0x80", ack.ReasonCodes[0])
	}
	r3.publish(mqttapi.MeasurementTopic(other), 1, 2, false, reading(time.Now(), 100))
	if pk, err := r3.read(5 * time.Second); err == nil && pk.FixedHeader.Type != packets.Disconnect {
		t.Errorf("v3 publish to another device: got %+v, want the connection closed", pk)
	}
	if n := len(e.history(t, other)); n != 0 {
		t.Errorf("%d readings stored for the other device", n)
	}
	if got := e.broker.Counters().ACLDenied.Load(); got < 6 {
		t.Errorf("ACLDenied = %d, want ≥ 6", got)
	}
}

// TestPubackAfterCommit: when the PUBACK arrives the reading is already in
// the store; a redelivery is stored once and acknowledged again.
func TestPubackAfterCommit(t *testing.T) {
	e := start(t, fleet.Config{})
	for _, version := range []byte{4, 5} {
		r, id := kettleConn(t, e.broker.Addr(), version, uuid.Nil)
		at := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
		r.publish(mqttapi.MeasurementTopic(id), 1, 7, false, reading(at, 321))
		if ack := r.must(packets.Puback); ack.PacketID != 7 || ack.ReasonCode != 0 {
			t.Fatalf("v%d PUBACK %+v", version, ack)
		}
		h := e.history(t, id)
		if len(h) != 1 || !h[0].Time.Equal(at) || h[0].LevelML != 321 {
			t.Fatalf("v%d: store right after PUBACK holds %+v, want the reading", version, h)
		}
		// Redelivery (DUP, as after a lost PUBACK) and a plain resend.
		r.publish(mqttapi.MeasurementTopic(id), 1, 7, true, reading(at, 321))
		r.must(packets.Puback)
		r.publish(mqttapi.MeasurementTopic(id), 1, 8, false, reading(at, 321))
		r.must(packets.Puback)
		if h := e.history(t, id); len(h) != 1 {
			t.Fatalf("v%d: %d rows after redelivery, want 1", version, len(h))
		}
		// A batch: one PUBACK after one commit of all of it.
		batch := "[" + string(reading(at.Add(time.Second), 1)) + "," + string(reading(at.Add(2*time.Second), 2)) + "]"
		r.publish(mqttapi.MeasurementTopic(id), 1, 9, false, []byte(batch))
		r.must(packets.Puback)
		if h := e.history(t, id); len(h) != 3 {
			t.Fatalf("v%d: %d rows after a batch of 2, want 3", version, len(h))
		}
		// QoS 0: accepted best-effort.
		r.publish(mqttapi.MeasurementTopic(id), 0, 0, false, reading(at.Add(3*time.Second), 3))
		deadline := time.Now().Add(5 * time.Second)
		for len(e.history(t, id)) != 4 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if h := e.history(t, id); len(h) != 4 {
			t.Fatalf("v%d: QoS 0 reading not stored (%d rows)", version, len(h))
		}
	}
	_, dups := e.svc.Counters()
	if dups != 4 {
		t.Errorf("duplicates = %d, want 4", dups)
	}
	c := e.broker.Counters().Snapshot()
	if c.Publishes[1] != 8 || c.Publishes[0] != 2 || c.Readings != 12 {
		t.Errorf("counters %+v", c)
	}
}

// TestInvalidPayload: MQTT 5 gets PUBACK 0x99 naming the field; 3.1.1 gets
// a plain PUBACK (dropped, counted); both connections keep working.
func TestInvalidPayload(t *testing.T) {
	e := start(t, fleet.Config{})
	bad := []byte(`{"time":"2026-01-01T00:00:00Z","battery_charge_mwh":1,"battery_full_mwh":2,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":20,"water_level_ml":-3}`)
	for _, version := range []byte{5, 4} {
		r, id := kettleConn(t, e.broker.Addr(), version, uuid.Nil)
		f := func(payload string, wantCode byte, wantReason string) {
			t.Helper()
			r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, []byte(payload))
			ack := r.must(packets.Puback)
			if ack.ReasonCode != wantCode || !strings.Contains(ack.Properties.ReasonString, wantReason) {
				t.Errorf("v%d %.40q: PUBACK 0x%02x %q, want 0x%02x containing %q", version, payload, ack.ReasonCode, ack.Properties.ReasonString, wantCode, wantReason)
			}
		}
		code := byte(0x99)
		if version == 4 {
			code = 0
		}
		v5 := func(s string) string {
			if version == 5 {
				return s
			}
			return ""
		}
		f(string(bad), code, v5(`field "water_level_ml"`))
		f(`{"time":"yesterday"}`, code, v5(`field "time"`))
		f(`not json`, code, v5("malformed JSON"))
		f(`[]`, code, v5("batch"))
		f(string(reading(time.Now(), 5)), 0, "")
		if h := e.history(t, id); len(h) != 1 {
			t.Errorf("v%d: %d rows stored, want only the valid one", version, len(h))
		}
	}
	if got := e.broker.Counters().Invalid.Load(); got != 8 {
		t.Errorf("Invalid = %d, want 8", got)
	}
}

// TestInvalidPayloadLogThinned: a kettle sending invalid payloads as fast
// as it can (QoS 0, then one QoS 1 answered 0x99) costs the log ten lines a
// second, each short however long the error (1,000 empty readings: 7,000
// field errors).
func TestInvalidPayloadLogThinned(t *testing.T) {
	var buf syncbuf.Buffer
	e := startLog(t, fleet.Config{}, slog.New(slog.NewTextHandler(&buf, nil)))
	r, id := kettleConn(t, e.broker.Addr(), 5, uuid.Nil)
	payload := []byte("[" + strings.Repeat("{},", 999) + "{}]")
	began := time.Now()
	for range 200 { // QoS 0: no round trip each, so the flood is fast
		r.publish(mqttapi.MeasurementTopic(id), 0, 0, false, payload)
	}
	r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, payload) // read after them all
	if ack := r.must(packets.Puback); ack.ReasonCode != 0x99 {
		t.Fatalf("the QoS 1 publish after the flood: PUBACK 0x%02x, want 0x99", ack.ReasonCode)
	}
	windows := int(time.Since(began)/time.Second) + 2 // the log's one-second windows the run touched
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	n := 0
	for _, l := range lines {
		if strings.Contains(l, "invalid measurement payload") {
			n++
			if len(l) > 1500 {
				t.Errorf("a log line of %d bytes: %.300s…", len(l), l)
			}
		}
	}
	if n < 1 || n > 10*windows {
		t.Errorf("201 invalid payloads in %s: %d log lines, want 1 to %d (10 a second)", time.Since(began).Round(time.Millisecond), n, 10*windows)
	}
}

// TestRetentionRefused: with a retention, a reading older than it gets
// MQTT 5's PUBACK 0x99 naming the time field and the window; one inside it
// is stored.
func TestRetentionRefused(t *testing.T) {
	e := start(t, fleet.Config{Retention: 30 * 24 * time.Hour})
	r, id := kettleConn(t, e.broker.Addr(), 5, uuid.Nil)
	r.publish(mqttapi.MeasurementTopic(id), 1, 1, false, reading(time.Now().Add(-31*24*time.Hour), 5))
	if ack := r.must(packets.Puback); ack.ReasonCode != 0x99 || !strings.Contains(ack.Properties.ReasonString, `field "time"`) ||
		!strings.Contains(ack.Properties.ReasonString, "30d (its retention)") {
		t.Errorf("a reading older than the retention: PUBACK 0x%02x %q, want 0x99 naming the field and the retention", ack.ReasonCode, ack.Properties.ReasonString)
	}
	r.publish(mqttapi.MeasurementTopic(id), 2, 1, false, reading(time.Now().Add(-29*24*time.Hour), 5))
	if ack := r.must(packets.Puback); ack.ReasonCode != 0 {
		t.Errorf("a reading inside the retention: PUBACK 0x%02x %q", ack.ReasonCode, ack.Properties.ReasonString)
	}
	if h := e.history(t, id); len(h) != 1 {
		t.Errorf("%d rows stored, want the one inside the retention", len(h))
	}
}

// TestCommands: the current command arrives on subscribe (after SUBACK,
// retained), and again when an override or a reading changes it.
func TestCommands(t *testing.T) {
	e := start(t, fleet.Config{})
	for _, version := range []byte{5, 4} {
		r, id := kettleConn(t, e.broker.Addr(), version, uuid.Nil)
		if err := e.svc.RegisterIDs(context.Background(), []kettle.DeviceID{id}); err != nil {
			t.Fatal(err)
		}
		if ack := r.subscribe(1, mqttapi.CommandTopic(id)); ack.ReasonCodes[0] != 1 {
			t.Fatalf("v%d SUBACK %v", version, ack.ReasonCodes)
		}
		cmd, pk, err := r.command(5 * time.Second)
		if err != nil {
			t.Fatalf("v%d: no command on subscribe: %v", version, err)
		}
		if !pk.FixedHeader.Retain || pk.TopicName != mqttapi.CommandTopic(id) {
			t.Errorf("v%d: command on subscribe: retain=%v topic=%s", version, pk.FixedHeader.Retain, pk.TopicName)
		}
		want, _ := e.svc.Command(id)
		if cmd["charge"] != want.Charge || cmd["reason"] != want.Reason || cmd["poll_after_s"] == nil || cmd["flush_ml_per_s"] == nil || cmd["fill"] != want.Fill {
			t.Errorf("v%d: command %v, want %+v", version, cmd, want)
		}

		// An override changes it: pushed.
		no := false
		if err := e.svc.SetOverride(context.Background(), id, kettle.Override{Charge: &no, ExpiresAt: time.Now().Add(time.Hour), SetAt: time.Now()}); err != nil {
			t.Fatal(err)
		}
		cmd, _, err = r.command(5 * time.Second)
		if err != nil {
			t.Fatalf("v%d: no push after override: %v", version, err)
		}
		if cmd["charge"] != false || !strings.Contains(cmd["reason"].(string), "override") {
			t.Errorf("v%d: pushed %v, want charge false by override", version, cmd)
		}

		// Committed readings that change the policy's answer (a capacity of
		// 1000 mL, then a level of 100 mL: fill): pushed.
		r.publish(mqttapi.MeasurementTopic(id), 1, 2, false, fmt.Appendf(nil, "[%s,%s]",
			reading(time.Now().Add(-2*time.Second), 1000), reading(time.Now().Add(-time.Second), 100)))
		// The push may come before or after the PUBACK: both must come.
		var got map[string]any
		acked := false
		for got == nil || !acked {
			pk, err := r.read(5 * time.Second)
			if err != nil {
				t.Fatalf("v%d: waiting for PUBACK and push: %v", version, err)
			}
			switch pk.FixedHeader.Type {
			case packets.Puback:
				acked = true
			case packets.Publish:
				got = map[string]any{"reason": string(pk.Payload)}
			}
		}
		if got == nil || !strings.Contains(got["reason"].(string), "level 100 mL") {
			t.Errorf("v%d: after a reading, pushed %v", version, got)
		}

		// Nothing changed: nothing pushed (the periodic re-check runs every 100 ms here).
		if pk, err := r.read(700 * time.Millisecond); err == nil {
			t.Errorf("v%d: unexpected packet without a change: %+v", version, pk)
		}

		// Readings that change only the reason's prose (level 200 mL, still
		// fill) are not pushed; one that changes what the kettle does
		// (level 990 mL: it becomes the capacity, stop filling) is.
		f := func(pid uint16, at time.Time, level float64, wantPush bool) {
			t.Helper()
			r.publish(mqttapi.MeasurementTopic(id), 1, pid, false, reading(at, level))
			var push *packets.Packet
			for acked := false; !acked || (wantPush && push == nil); {
				pk, err := r.read(5 * time.Second)
				if err != nil {
					t.Fatalf("v%d level %g: waiting for PUBACK (push %v): %v", version, level, wantPush, err)
				}
				switch pk.FixedHeader.Type {
				case packets.Puback:
					acked = true
				case packets.Publish:
					push = &pk
				}
			}
			if !wantPush {
				// The push, if any, comes after the commit; give it time.
				if pk, err := r.read(500 * time.Millisecond); err == nil && push == nil {
					push = &pk
				}
			}
			switch {
			case wantPush && push == nil:
				t.Errorf("v%d level %g: command changed, nothing pushed", version, level)
			case !wantPush && push != nil:
				t.Errorf("v%d level %g: only the reason changed, but pushed %s", version, level, push.Payload)
			case wantPush && !strings.Contains(string(push.Payload), `"fill":false`):
				t.Errorf("v%d level %g: pushed %s, want fill false", version, level, push.Payload)
			}
		}
		now := time.Now()
		f(3, now.Add(-900*time.Millisecond), 200, false)
		f(4, now.Add(-800*time.Millisecond), 300, false)
		f(5, now.Add(-700*time.Millisecond), 990, true)
	}
}

// TestBackpressure: while the store cannot commit and the ingest queue is
// full, no PUBACK is sent and connections are not read; once the store is
// back every message is committed, acknowledged and stored once.
func TestBackpressure(t *testing.T) {
	e := start(t, fleet.Config{QueueRows: 2, BatchRows: 1})
	db, err := sql.Open("sqlite3", e.path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := db.Conn(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(t.Context(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	const kettles = 8
	type k struct {
		r  *raw
		id kettle.DeviceID
	}
	ks := make([]k, kettles)
	at := time.Now().Add(-time.Minute)
	for i := range ks {
		ks[i].r, ks[i].id = kettleConn(t, e.broker.Addr(), byte(4+i%2), uuid.Nil)
		ks[i].r.publish(mqttapi.MeasurementTopic(ks[i].id), 1, 1, false, reading(at, float64(i)))
	}
	// While the store is locked: no PUBACK anywhere.
	var wg sync.WaitGroup
	for _, k := range ks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if pk, err := k.r.read(1500 * time.Millisecond); err == nil {
				t.Errorf("packet while the store is locked: %+v", pk)
			}
		}()
	}
	wg.Wait()
	if w := e.broker.Counters().Withheld.Load(); w < kettles-3 {
		t.Errorf("Withheld = %d, want ≥ %d (queue of 2, one in the stuck batch)", w, kettles-3)
	}
	if _, err := conn.ExecContext(t.Context(), "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	for i, k := range ks {
		if ack := k.r.must(packets.Puback); ack.ReasonCode != 0 {
			t.Errorf("kettle %d: PUBACK 0x%02x", i, ack.ReasonCode)
		}
		if h := e.history(t, k.id); len(h) != 1 {
			t.Errorf("kettle %d: %d rows after PUBACK, want 1", i, len(h))
		}
	}
}

// TestPipelinedPubacks: a kettle's connection is read on while its QoS 1
// messages wait for their commit (a PINGREQ is answered meanwhile), no
// PUBACK precedes the commit, and the PUBACKs come in the order the
// PUBLISHes did — an invalid payload's too, behind a valid one's commit.
func TestPipelinedPubacks(t *testing.T) {
	for _, version := range []byte{4, 5} {
		e := start(t, fleet.Config{})
		db, err := sql.Open("sqlite3", e.path)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		lock, err := db.Conn(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer lock.Close()
		if _, err := lock.ExecContext(t.Context(), "BEGIN IMMEDIATE"); err != nil {
			t.Fatal(err)
		}
		r, id := kettleConn(t, e.broker.Addr(), version, uuid.Nil)
		topic := mqttapi.MeasurementTopic(id)
		at := time.Now().Add(-time.Minute).Truncate(time.Second)
		r.publish(topic, 1, 1, false, reading(at, 1))
		r.publish(topic, 1, 2, false, []byte(`{"time":"nope"}`))
		r.publish(topic, 1, 3, false, reading(at.Add(time.Second), 3))
		r.send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
		if pk := r.must(packets.Pingresp); pk.FixedHeader.Type != packets.Pingresp {
			t.Fatal("no PINGRESP")
		}
		if pk, err := r.read(500 * time.Millisecond); err == nil {
			t.Fatalf("v%d: packet before the commit: %+v", version, pk)
		}
		if _, err := lock.ExecContext(t.Context(), "ROLLBACK"); err != nil {
			t.Fatal(err)
		}
		want := []byte{0, 0, 0}
		if version == 5 {
			want[1] = packets.ErrPayloadFormatInvalid.Code
		}
		for i, code := range want {
			ack := r.must(packets.Puback)
			if ack.PacketID != uint16(i+1) || ack.ReasonCode != code {
				t.Errorf("v%d: PUBACK %d: id %d code 0x%02x, want id %d code 0x%02x", version, i, ack.PacketID, ack.ReasonCode, i+1, code)
			}
		}
		if h := e.history(t, id); len(h) != 2 {
			t.Errorf("v%d: %d rows stored, want 2", version, len(h))
		}
	}
}
