package kafka

import (
	"crypto/tls"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/kettlefleet/kettlefleet/internal/tlscert"
)

// Auth is how a client of the log checks the brokers and proves itself to
// them: TLS with the brokers' certificates checked against CA (their
// address in the certificate), SASL/SCRAM-SHA-512 as User. The brokers'
// ACLs give each user its part: fronts produce, writers consume and commit
// in their group (deploy/kafka/kafka.sh).
type Auth struct {
	CA       string // PEM file of the CA the brokers' certificates are checked against; empty: plain TCP
	User     string // SASL/SCRAM-SHA-512 user; empty: no SASL
	Password string
}

// opts are the client options of a.
func (a Auth) opts() ([]kgo.Opt, error) {
	var o []kgo.Opt
	if a.CA != "" {
		pool, err := tlscert.Pool("--log-ca", a.CA)
		if err != nil {
			return nil, err
		}
		// franz-go sets ServerName to the host of each broker it dials:
		// every broker's certificate is checked against its own address.
		o = append(o, kgo.DialTLSConfig(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}))
	}
	switch {
	case a.User != "" && a.Password == "":
		return nil, fmt.Errorf("--log-user %s: --log-password (or --log-password-file) is required with it", a.User)
	case a.User == "" && a.Password != "":
		return nil, fmt.Errorf("--log-password: --log-user is required with it")
	case a.User != "":
		o = append(o, kgo.SASL(scram.Auth{User: a.User, Pass: a.Password}.AsSha512Mechanism()))
	}
	return o, nil
}

// ClientOpts are the options of a client of t: its brokers, TLS and SASL
// (Auth), then extra.
func (t Target) ClientOpts(extra ...kgo.Opt) ([]kgo.Opt, error) {
	o, err := t.Auth.opts()
	if err != nil {
		return nil, err
	}
	return append(append([]kgo.Opt{kgo.SeedBrokers(t.Brokers...)}, o...), extra...), nil
}

// NewClient is a client of t with extra options.
func (t Target) NewClient(extra ...kgo.Opt) (*kgo.Client, error) {
	o, err := t.ClientOpts(extra...)
	if err != nil {
		return nil, err
	}
	return kgo.NewClient(o...)
}
