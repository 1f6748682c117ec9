package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
)

// TopicConfig is how the readings topic is created when it does not exist.
type TopicConfig struct {
	// Partitions bounds how many writers can share the work (one partition
	// is written by one writer at a time).
	Partitions int
	// Retention is the topic's retention.ms: how long Kafka keeps a record
	// whether or not it was written.
	Retention time.Duration
}

// DefaultTopicConfig is how the topic is created when nothing is set; a
// zero field takes its value.
func DefaultTopicConfig() TopicConfig {
	return TopicConfig{Partitions: 12, Retention: 7 * 24 * time.Hour}
}

func (c *TopicConfig) defaults() {
	d := DefaultTopicConfig()
	if c.Partitions <= 0 {
		c.Partitions = d.Partitions
	}
	if c.Retention <= 0 {
		c.Retention = d.Retention
	}
}

// replicationFactor and minInsync make an acks=all write durable on two
// brokers, and writable while one of three is down.
const (
	replicationFactor = 3
	minInsync         = 2
)

// EnsureTopic creates the topic (RF 3, min.insync.replicas 2, the given
// partitions and retention) unless it exists, waiting up to ctx's deadline
// for the brokers to be there, and returns its retention in force (which,
// for a topic that existed, may differ from cfg's).
func EnsureTopic(ctx context.Context, adm *kadm.Client, topic string, cfg TopicConfig) (time.Duration, error) {
	cfg.defaults()
	configs := map[string]*string{
		"min.insync.replicas":            kadm.StringPtr(strconv.Itoa(minInsync)),
		"retention.ms":                   kadm.StringPtr(strconv.FormatInt(cfg.Retention.Milliseconds(), 10)),
		"unclean.leader.election.enable": kadm.StringPtr("false"),
	}
	var last error
	for {
		_, err := adm.CreateTopic(ctx, int32(cfg.Partitions), replicationFactor, configs, topic)
		if err == nil || errors.Is(err, kerr.TopicAlreadyExists) {
			break
		}
		last = err
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("create topic %s (%d partitions, replication factor %d): %w (are three brokers up? deploy/kafka/kafka.sh start DIR)", topic, cfg.Partitions, replicationFactor, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
	for {
		rc, err := adm.DescribeTopicConfigs(ctx, topic)
		if err == nil {
			var ret time.Duration
			_, err = rc.On(topic, func(r *kadm.ResourceConfig) error {
				if r.Err != nil {
					return r.Err
				}
				for _, c := range r.Configs {
					if c.Key == "retention.ms" && c.Value != nil {
						ms, perr := strconv.ParseInt(*c.Value, 10, 64)
						if perr != nil {
							return fmt.Errorf("retention.ms %q: %w", *c.Value, perr)
						}
						ret = time.Duration(ms) * time.Millisecond
					}
				}
				return nil
			})
			if err == nil {
				return ret, nil
			}
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("read topic %s's retention: %w", topic, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
