package kafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/kafka"
)

// TestACLs holds deploy/kafka's users to their parts: a front produces and
// cannot consume, a writer consumes in its group and cannot produce, a
// wrong password and a client without TLS are refused.
func TestACLs(t *testing.T) {
	needKafka(t)
	if !cluster.TLS {
		t.Skip("KAFKA_TLS=0: the nodes run without users and ACLs")
	}
	topic := topic(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	front, err := cluster.Client(kafkatest.Front, kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	if _, err := kafka.EnsureTopic(ctx, kadm.NewClient(front), topic, kafka.TopicConfig{Partitions: 1}); err != nil {
		t.Fatalf("a front cannot create its topic: %v", err)
	}
	if err := front.ProduceSync(ctx, &kgo.Record{Value: []byte("reading")}).FirstErr(); err != nil {
		t.Fatalf("a front cannot produce: %v", err)
	}
	if err := firstFetchErr(ctx, kafkatest.Front, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())); !errors.Is(err, kerr.TopicAuthorizationFailed) {
		t.Errorf("a front consumed the topic (fetch error %v, want TOPIC_AUTHORIZATION_FAILED)", err)
	}

	writer, err := cluster.Client(kafkatest.Writer, kgo.DefaultProduceTopic(topic), kgo.ConsumeTopics(topic),
		kgo.ConsumerGroup("kettle-writers-"+topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close()
	var got []*kgo.Record
	for len(got) == 0 && ctx.Err() == nil {
		fs := writer.PollFetches(ctx)
		if err := fs.Err0(); err != nil && ctx.Err() == nil {
			t.Fatalf("a writer cannot consume in its group: %v", err)
		}
		got = append(got, fs.Records()...)
	}
	if len(got) != 1 || string(got[0].Value) != "reading" {
		t.Fatalf("the writer read %d records, want the one produced", len(got))
	}
	if err := writer.CommitRecords(ctx, got...); err != nil {
		t.Errorf("a writer cannot commit its group's offsets: %v", err)
	}
	// Refused either at the topic or, first, at the idempotent producer's
	// id (InitProducerID asks for a write permission the writer has nowhere).
	if err := writer.ProduceSync(ctx, &kgo.Record{Value: []byte("forged")}).FirstErr(); !errors.Is(err, kerr.TopicAuthorizationFailed) && !errors.Is(err, kerr.ClusterAuthorizationFailed) {
		t.Errorf("a writer produced to the topic (error %v, want TOPIC_ or CLUSTER_AUTHORIZATION_FAILED)", err)
	}

	wrong := cluster.Target(topic, kafkatest.Front)
	wrong.Auth.Password = "not-the-password"
	if err := ping(ctx, wrong); !errors.Is(err, kerr.SaslAuthenticationFailed) {
		t.Errorf("a wrong password: %v, want SASL_AUTHENTICATION_FAILED", err)
	}
	plain := cluster.Target(topic, kafkatest.Front)
	plain.Auth = kafka.Auth{}
	if err := ping(ctx, plain); err == nil {
		t.Errorf("a client without TLS and SASL was answered")
	}
}

// firstFetchErr polls once as user and returns the first fetch error.
func firstFetchErr(ctx context.Context, user string, opts ...kgo.Opt) error {
	cl, err := cluster.Client(user, opts...)
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		if err := cl.PollFetches(ctx).Err0(); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// ping asks for the brokers' metadata within 10 s as t's Auth.
func ping(ctx context.Context, t kafka.Target) error {
	cl, err := t.NewClient(kgo.RequestRetries(0))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = kadm.NewClient(cl).BrokerMetadata(ctx)
	return err
}
