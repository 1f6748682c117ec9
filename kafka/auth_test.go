package kafka_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kettlefleet/kettlefleet/kafka"
)

// TestAuthRefusesHalfAConfiguration: a user without a password, a password
// without a user, and a CA file that is missing or holds no certificate
// are errors naming the flag, before anything is dialed.
func TestAuthRefusesHalfAConfiguration(t *testing.T) {
	noPEM := filepath.Join(t.TempDir(), "ca.crt")
	os.WriteFile(noPEM, []byte("not a certificate\n"), 0o644)
	for _, c := range []struct {
		auth kafka.Auth
		want string
	}{
		{kafka.Auth{User: "front"}, "--log-password"},
		{kafka.Auth{Password: "p"}, "--log-user"},
		{kafka.Auth{CA: filepath.Join(t.TempDir(), "missing.crt")}, "--log-ca"},
		{kafka.Auth{CA: noPEM}, "no PEM certificate"},
	} {
		_, err := kafka.Target{Brokers: []string{"127.0.0.1:9"}, Topic: "kettle.t", Auth: c.auth}.NewClient()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.auth, err, c.want)
		}
	}
	cl, err := kafka.Target{Brokers: []string{"127.0.0.1:9"}, Topic: "kettle.t", Auth: kafka.Auth{User: "front", Password: "p"}}.NewClient()
	if err != nil {
		t.Fatalf("user and password: %v", err)
	}
	cl.Close()
}
