package mqttapi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
	"github.com/kettlefleet/kettlefleet/wire"
)

// ConsumerConfig configures external-broker mode (DefaultConsumerConfig).
type ConsumerConfig struct {
	// BrokerURL is the broker, e.g. tcp://host:1883, mqtt://…, tls://… or
	// mqtts://… (TLS, the broker's certificate checked against CAFile).
	BrokerURL string
	// CAFile is a PEM file of the certificates that may sign a TLS
	// broker's (empty: the system's roots).
	CAFile string
	// ClientID must be unique per kettle node and stable across its restarts
	// (the broker keeps its session, and redelivers what was not
	// acknowledged). Empty: "kettle-" + hostname.
	ClientID string
	// Share is the shared-subscription group: every node
	// of one fleet uses the same group, so each message goes to one node.
	Share string
	// Username and Password are this node's credentials at the broker
	// (needs read on kettles/+/measurements, write on kettles/+/command).
	Username string
	Password string
	// InFlight is how many unacknowledged messages the broker may send this
	// node (MQTT 5 Receive Maximum, at most 65535). Each waits for its commit.
	InFlight int
	// SessionExpiry is how long the broker keeps this node's session while
	// it is disconnected.
	SessionExpiry time.Duration
	// KeepAlive is the MQTT keepalive with the broker.
	KeepAlive time.Duration
	// CommandTick is how often due time-driven command changes are checked.
	CommandTick time.Duration
}

// DefaultConsumerConfig holds external-broker mode's defaults (ClientID's
// is computed: "kettle-" + hostname); a zero field takes its value.
func DefaultConsumerConfig() ConsumerConfig {
	return ConsumerConfig{Share: "kettle", InFlight: 1000, SessionExpiry: time.Hour, KeepAlive: 30 * time.Second, CommandTick: time.Second}
}

func (c *ConsumerConfig) defaults() {
	d := DefaultConsumerConfig()
	if c.ClientID == "" {
		h, _ := os.Hostname()
		c.ClientID = "kettle-" + h
	}
	if c.Share == "" {
		c.Share = d.Share
	}
	if c.InFlight <= 0 {
		c.InFlight = d.InFlight
	}
	c.InFlight = min(c.InFlight, 65535)
	if c.SessionExpiry <= 0 {
		c.SessionExpiry = d.SessionExpiry
	}
	if c.KeepAlive <= 0 {
		c.KeepAlive = d.KeepAlive
	}
	if c.CommandTick <= 0 {
		c.CommandTick = d.CommandTick
	}
}

// Consumer is kettle serve consuming measurements from an external broker.
type Consumer struct {
	cfg      ConsumerConfig
	cm       *autopaho.ConnectionManager
	svc      Consumed
	push     *pusher
	counters *Counters
	log      *slog.Logger
	ctx      context.Context
	cancel   context.CancelFunc
	sem      chan struct{} // bounds messages waiting for commit
	wg       sync.WaitGroup
	badLog   logthin.Limiter // invalid messages: a few lines a second
}

// Consume connects to cfg.BrokerURL (retrying in the background until Close)
// and consumes $share/{Share}/kettles/+/measurements. It returns at once;
// AwaitConnection waits for the first connection. secret is unused: in this
// mode the broker authenticates devices (see the package doc).
func Consume(ctx context.Context, cfg ConsumerConfig, svc Consumed, secret []byte, log *slog.Logger) (*Consumer, error) {
	cfg.defaults()
	u, err := url.Parse(cfg.BrokerURL)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("--mqtt-broker %q: want a URL such as tcp://host:1883", cfg.BrokerURL)
	}
	var tlsCfg *tls.Config
	if cfg.CAFile != "" {
		pem, err := os.ReadFile(cfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("--mqtt-broker-ca: %w", err)
		}
		tlsCfg = &tls.Config{RootCAs: x509.NewCertPool(), MinVersion: tls.VersionTLS12}
		if !tlsCfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--mqtt-broker-ca %s: no PEM certificate in it", cfg.CAFile)
		}
		switch u.Scheme {
		case "tls", "ssl", "mqtts", "mqtt+ssl", "tcps":
		default:
			return nil, fmt.Errorf("--mqtt-broker-ca is for a TLS broker: write --mqtt-broker as tls://%s", u.Host)
		}
	}
	c := &Consumer{cfg: cfg, svc: svc, counters: new(Counters), log: log, sem: make(chan struct{}, cfg.InFlight)}
	c.ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
	filter := "$share/" + cfg.Share + "/kettles/+/measurements"
	rm := uint16(cfg.InFlight)
	pc := autopaho.ClientConfig{
		ServerUrls:                    []*url.URL{u},
		TlsCfg:                        tlsCfg,
		KeepAlive:                     uint16(cfg.KeepAlive / time.Second),
		CleanStartOnInitialConnection: false,
		SessionExpiryInterval:         uint32(cfg.SessionExpiry / time.Second),
		ReconnectBackoff: func(n int) time.Duration {
			return min(time.Duration(1<<min(n, 5))*100*time.Millisecond, 5*time.Second)
		},
		ConnectUsername: cfg.Username,
		ConnectPassword: []byte(cfg.Password),
		ConnectPacketBuilder: func(p *paho.Connect, _ *url.URL) (*paho.Connect, error) {
			if p.Properties == nil {
				p.Properties = &paho.ConnectProperties{}
			}
			p.Properties.ReceiveMaximum = &rm
			return p, nil
		},
		OnConnectionUp: func(cm *autopaho.ConnectionManager, _ *paho.Connack) {
			c.counters.Connections.Store(1)
			log.Info("mqtt: connected to broker", "broker", cfg.BrokerURL, "client_id", cfg.ClientID, "subscription", filter)
			go func() { // must not block OnConnectionUp
				sctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
				defer cancel()
				if _, err := cm.Subscribe(sctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}}); err != nil {
					log.Error("mqtt: subscribe failed; reconnecting", "filter", filter, "err", err)
				}
			}()
		},
		OnConnectionDown: func() bool {
			c.counters.Connections.Store(0)
			log.Warn("mqtt: connection to broker lost; reconnecting", "broker", cfg.BrokerURL)
			return true
		},
		OnConnectError: func(err error) {
			log.Warn("mqtt: cannot connect to broker; retrying", "broker", cfg.BrokerURL, "err", err)
		},
		ClientConfig: paho.ClientConfig{
			ClientID:                   cfg.ClientID,
			EnableManualAcknowledgment: true,
			SendAcksInterval:           5 * time.Millisecond,
			OnPublishReceived:          []func(paho.PublishReceived) (bool, error){c.received},
		},
	}
	c.push = newPusher(svc, log, c.counters, cfg.CommandTick, true, c.publishCommand)
	c.cm, err = autopaho.NewConnection(c.ctx, pc)
	if err != nil {
		c.cancel()
		return nil, fmt.Errorf("mqtt: connect to %s: %w", cfg.BrokerURL, err)
	}
	go c.push.run(c.ctx)
	return c, nil
}

// AwaitConnection waits until the consumer is connected to the broker.
func (c *Consumer) AwaitConnection(ctx context.Context) error { return c.cm.AwaitConnection(ctx) }

// Counters are the adapter's counts, for metrics.
func (c *Consumer) Counters() *Counters { return c.counters }

// Close stops consuming: messages already handed to ingest commit and are
// acknowledged first; anything else stays unacknowledged at the broker,
// which redelivers it to this session or another member of the share.
func (c *Consumer) Close() error {
	c.cancel() // ends the retry loops of messages waiting for queue room
	c.wg.Wait()
	<-c.push.done
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := c.cm.Disconnect(ctx)
	c.log.Info("mqtt consumer stopped", "counters", c.counters.Snapshot())
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	return err
}

// received runs on paho's single routing goroutine: it validates, then hands
// the message to a goroutine that waits for its commit and acknowledges it.
// c.sem bounds those goroutines; when it is full, routing (and so reading
// from the broker) waits.
func (c *Consumer) received(pr paho.PublishReceived) (bool, error) {
	p := pr.Packet
	qos := p.QoS
	c.counters.Publishes[min(int(qos), 2)].Add(1)
	id, ok := deviceFromTopic(p.Topic)
	if !ok {
		c.counters.Invalid.Add(1)
		if ok, skipped := c.badLog.Allow(time.Now()); ok {
			c.log.Warn("mqtt: message on an unexpected topic dropped", "topic", truncate(p.Topic, 128), "invalid_not_logged_since_last_line", skipped)
		}
		c.ack(pr)
		return true, nil
	}
	ms, err := wire.DecodeV1(p.Payload, id, c.svc.Window())
	if err != nil {
		c.counters.Invalid.Add(1)
		if ok, skipped := c.badLog.Allow(time.Now()); ok {
			c.log.Warn("mqtt: invalid measurement payload dropped", "device", id, "qos", qos, "err", truncate(err.Error(), maxLoggedError), "invalid_not_logged_since_last_line", skipped)
		}
		c.ack(pr) // it will never become valid: acknowledge so the broker does not redeliver
		return true, nil
	}
	select {
	case c.sem <- struct{}{}:
	case <-c.ctx.Done():
		return true, nil
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer func() { <-c.sem }()
		if c.ingest(ms, qos) {
			c.ack(pr)
		}
	}()
	return true, nil
}

// ingest stores ms, retrying while ingest is unavailable (QoS ≥ 1) until
// Close. It reports whether the readings are committed.
func (c *Consumer) ingest(ms []kettle.Measurement, qos byte) bool {
	withheld := false
	retry := ingestBackoff()
	for {
		_, _, err := c.svc.Ingest(c.ctx, ms)
		if err == nil {
			c.counters.Readings.Add(int64(len(ms)))
			return true
		}
		if qos == 0 {
			c.counters.Dropped.Add(1)
			return false
		}
		if !withheld {
			withheld = true
			c.counters.Withheld.Add(1)
		}
		if !retry.Wait(c.ctx, retryAfter(err)) {
			c.counters.Unacked.Add(1)
			return false
		}
	}
}

func (c *Consumer) ack(pr paho.PublishReceived) {
	if pr.Packet.QoS == 0 {
		return
	}
	if err := pr.Client.Ack(pr.Packet); err != nil {
		// The connection it came on is gone; the broker redelivers it and
		// the store keeps one copy.
		c.log.Debug("mqtt: ack after reconnect ignored", "err", err)
	}
}

// publishCommand publishes a device's command retained, QoS 1, through the
// broker.
func (c *Consumer) publishCommand(id kettle.DeviceID, body []byte) error {
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
	defer cancel()
	_, err := c.cm.Publish(ctx, &paho.Publish{Topic: CommandTopic(id), QoS: 1, Retain: true, Payload: body})
	return err
}

// deviceFromTopic parses kettles/{id}/measurements.
func deviceFromTopic(topic string) (kettle.DeviceID, bool) {
	rest, ok := strings.CutPrefix(topic, "kettles/")
	if !ok {
		return uuid.Nil, false
	}
	idPart, ok := strings.CutSuffix(rest, "/measurements")
	if !ok || len(idPart) != 36 {
		return uuid.Nil, false
	}
	id, err := uuid.Parse(idPart)
	return id, err == nil
}
