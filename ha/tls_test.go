package ha_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kettlefleet/kettlefleet"
)

// checkTLS holds the topology's links to TLS (docs/security.md): plain TCP
// refused by PostgreSQL (hostssl only) and by Patroni's REST API, etcd
// refusing a client without a certificate, kettles served over TLS by the
// balancer (HTTPS, MQTT), every standby streaming over TLS; then renews a standby's certificate (cluster.sh renew-cert) and sees
// the member present the new one to a new client, which trusts it through
// the CA, without a restart.
func checkTLS(tp *topo) {
	t := tp.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pw := tp.pw
	ca := tp.dir + "/tls/ca.crt"

	plain := fmt.Sprintf("postgres://kettle:%s@%s.11:5432/kettle?connect_timeout=2&sslmode=disable", pw, haNet)
	if c, err := pgconn.Connect(ctx, plain); err == nil {
		c.Close(ctx)
		t.Errorf("PostgreSQL took a plain TCP connection (sslmode=disable)")
	} else if !strings.Contains(err.Error(), "no encryption") {
		t.Errorf("PostgreSQL refused a plain connection, but not for its lack of TLS: %v", err)
	}
	if r, err := http.Get(fmt.Sprintf("http://%s.11:8008/cluster", haNet)); err == nil {
		r.Body.Close()
		t.Errorf("Patroni's REST API answered plain HTTP: %d", r.StatusCode)
	}
	if r, err := tp.client().Get(fmt.Sprintf("https://%s.1:2379/health", haNet)); err == nil {
		r.Body.Close()
		t.Errorf("etcd answered a client without a certificate: %d", r.StatusCode)
	}
	// Kettles over TLS through the balancer: HTTPS on 8443, MQTT on 8883.
	if r, err := tp.client().Get(fmt.Sprintf("https://%s.30:8443/readyz", haNet)); err != nil || r.StatusCode != 200 {
		t.Errorf("HTTPS through HAProxy: %v %v", r, err)
	} else {
		r.Body.Close()
	}
	if err := mqttOverTLS(tp, fmt.Sprintf("%s.30:8883", haNet)); err != nil {
		t.Errorf("MQTT over TLS through HAProxy: %v", err)
	}
	if got := tp.must(10*time.Second, "psql", "-c", "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid) WHERE s.ssl"); got != "2" {
		t.Errorf("standbys streaming over TLS: %s, want 2", got)
	}

	// The renewal, on a standby: a new key and certificate, in force for
	// the next connection.
	member := "pg1"
	if tp.leader() == member {
		member = "pg2"
	}
	i := member[2:]
	before := serialOf(t, tp.readFile("tls/"+member+".crt"))
	tp.must(30*time.Second, "renew-cert", member)
	after := serialOf(t, tp.readFile("tls/"+member+".crt"))
	if after == before {
		t.Fatalf("renew-cert %s: the certificate's serial is still %s", member, before)
	}
	dsn := fmt.Sprintf("postgres://kettle:%s@%s.1%s:5432/kettle?connect_timeout=2&sslmode=verify-full&sslrootcert=%s", pw, haNet, i, ca)
	var served string
	for end := time.Now().Add(30 * time.Second); served != after && time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		c, err := pgconn.Connect(ctx, dsn)
		if err != nil {
			t.Fatalf("verify-full to %s after renew-cert: %v", member, err)
		}
		if tc, ok := c.Conn().(*tls.Conn); ok {
			served = tc.ConnectionState().PeerCertificates[0].SerialNumber.Text(16)
		}
		c.Close(ctx)
	}
	if served != after {
		t.Errorf("%s serves the certificate %s after renew-cert, want the new %s", member, served, after)
	}
	served = ""
	var restErr error
	for end := time.Now().Add(30 * time.Second); served != after && time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		// Patroni reopens its REST listener to take the new files up: a
		// connection in that moment is reset, the next one is answered.
		r, err := tp.client().Get(patroni(int(i[0]-'0'), "/health"))
		if restErr = err; err != nil {
			continue
		}
		r.Body.Close()
		served = r.TLS.PeerCertificates[0].SerialNumber.Text(16)
	}
	if served != after {
		t.Errorf("Patroni's REST API of %s serves %s after renew-cert, want the new %s (last error: %v)", member, served, after, restErr)
	}
	tp.waitHealthy(time.Minute)
}

// mqttOverTLS connects a kettle to addr over TLS (the topology's CA) and
// returns nil once its CONNECT is accepted.
func mqttOverTLS(tp *topo, addr string) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM([]byte(tp.readFile("tls/ca.crt")))
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{RootCAs: pool})
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	id := uuid.New()
	connect := &packets.Connect{ProtocolName: "MQTT", ProtocolVersion: 5, Properties: &packets.Properties{}, ClientID: id.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken([]byte(tp.readFile("secret")), id))}
	if _, err := connect.WriteTo(c); err != nil {
		return err
	}
	cp, err := packets.ReadPacket(c)
	if err != nil {
		return fmt.Errorf("connack: %w", err)
	}
	if ack, ok := cp.Content.(*packets.Connack); !ok || ack.ReasonCode != 0 {
		return fmt.Errorf("connect not accepted: %v", cp.Content)
	}
	return nil
}

// serialOf is a PEM certificate's serial number, hex.
func serialOf(t interface{ Fatalf(string, ...any) }, p string) string {
	b, _ := pem.Decode([]byte(p))
	if b == nil {
		t.Fatalf("no PEM certificate")
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return c.SerialNumber.Text(16)
}
