package mqttapi_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestReadingsIntactUnderLoad: many MQTT 5 kettles at once, over TLS (a
// reading goroutine per connection, each packet handled on a goroutine of
// its own) and over plain TCP (the poller's turns) on two listeners that
// share the packet buffer pools, QoS 1 pipelined (several publishes of one
// kettle in flight) and QoS 0, single readings and batches of every pool
// size, some through a topic alias, under GOMAXPROCS 1, 2 and 4: every
// payload is decoded as sent (nothing refused as invalid or malformed) and
// each kettle's stored readings are exactly the ones it sent, value for
// value — a packet buffer reused while still read would show up as a refusal
// or as another kettle's reading stored under this one.
// MQTT_STRESS_ROUNDS=N repeats it N times.
func TestReadingsIntactUnderLoad(t *testing.T) {
	rounds := 1
	if s := os.Getenv("MQTT_STRESS_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("MQTT_STRESS_ROUNDS=%q: want a count", s)
		}
		rounds = n
	}
	plain := start(t, fleet.Config{})
	secure, roots := startTLS(t)
	targets := []stressTarget{{e: plain}, {e: secure, roots: roots}}
	kettles := 24
	if raceEnabled {
		kettles = 16
	}
	for r := 0; r < rounds && !t.Failed(); r++ {
		for _, procs := range []int{1, 2, 4} {
			prev := runtime.GOMAXPROCS(procs)
			stressRound(t, targets, kettles, fmt.Sprintf("round %d GOMAXPROCS %d", r, procs))
			runtime.GOMAXPROCS(prev)
			if t.Failed() {
				break
			}
		}
	}
	for _, tg := range targets {
		c := tg.e.broker.Counters()
		t.Logf("tls=%v: %+v", tg.roots != nil, c.Snapshot())
		if n, m := c.Invalid.Load(), c.Malformed.Load(); n != 0 || m != 0 {
			t.Errorf("tls=%v: %d payloads refused as invalid, %d connections closed as malformed; want none", tg.roots != nil, n, m)
		}
	}
}

// stressTarget is one listener: plain TCP, or TLS trusted by roots.
type stressTarget struct {
	e     *env
	roots *x509.CertPool
}

// startTLS is start with a TLS listener (a fresh self-signed certificate)
// and the pool that trusts it.
func startTLS(t *testing.T) (*env, *x509.CertPool) {
	t.Helper()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_, roots, _, _ := tlscerttest.Write(t, certFile, keyFile, time.Now().Add(time.Hour))
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return startWith(t, fleet.Config{}, mqttapi.Config{TLS: &tls.Config{Certificates: []tls.Certificate{pair}}}, testLog(t)), roots
}

// stressKettle is one kettle of a round and what it sent.
type stressKettle struct {
	tg    stressTarget
	id    kettle.DeviceID
	qos   byte
	conc  int  // publishes in flight at once (QoS 1)
	alias bool // publishes after the first name the topic by alias 1
	sent  []kettle.Measurement
	msgs  [][]byte
}

// stressRound connects n kettles to each target, has them all publish at
// once, and checks what each one's store holds.
func stressRound(t *testing.T, targets []stressTarget, n int, round string) {
	t.Helper()
	base := time.Now().Add(-10 * time.Minute).UTC().Truncate(time.Second)
	var ks []*stressKettle
	for ti, tg := range targets {
		for i := range n {
			c := ti*n + i
			k := &stressKettle{tg: tg, id: uuid.New(), qos: byte(c % 2), conc: 1 + c%3, alias: c%4 == 3}
			seq := 0
			// 12 messages: single readings (512-byte buffers), batches of
			// 2–15 (4 KiB) and one of 60–119 (64 KiB).
			for j := range 12 {
				size := 1
				switch (c + j) % 6 {
				case 3, 4:
					size = 2 + (c*7+j)%14
				case 5:
					if j < 6 {
						size = 60 + (c*13+j)%60
					}
				}
				var batch []kettle.Measurement
				for range size {
					batch = append(batch, kettle.Measurement{Device: k.id, Time: base.Add(time.Duration(seq) * time.Millisecond),
						ChargeMWh: float64(seq), FullMWh: 1000 + float64(c), RateMW: float64(j) - 6,
						AmbientC: float64(c%40) + 0.5, WaterC: float64(seq%90) + 0.25, LevelML: float64(c*100_000 + seq)})
					seq++
				}
				k.sent = append(k.sent, batch...)
				k.msgs = append(k.msgs, v1Payload(batch))
			}
			ks = append(ks, k)
		}
	}
	var wg sync.WaitGroup
	for _, k := range ks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := k.run(); err != nil {
				t.Errorf("%s: kettle %s (qos %d, tls %v): %v", round, k.id, k.qos, k.tg.roots != nil, err)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	// Every message is stored by now: QoS 1 ones once acknowledged, and a
	// QoS 0 kettle's before the PUBACK of its last message (sent at QoS 1),
	// since a connection's packets are handled in order and a QoS 0
	// message's readings are committed before the next packet is read
	// (unless dropped for a full queue, which is counted).
	for _, k := range ks {
		k.check(t, round, k.tg.e.history(t, k.id), k.tg.e.broker.Counters().Dropped.Load())
	}
}

// run connects the kettle with paho.golang (MQTT 5), publishes its
// messages and disconnects.
func (k *stressKettle) run() error {
	addr := k.tg.e.broker.Addr()
	var conn net.Conn
	var err error
	if k.tg.roots != nil {
		conn, err = tls.Dial("tcp", addr, &tls.Config{RootCAs: k.tg.roots})
	} else {
		conn, err = net.Dial("tcp", addr)
	}
	if err != nil {
		return err
	}
	defer conn.Close()
	// paho writes a packet in several Writes and takes the conn's lock
	// only if it has one; its pinger writes a PINGREQ from a goroutine of
	// its own at once after the CONNACK. Without the lock, over TLS, that
	// PINGREQ can land inside the first PUBLISH: refused as invalid UTF-8
	// or malformed, which is the client's fault and not what this tests.
	cl := paho.NewClient(paho.ClientConfig{Conn: packets.NewThreadSafeConn(conn), ClientID: k.id.String(), OnClientError: func(error) {}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := cl.Connect(ctx, &paho.Connect{ClientID: k.id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: k.id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, k.id))}); err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer cl.Disconnect(&paho.Disconnect{})
	alias := uint16(1)
	publish := func(j int) error {
		p := &paho.Publish{Topic: mqttapi.MeasurementTopic(k.id), QoS: k.qos, Payload: k.msgs[j]}
		if j == len(k.msgs)-1 {
			// At QoS 1, so that its PUBACK says the earlier QoS 0 messages
			// were handled: paho's Disconnect closes the socket at once,
			// with the PINGRESP its pinger asked for maybe unread, and the
			// reset that sends discards whatever the kernel had not sent yet.
			p.QoS = 1
		}
		if k.alias {
			p.Properties = &paho.PublishProperties{TopicAlias: &alias}
			if j > 0 {
				p.Topic = ""
			}
		}
		pr, err := cl.Publish(ctx, p)
		if err != nil {
			reason := ""
			if pr != nil && pr.Properties != nil {
				reason = pr.Properties.ReasonString
			}
			return fmt.Errorf("message %d (%d bytes): %v (reason %q)", j, len(k.msgs[j]), err, reason)
		}
		return nil
	}
	// The first message alone (it sets the alias), then the rest but the
	// last with k.conc in flight, then the last.
	if err := publish(0); err != nil {
		return err
	}
	next := make(chan int)
	errs := make(chan error, len(k.msgs))
	var wg sync.WaitGroup
	for range k.conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range next {
				if err := publish(j); err != nil {
					errs <- err
				}
			}
		}()
	}
	for j := 1; j < len(k.msgs)-1; j++ {
		next <- j
	}
	close(next)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	return publish(len(k.msgs) - 1)
}

// check compares what the store holds for the kettle with what it sent:
// the same readings, value for value (QoS 0 ones may be missing if a
// message was dropped).
func (k *stressKettle) check(t *testing.T, round string, got []kettle.Measurement, dropped int64) {
	t.Helper()
	sent := make(map[time.Time]kettle.Measurement, len(k.sent))
	for _, m := range k.sent {
		sent[m.Time] = m
	}
	wrong := 0
	for _, m := range got {
		m.Time = m.Time.UTC()
		want, ok := sent[m.Time]
		if !ok || !sameReading(m, want) {
			if wrong++; wrong <= 3 {
				t.Errorf("%s: kettle %s (tls %v) has a reading it never sent: %+v (sent at that time: %+v)", round, k.id, k.tg.roots != nil, m, want)
			}
		}
		delete(sent, m.Time)
	}
	if wrong > 3 {
		t.Errorf("%s: kettle %s: %d readings stored that it never sent", round, k.id, wrong)
	}
	if len(sent) > 0 && (k.qos == 1 || dropped == 0) {
		t.Errorf("%s: kettle %s (qos %d, tls %v): %d of %d readings sent are not stored", round, k.id, k.qos, k.tg.roots != nil, len(sent), len(k.sent))
	}
}

func sameReading(a, b kettle.Measurement) bool {
	return a.Device == b.Device && a.Time.Equal(b.Time) && a.ChargeMWh == b.ChargeMWh && a.FullMWh == b.FullMWh &&
		a.RateMW == b.RateMW && a.AmbientC == b.AmbientC && a.WaterC == b.WaterC && a.LevelML == b.LevelML
}

// v1Payload is ms as a kettle sends them: one object, or an array.
func v1Payload(ms []kettle.Measurement) []byte {
	var b []byte
	if len(ms) > 1 {
		b = append(b, '[')
	}
	for i, m := range ms {
		if i > 0 {
			b = append(b, ',')
		}
		b = fmt.Appendf(b, `{"time":%q,"battery_charge_mwh":%g,"battery_full_mwh":%g,"battery_rate_mw":%g,"ambient_temp_c":%g,"water_temp_c":%g,"water_level_ml":%g}`,
			m.Time.Format(time.RFC3339Nano), m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML)
	}
	if len(ms) > 1 {
		b = append(b, ']')
	}
	return b
}
