package mqttapi_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/tlscert/tlscerttest"
	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/postgres"
	"github.com/kettlefleet/kettlefleet/sqlite"
)

// mosquitto starts a throwaway Mosquitto on a free port and returns its URL.
func mosquitto(t *testing.T) string { t.Helper(); return startMosquitto(t, "", "tcp") }

// mosquittoTLS starts one whose listener speaks TLS only, with this
// certificate and key, and returns its tls:// URL.
func mosquittoTLS(t *testing.T, certFile, keyFile string) string {
	t.Helper()
	conf := fmt.Sprintf("certfile %s\nkeyfile %s\n", certFile, keyFile)
	if os.Geteuid() == 0 {
		// Started as root, Mosquitto becomes the user mosquitto, who cannot
		// read the test's private temp directory.
		conf += "user root\n"
	}
	return startMosquitto(t, conf, "tls")
}

func startMosquitto(t *testing.T, listener, scheme string) string {
	t.Helper()
	bin, err := exec.LookPath("mosquitto")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/mosquitto"); serr != nil {
			t.Fatal("mosquitto not found: apt-get install -y mosquitto")
		}
		bin = "/usr/sbin/mosquitto"
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	conf := filepath.Join(dir, "mosquitto.conf")
	err = os.WriteFile(conf, []byte(fmt.Sprintf("listener %d 127.0.0.1\n%sallow_anonymous true\npersistence false\nmax_inflight_messages 1000\nmax_queued_messages 100000\n", port, listener)), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", conf)
	out, _ := os.Create(filepath.Join(dir, "mosquitto.log"))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "mosquitto.log"))
			t.Logf("mosquitto log:\n%s", b)
		}
	})
	addr := "127.0.0.1:" + strconv.Itoa(port)
	for deadline := time.Now().Add(10 * time.Second); ; {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("mosquitto did not listen on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return scheme + "://" + addr
}

// awaitSubscribed publishes QoS 1 readings of a probe device through pub
// until every consumer has committed one: then each one's subscription has
// been confirmed by the broker (its SUBACK sent). It returns the probe's id.
func awaitSubscribed(t *testing.T, pub *autopaho.ConnectionManager, consumers ...*mqttapi.Consumer) kettle.DeviceID {
	t.Helper()
	probe := uuid.New()
	at := time.Now().Add(-2 * time.Hour).Truncate(time.Millisecond)
	subscribed := func() bool {
		for _, c := range consumers {
			if c.Counters().Readings.Load() == 0 {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; !subscribed(); i++ {
		if time.Now().After(deadline) {
			t.Fatalf("after %d probes in 30 s not every consumer has committed one", i)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := pub.Publish(ctx, &paho.Publish{Topic: mqttapi.MeasurementTopic(probe), QoS: 1, Payload: reading(at.Add(time.Duration(i)*time.Second), 500)})
		cancel()
		if err != nil {
			t.Fatalf("probe: %v", err)
		}
		// The next probe once this one is committed, or after a while
		// (it found no subscriber and is gone).
		for wait := time.Now().Add(200 * time.Millisecond); !subscribed() && time.Now().Before(wait); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	return probe
}

// TestConsumeSharedSubscription: two kettle nodes (two fleet services, two
// PostgreSQL pools, one database) share $share/kettle/…; a plain client
// publishes N readings at QoS 1 through a real Mosquitto; every reading is
// stored exactly once and both nodes took part. Commands come back retained
// through the broker.
func TestConsumeSharedSubscription(t *testing.T) {
	broker := mosquitto(t)
	dsn := pgtest.Start(t)
	ctx := context.Background()
	log := testLog(t)

	type node struct {
		store *postgres.Store
		svc   *fleet.Service
		c     *mqttapi.Consumer
	}
	var nodes [2]node
	for i := range nodes {
		n := &nodes[i]
		var err error
		n.store, err = postgres.Open(ctx, dsn, postgres.Options{})
		if err != nil {
			t.Fatal(err)
		}
		n.svc, err = fleet.New(ctx, n.store, fleet.Config{Writers: 2}, log, nil, fleet.Hooks{})
		if err != nil {
			t.Fatal(err)
		}
		n.c, err = mqttapi.Consume(ctx, mqttapi.ConsumerConfig{BrokerURL: broker, ClientID: fmt.Sprintf("kettle-node-%d", i), CommandTick: 100 * time.Millisecond}, n.svc, secret, log)
		if err != nil {
			t.Fatal(err)
		}
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := n.c.AwaitConnection(actx); err != nil {
			t.Fatal(err)
		}
		cancel()
		t.Cleanup(func() {
			n.c.Close()
			n.svc.Close()
			n.store.Close()
		})
	}
	// A plain paho client as "the kettles": N readings over several devices.
	const devices, perDevice = 20, 25
	ids := make([]kettle.DeviceID, devices)
	for i := range ids {
		ids[i] = uuid.New()
	}
	u, _ := url.Parse(broker)
	cmds := make(chan *paho.Publish, 100)
	pub, err := autopaho.NewConnection(ctx, autopaho.ClientConfig{
		ServerUrls:                    []*url.URL{u},
		KeepAlive:                     30,
		CleanStartOnInitialConnection: true,
		ClientConfig: paho.ClientConfig{
			ClientID: "publisher",
			OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
				select {
				case cmds <- pr.Packet:
				default:
				}
				return true, nil
			}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Disconnect(context.Background())
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pub.AwaitConnection(actx); err != nil {
		t.Fatal(err)
	}
	// Both subscriptions confirmed before the readings: a QoS 1 message
	// the broker takes while no member of the share is subscribed is
	// dropped, not queued.
	probe := awaitSubscribed(t, pub, nodes[0].c, nodes[1].c)
	var probed [2]int64
	for i, n := range nodes {
		probed[i] = n.c.Counters().Readings.Load()
	}
	base := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	var wg sync.WaitGroup
	for d, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perDevice; i++ {
				pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				_, err := pub.Publish(pctx, &paho.Publish{Topic: mqttapi.MeasurementTopic(id), QoS: 1, Payload: reading(base.Add(time.Duration(i)*time.Second), float64(100+d))})
				cancel()
				if err != nil {
					t.Errorf("publish: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()

	// The broker's PUBACK to the publisher says nothing about our commit:
	// wait for the store.
	var total int
	for deadline := time.Now().Add(20 * time.Second); ; {
		total = 0
		for _, id := range ids {
			h, err := nodes[0].store.History(ctx, kettle.HistoryQuery{Device: id, Limit: 1000})
			if err != nil {
				t.Fatal(err)
			}
			total += len(h)
		}
		if total >= devices*perDevice || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if total != devices*perDevice {
		t.Fatalf("stored %d readings, want %d", total, devices*perDevice)
	}
	// A node counts a reading once its commit returned: the store may show
	// the last ones a moment before the counters do. The probes are counted
	// too: as many as the store holds.
	probes, err := nodes[0].store.History(ctx, kettle.HistoryQuery{Device: probe, Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	want := int64(devices*perDevice + len(probes))
	var consumed [2]int64
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		for i, n := range nodes {
			consumed[i] = n.c.Counters().Readings.Load()
		}
		if consumed[0]+consumed[1] >= want || time.Now().After(deadline) {
			break
		}
	}
	for i, n := range nodes {
		stored, dups := n.svc.Counters()
		t.Logf("node %d: consumed %d (%d probes before the readings), stored %d, duplicates %d", i, consumed[i], probed[i], stored, dups)
	}
	if consumed[0]+consumed[1] != want {
		t.Errorf("nodes consumed %d + %d, want %d readings and %d probes in all (each once)", consumed[0], consumed[1], devices*perDevice, len(probes))
	}
	if consumed[0] == probed[0] || consumed[1] == probed[1] {
		t.Errorf("one node consumed none of the readings: %v, %v of them probes", consumed, probed)
	}

	// Commands: published retained through the broker by the nodes that saw
	// the readings; a late subscriber gets the current one.
	id := ids[0]
	sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
	defer scancel()
	if _, err := pub.Subscribe(sctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: mqttapi.CommandTopic(id), QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-cmds:
		if p.Topic != mqttapi.CommandTopic(id) || !p.Retain {
			t.Errorf("command: topic %s retain %v", p.Topic, p.Retain)
		}
		t.Logf("retained command: %s", p.Payload)
	case <-time.After(10 * time.Second):
		t.Fatal("no retained command from the broker")
	}
}

// TestConsumeOverTLS: a node consumes from a Mosquitto that speaks TLS only
// (--mqtt-broker tls://…, its certificate trusted through
// --mqtt-broker-ca), and a reading published over TLS is stored. Without
// the CA the node never connects; a CA with a tcp:// broker is refused.
func TestConsumeOverTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_, roots, _, _ := tlscerttest.Write(t, certFile, keyFile, time.Now().Add(24*time.Hour))
	broker := mosquittoTLS(t, certFile, keyFile)
	ctx := context.Background()
	log := testLog(t)
	store, err := sqlite.Open(ctx, filepath.Join(dir, "k.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	svc, err := fleet.New(ctx, store, fleet.Config{}, log, nil, fleet.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()

	if _, err := mqttapi.Consume(ctx, mqttapi.ConsumerConfig{BrokerURL: strings.Replace(broker, "tls://", "tcp://", 1), CAFile: certFile}, svc, secret, log); err == nil || !strings.Contains(err.Error(), "tls://") {
		t.Errorf("a CA with a tcp:// broker: %v", err)
	}
	untrusting, err := mqttapi.Consume(ctx, mqttapi.ConsumerConfig{BrokerURL: broker, ClientID: "untrusting"}, svc, secret, log)
	if err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	if err := untrusting.AwaitConnection(actx); err == nil {
		t.Error("connected to a broker whose certificate the system's roots do not sign")
	}
	cancel()
	untrusting.Close()

	c, err := mqttapi.Consume(ctx, mqttapi.ConsumerConfig{BrokerURL: broker, CAFile: certFile, ClientID: "node"}, svc, secret, log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	actx, cancel = context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := c.AwaitConnection(actx); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(broker)
	pub, err := autopaho.NewConnection(ctx, autopaho.ClientConfig{
		ServerUrls: []*url.URL{u}, TlsCfg: &tls.Config{RootCAs: roots}, KeepAlive: 30, CleanStartOnInitialConnection: true,
		ClientConfig: paho.ClientConfig{ClientID: "publisher"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Disconnect(context.Background())
	if err := pub.AwaitConnection(actx); err != nil {
		t.Fatal(err)
	}
	awaitSubscribed(t, pub, c)
	id := uuid.New()
	at := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	if _, err := pub.Publish(actx, &paho.Publish{Topic: mqttapi.MeasurementTopic(id), QoS: 1, Payload: reading(at, 500)}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		h, err := store.History(ctx, kettle.HistoryQuery{Device: id, Limit: 10})
		if err != nil {
			t.Fatal(err)
		}
		if len(h) == 1 && h[0].Time.Equal(at) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reading published over TLS was not stored: %v", h)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
