package ha_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// checkTLS holds the topology's links to TLS (docs/security.md): plain TCP
// refused by PostgreSQL (hostssl only) and by Patroni's REST API, etcd
// refusing a client without a certificate, every standby streaming over
// TLS; then renews a standby's certificate (cluster.sh renew-cert) and sees
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
	for end := time.Now().Add(30 * time.Second); served != after && time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		r, err := tp.client().Get(patroni(int(i[0]-'0'), "/health"))
		if err != nil {
			t.Fatalf("Patroni's REST API of %s after renew-cert: %v", member, err)
		}
		r.Body.Close()
		served = r.TLS.PeerCertificates[0].SerialNumber.Text(16)
	}
	if served != after {
		t.Errorf("Patroni's REST API of %s serves %s after renew-cert, want the new %s", member, served, after)
	}
	tp.waitHealthy(time.Minute)
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
