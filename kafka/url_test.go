package kafka_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/kafka"
)

func TestParseURL(t *testing.T) {
	f := func(in, wantErr string, wantBrokers int, wantTopic string) {
		t.Helper()
		got, err := kafka.ParseURL(in)
		if wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), wantErr) {
				t.Errorf("ParseURL(%q) = %v, want error containing %q", in, err, wantErr)
			}
			return
		}
		if err != nil || len(got.Brokers) != wantBrokers || got.Topic != wantTopic {
			t.Errorf("ParseURL(%q) = %+v, %v", in, got, err)
		}
		if err == nil && got.String() != in {
			t.Errorf("String() = %q, want %q", got.String(), in)
		}
	}
	f("kafka://h1:9092,h2:9092,h3:9092/kettle.readings", "", 3, "kettle.readings")
	f("kafka://127.0.46.1:9092/t", "", 1, "t")
	f("http://h1:9092/t", "not a kafka:// URL", 0, "")
	f("kafka://h1:9092", "no topic", 0, "")
	f("kafka://h1:9092/", "no topic", 0, "")
	f("kafka://h1/t", `broker "h1" is not host:port`, 0, "")
	f("kafka://h1:9092/a/b", "one name", 0, "")
	f("kafka://h1:9092/a b", "may hold only", 0, "")
}

// TestRecordRoundTrip: what the producer writes, Decode reads back, and a
// record of an unknown schema is refused by name.
func TestRecordRoundTrip(t *testing.T) {
	id := uuid.New()
	at := time.Date(2026, 11, 27, 10, 0, 0, 0, time.UTC)
	rows := []kettle.Measurement{
		{Device: id, Time: at, ChargeMWh: 1.5, FullMWh: 100, RateMW: -2, AmbientC: 21, WaterC: 80.25, LevelML: 700},
		{Device: id, Time: at.Add(time.Second), ChargeMWh: 2, FullMWh: 100, RateMW: 0, AmbientC: -5, WaterC: 4, LevelML: 0},
	}
	r := kafka.NewRecord(rows, at.Add(time.Minute))
	if string(r.Key) != id.String() {
		t.Fatalf("key %q", r.Key)
	}
	got, received, err := kafka.Decode(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !received.Equal(at.Add(time.Minute)) || len(got) != 2 || got[0] != rows[0] || got[1] != rows[1] {
		t.Fatalf("round trip: %+v at %s", got, received)
	}
	r.Headers = []kgo.RecordHeader{{Key: kafka.HeaderSchema, Value: []byte("kettle.readings/v9")}}
	if _, _, err := kafka.Decode(r, nil); err == nil || !strings.Contains(err.Error(), "kettle.readings/v9") {
		t.Fatalf("unknown schema: %v", err)
	}
}
