package systemd_test

import (
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestWriterUnit: kettle-writer.service with a real readings log (three
// Kafka nodes, deploy/kafka) and a real PostgreSQL, the database password
// in a passfile given as a credential: READY=1 once it consumes, /readyz
// 200 on its metrics address, STOPPING=1 and exit 0 on SIGTERM.
func TestWriterUnit(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("runs the service as another user, as systemd does: run the tests as root (make test)")
	}
	dsn := pgtest.Start(t)
	// The throwaway cluster listens on a Unix socket in its directory: let
	// the service's user reach it, as a real database is reachable over TCP.
	host := dsnHost(dsn)
	if host != "" && strings.HasPrefix(host, "/") {
		os.Chmod(host, 0o711)
	}
	dir, err := os.MkdirTemp("", "kettle-unit-kafka-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// Addresses of their own: the kafka package's tests use kafka.sh's.
	kc, err := kafkatest.Start(dir, kafkatest.Options{Hosts: []string{"127.0.55.1", "127.0.55.2", "127.0.55.3"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kc.Stop() })

	etc := t.TempDir()
	addr := testkit.FreeAddr(t)
	// The brokers as kafka.sh brings them up: TLS and SCRAM, the writer
	// reaching them as its user, its secrets as the unit's credentials.
	if !kc.TLS {
		t.Fatal("kafka.sh came up without TLS: the unit is written for its default (KAFKA_TLS=1)")
	}
	auth := kc.Auth(kafkatest.Writer)
	ca, err := os.ReadFile(auth.CA)
	if err != nil {
		t.Fatal(err)
	}
	writeFiles(t, etc, map[string]string{
		"pgpass":         "*:*:*:*:unused-under-trust\n",
		"kafka-ca.crt":   string(ca),
		"kafka-password": auth.Password + "\n",
		"writer.env": "KETTLE_ADDR=" + addr + "\nKETTLE_LOG=" + kc.URL("kettle.readings") + "\nKETTLE_LOG_USER=" + kafkatest.Writer +
			"\nKETTLE_DB=" + dsn + "\n",
	})
	s := systemdRun(t, "kettle-writer.service", etc)
	s.await(t, "READY=1", 2*time.Minute)
	if code, body, err := get("http://"+addr+"/readyz", ""); err != nil || code != 200 {
		t.Fatalf("/readyz: %d %v %s\n%s", code, err, body, s.out)
	}
	s.stop(t)
}

// dsnHost is the host of a URL or keyword/value DSN.
func dsnHost(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		return u.Query().Get("host") + u.Hostname()
	}
	for _, f := range strings.Fields(dsn) {
		if v, ok := strings.CutPrefix(f, "host="); ok {
			return v
		}
	}
	return ""
}
