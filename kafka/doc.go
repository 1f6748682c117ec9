// Package kafka adapts Apache Kafka as kettle serve's readings log
// (kettle serve --log kafka://…): a Producer that front nodes hand validated
// readings to and that returns once the log holds them on at least two
// brokers (acks=all, idempotent, min.insync.replicas 2), a Writer that
// consumes the topic in a consumer group and writes the store in large
// transactions, committing offsets only after the store commit, and a
// Monitor that measures what is not written yet (lag per partition, the age
// of the oldest unwritten reading) and refuses uploads before unwritten
// readings could age out of the topic's retention.
//
// The topic is an interface other systems read: its key, value schema and
// headers are described in docs/kafka.md and encoded in record.go.
package kafka
