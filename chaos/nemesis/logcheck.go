package nemesis

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/kafka"
)

type rowKey struct {
	dev uuid.UUID
	us  int64
}

// ReadLog checks the readings log against the stored rows: with --log a
// reading reaches the database only through the topic, and the swarms'
// audits show every acknowledged reading stored, so a stored row that is
// not in the topic is a hole in the log (an acknowledged reading the log
// does not hold). It reads the whole topic from its start up to the end
// offsets of now (the topic of log, reached with its Auth), and every row of
// the database at dsn.
func ReadLog(ctx context.Context, log kafka.Target, dsn string) (*LogAudit, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	topic := log.Topic
	cl, err := log.NewClient(kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return nil, fmt.Errorf("readings log: %w", err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("readings log: end offsets of %s: %w", topic, err)
	}
	want := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
		}
	})
	inLog := map[rowKey]bool{}
	var buf []kettle.Measurement
	for len(want) > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("readings log: %d partitions not read to their end within 5 minutes", len(want))
		}
		fs.EachRecord(func(r *kgo.Record) {
			if r.Offset+1 >= want[r.Partition] {
				delete(want, r.Partition)
			}
			buf, _, err = kafka.Decode(r, buf[:0])
			if err != nil {
				return // the writer skips it too; the rows say whether it mattered
			}
			for _, m := range buf {
				inLog[rowKey{m.Device, m.Time.UnixMicro()}] = true
			}
		})
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("readings log: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, _ := conn.Query(ctx, `SELECT device, t FROM measurements`)
	a := &LogAudit{}
	for rows.Next() {
		var k rowKey
		var t time.Time
		if err := rows.Scan(&k.dev, &t); err != nil {
			return nil, fmt.Errorf("readings log: rows: %w", err)
		}
		k.us = t.UnixMicro()
		a.Acked++
		if inLog[k] {
			a.Found++
		} else {
			a.Missing++
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("readings log: rows: %w", err)
	}
	return a, nil
}
