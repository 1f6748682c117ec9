package ha_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// haproxyAdmin sends one command to HAProxy's runtime API (the stats socket
// of deploy/haproxy/haproxy.cfg) and returns its answer.
func (tp *topo) haproxyAdmin(t *testing.T, cmd string) string {
	t.Helper()
	c, err := net.DialTimeout("unix", filepath.Join(tp.dir, "haproxy.sock"), 2*time.Second)
	if err != nil {
		t.Fatalf("haproxy runtime API: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "%s\n", cmd)
	var b strings.Builder
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	return strings.TrimSpace(b.String())
}

// mqttKettle is the test's own MQTT kettle, connected through HAProxy.
type mqttKettle struct {
	id       uuid.UUID
	token    string
	cl       *paho.Client
	commands chan wire.CommandJSON
}

func newMQTTKettle(secret string) *mqttKettle {
	id := uuid.New()
	return &mqttKettle{id: id, token: kettle.DeviceToken([]byte(secret), id), commands: make(chan wire.CommandJSON, 64)}
}

// connect dials the balancer's MQTT port, logs in and subscribes to the
// kettle's command topic.
func (k *mqttKettle) connect(ctx context.Context) error {
	conn, err := net.DialTimeout("tcp", haNet+".30:1883", 2*time.Second)
	if err != nil {
		return err
	}
	cl := paho.NewClient(paho.ClientConfig{Conn: conn, ClientID: k.id.String(), OnPublishReceived: []func(paho.PublishReceived) (bool, error){
		func(p paho.PublishReceived) (bool, error) {
			var c wire.CommandJSON
			if json.Unmarshal(p.Packet.Payload, &c) == nil {
				select {
				case k.commands <- c:
				default:
				}
			}
			return true, nil
		}}})
	ca, err := cl.Connect(ctx, &paho.Connect{ClientID: k.id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: k.id.String(), PasswordFlag: true, Password: []byte(k.token)})
	if err == nil && ca.ReasonCode != 0 {
		err = fmt.Errorf("CONNACK reason %#x", ca.ReasonCode)
	}
	if err != nil {
		conn.Close()
		return fmt.Errorf("MQTT connect: %w", err)
	}
	if _, err := cl.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "kettles/" + k.id.String() + "/command", QoS: 1}}}); err != nil {
		cl.Disconnect(&paho.Disconnect{})
		return fmt.Errorf("MQTT subscribe: %w", err)
	}
	k.cl = cl
	return nil
}

// waitCommand waits for a command whose flush rate is flush.
func (k *mqttKettle) waitCommand(t *testing.T, flush float64, limit time.Duration, what string) time.Time {
	t.Helper()
	deadline := time.After(limit)
	for {
		select {
		case c := <-k.commands:
			if c.FlushMLPerS == flush {
				return time.Now()
			}
		case <-deadline:
			t.Fatalf("%s: no command with flush_ml_per_s %g within %s", what, flush, limit)
		}
	}
}

// setOverride sets the kettle's flush rate by an operator override through
// base (a node or the balancer), retrying for 15 s.
func (tp *topo) setOverride(t *testing.T, base string, id uuid.UUID, flush float64) {
	t.Helper()
	body := fmt.Sprintf(`{"flush_ml_per_s":%g,"expires_at":%q}`, flush, time.Now().Add(time.Hour).UTC().Format(time.RFC3339))
	hc := &http.Client{Timeout: 5 * time.Second}
	var last string
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		r, _ := http.NewRequest("PUT", base+"/v1/devices/"+id.String()+"/override", strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer "+tp.readFile("operator-token"))
		r.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(r)
		if err != nil {
			last = err.Error()
			continue
		}
		resp.Body.Close()
		if resp.StatusCode/100 == 2 {
			return
		}
		last = resp.Status
	}
	t.Fatalf("override of %s through %s: %s", id, base, last)
}

// mqttOnNode1 connects an MQTT kettle through HAProxy to node 1 (node 2 is
// drained from the MQTT backend meanwhile), has it publish a reading, gives
// it an override and waits for the command carrying it.
func mqttOnNode1(t *testing.T, tp *topo) *mqttKettle {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	k := newMQTTKettle(tp.readFile("secret"))
	if out := tp.haproxyAdmin(t, "set server kettle_mqtt_nodes/kettle2 state drain"); out != "" {
		t.Fatalf("haproxy: drain kettle2: %s", out)
	}
	err := k.connect(ctx)
	tp.haproxyAdmin(t, "set server kettle_mqtt_nodes/kettle2 state ready")
	if err != nil {
		t.Fatalf("MQTT kettle through HAProxy to node 1: %v", err)
	}
	body := fmt.Sprintf(`{"time":%q,"battery_charge_mwh":500,"battery_full_mwh":1000,"battery_rate_mw":0,"ambient_temp_c":20,"water_temp_c":60,"water_level_ml":700}`, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano))
	pr, err := k.cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + k.id.String() + "/measurements", QoS: 1, Payload: []byte(body)})
	if err != nil || pr.ReasonCode >= 0x80 {
		t.Fatalf("MQTT kettle: publish on node 1: %v %+v", err, pr)
	}
	tp.setOverride(t, "http://"+haNet+".21:8080", k.id, 7)
	k.waitCommand(t, 7, 10*time.Second, "MQTT kettle on node 1")
	// Node 2 learns of the kettle from the store (its refresh, every 5 s).
	time.Sleep(6 * time.Second)
	return k
}

// afterNodeKill: node 1 was killed at kill. The kettle's connection ends;
// the operator changes its command meanwhile (through the balancer, so on
// node 2); the kettle reconnects through HAProxy, to node 2, and must get
// the new command there.
func (k *mqttKettle) afterNodeKill(t *testing.T, tp *topo, kill time.Time) {
	t.Helper()
	select {
	case <-k.cl.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("MQTT kettle: its connection to node 1 still up 10 s after node 1 was killed")
	}
	tp.setOverride(t, balancer, k.id, 9)
	var err error
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		err = k.connect(ctx)
		cancel()
		if err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("MQTT kettle: no reconnection through HAProxy within 20 s after node 1 was killed: %v", err)
	}
	defer k.cl.Disconnect(&paho.Disconnect{})
	got := k.waitCommand(t, 9, 15*time.Second, "MQTT kettle reconnected to node 2")
	t.Logf("MQTT kettle: node 1 killed; reconnected through HAProxy to node 2 and got its current command (set while it was away) %.2fs after the kill", got.Sub(kill).Seconds())
	figure(t, "mqtt_command_after_node_kill", got.Sub(kill).Seconds(), "s")
}
