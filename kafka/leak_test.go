package kafka_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/internal/leaktest"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/syncbuf"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/server"
)

// TestNoKafkaSecretLeaks: a front and a writer reach the brokers as their
// users (TLS, SCRAM) and carry readings through the log, a client tries a
// wrong password; then the users' passwords are in none of: the front's
// and writer's log lines (debug level), their /metrics, /readyz and
// /healthz, the wrong client's error, the brokers' files (logs, data,
// configuration but the users' own files), and any process's argv (the
// brokers' java command lines among them).
func TestNoKafkaSecretLeaks(t *testing.T) {
	needKafka(t)
	if !cluster.TLS {
		t.Skip("KAFKA_TLS=0: the nodes run without users")
	}
	s := leaktest.Secrets{}
	for _, u := range []string{kafkatest.Admin, kafkatest.Front, kafkatest.Writer} {
		s["Kafka password of "+u] = cluster.Auth(u).Password
	}
	logs := &syncbuf.Buffer{}
	debug := func(c *server.Config) {
		c.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	tp := topic(t)
	dsn := pgtest.Start(t)
	front := startFront(t, dsn, tp, debug)
	wcfg := baseConfig(t, dsn, tp)
	as(&wcfg, kafkatest.Writer)
	debug(&wcfg)
	w, err := server.StartWriter(context.Background(), wcfg)
	if err != nil {
		t.Fatalf("start writer: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	id := uuid.New()
	at := time.Now().Add(-time.Minute).Truncate(time.Second)
	if st, body, _ := upload(t, front.URL(), id, reading(at, 500)); st != 200 {
		t.Fatalf("upload: %d %s", st, body)
	}

	c := leaktest.Corpus{}
	testkit.WaitFor(t, "the writer stores the reading", 30*time.Second, func() bool {
		res, err := http.Get(w.URL() + "/metrics")
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		return strings.Contains(string(b), "\nkettle_log_written_readings_total 1\n")
	})
	for _, base := range []string{front.URL(), w.URL()} {
		for _, p := range []string{"/metrics", "/readyz", "/healthz"} {
			c.Get(http.DefaultClient, base+p)
		}
	}
	// A client with a wrong password: its error, whatever it says.
	wrong := cluster.Target(tp, kafkatest.Front)
	wrong.Auth.Password = "wrong-" + uuid.NewString()
	err = ping(context.Background(), wrong)
	if err == nil {
		t.Fatal("a client with a wrong password was answered")
	}
	c.Add("the wrong password's client", err.Error())
	c.Add("front and writer logs", logs.String())
	c.Files(cluster.Dir, func(p string) bool {
		// The users' own files: their passwords, by design (0600).
		return filepath.Base(filepath.Dir(p)) == "users"
	})
	c.Argv()
	c.Check(t, s, 20)
}
