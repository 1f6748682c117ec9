// Command kafka-consumer is a starting point for a team that reads the
// kettle readings topic (kettle serve --log) for its own purposes: a data
// lake, analytics, search. It joins its own consumer group (so it never
// takes partitions from the kettle writers), reads each record's schema
// header, decodes version 1 values (docs/kafka.md) and writes one JSON
// line per reading to stdout, committing offsets only after the lines are
// written (at-least-once: dedupe on device + time downstream, as the
// kettle store does).
//
//	go run ./contrib/kafka-consumer --brokers 127.0.46.1:9092,127.0.46.2:9092,127.0.46.3:9092 \
//	    --topic kettle.readings --group my-team --max 100
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// valueV1 is schema "kettle.readings/v1": one upload of one device.
type valueV1 struct {
	V          int       `json:"v"`
	Device     string    `json:"device"`
	ReceivedAt time.Time `json:"received_at"`
	Readings   []struct {
		Time         time.Time `json:"time"`
		ChargeMWh    float64   `json:"battery_charge_mwh"`
		FullMWh      float64   `json:"battery_full_mwh"`
		RateMW       float64   `json:"battery_rate_mw"`
		AmbientTempC float64   `json:"ambient_temp_c"`
		WaterTempC   float64   `json:"water_temp_c"`
		WaterLevelML float64   `json:"water_level_ml"`
	} `json:"readings"`
}

// line is what this example writes per reading: flat, one JSON object.
type line struct {
	Device       string    `json:"device"`
	Time         time.Time `json:"time"`
	ReceivedAt   time.Time `json:"received_at"`
	ChargeMWh    float64   `json:"battery_charge_mwh"`
	FullMWh      float64   `json:"battery_full_mwh"`
	RateMW       float64   `json:"battery_rate_mw"`
	AmbientTempC float64   `json:"ambient_temp_c"`
	WaterTempC   float64   `json:"water_temp_c"`
	WaterLevelML float64   `json:"water_level_ml"`
	Partition    int32     `json:"partition"`
	Offset       int64     `json:"offset"`
}

func main() {
	brokers := flag.String("brokers", "127.0.46.1:9092,127.0.46.2:9092,127.0.46.3:9092", "bootstrap brokers, comma-separated")
	topic := flag.String("topic", "kettle.readings", "the readings topic (the path of kettle serve --log)")
	group := flag.String("group", "kettle-example-consumer", "this consumer's group: never the writers' (kettle-writers)")
	fromStart := flag.Bool("from-start", true, "a new group starts at the oldest record kept (false: only new ones)")
	maxReadings := flag.Int("max", 0, "stop after this many readings (0: run until SIGINT/SIGTERM)")
	flag.Parse()
	if *group == "kettle-writers" {
		log.Fatal("--group kettle-writers is the kettle writers' group: joining it would take partitions from them; choose your own")
	}
	start := kgo.NewOffset().AtEnd()
	if *fromStart {
		start = kgo.NewOffset().AtStart()
	}
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(strings.Split(*brokers, ",")...),
		kgo.ConsumerGroup(*group),
		kgo.ConsumeTopics(*topic),
		kgo.ConsumeResetOffset(start),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	n, skipped := 0, 0
	for ctx.Err() == nil && (*maxReadings == 0 || n < *maxReadings) {
		fs := cl.PollRecords(ctx, 1000)
		fs.EachError(func(t string, p int32, err error) {
			if ctx.Err() == nil {
				log.Printf("fetch %s/%d: %v", t, p, err)
			}
		})
		recs := fs.Records()
		for _, r := range recs {
			if schema(r) != "kettle.readings/v1" {
				skipped++ // a newer version: upgrade this consumer to read it
				continue
			}
			var v valueV1
			if err := json.Unmarshal(r.Value, &v); err != nil {
				skipped++
				log.Printf("record %d@%d: %v", r.Partition, r.Offset, err)
				continue
			}
			for _, x := range v.Readings {
				enc.Encode(line{Device: v.Device, Time: x.Time, ReceivedAt: v.ReceivedAt, ChargeMWh: x.ChargeMWh, FullMWh: x.FullMWh,
					RateMW: x.RateMW, AmbientTempC: x.AmbientTempC, WaterTempC: x.WaterTempC, WaterLevelML: x.WaterLevelML,
					Partition: r.Partition, Offset: r.Offset})
				n++
			}
		}
		if err := out.Flush(); err != nil {
			log.Fatal(err)
		}
		// Offsets after the output is written: a crash in between
		// replays, never skips.
		if len(recs) > 0 {
			if err := cl.CommitRecords(context.WithoutCancel(ctx), recs...); err != nil {
				log.Printf("commit offsets: %v (the next start re-reads these records)", err)
			}
		}
		cl.AllowRebalance()
	}
	fmt.Fprintf(os.Stderr, "kafka-consumer: %d readings written, %d records skipped\n", n, skipped)
}

func schema(r *kgo.Record) string {
	for _, h := range r.Headers {
		if h.Key == "schema" {
			return string(h.Value)
		}
	}
	return ""
}
