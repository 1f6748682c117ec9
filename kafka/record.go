package kafka

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
)

// The topic's record format (docs/kafka.md is the reference for consumers):
//
//   - key: the device id as 36-character UUID text, so Kafka's default
//     partitioner (murmur2 of the key) puts each kettle's readings on one
//     partition, in order;
//   - value: one upload of one device, JSON: {"v":1,"device":…,
//     "received_at":…,"readings":[{"time":…,"battery_charge_mwh":…,…}]},
//     reading fields named as in the v1 HTTP API;
//   - headers: "schema" ("kettle.readings/v1") and "content-type"
//     ("application/json"), so a consumer can route on the version without
//     parsing the value;
//   - timestamp: when the front node received the upload (CreateTime).
//
// A new version adds a new "schema" header value and "v"; writers accept
// every version they know and skip (and count) the others.
const (
	// SchemaV1 is the "schema" header of version 1 values.
	SchemaV1 = "kettle.readings/v1"
	// HeaderSchema names the header that carries the value's schema.
	HeaderSchema = "schema"
)

// Value is a record's value: the readings of one device from one upload.
type Value struct {
	V          int           `json:"v"`
	Device     uuid.UUID     `json:"device"`
	ReceivedAt time.Time     `json:"received_at"`
	Readings   []ReadingJSON `json:"readings"`
}

// ReadingJSON is one reading in a value, named as in the v1 HTTP API.
type ReadingJSON struct {
	Time    time.Time `json:"time"`
	Charge  float64   `json:"battery_charge_mwh"`
	Full    float64   `json:"battery_full_mwh"`
	Rate    float64   `json:"battery_rate_mw"`
	Ambient float64   `json:"ambient_temp_c"`
	Water   float64   `json:"water_temp_c"`
	Level   float64   `json:"water_level_ml"`
}

var (
	schemaV1    = []byte(SchemaV1)
	contentJSON = []byte("application/json")
)

// appendValue encodes rows (all of one device) as a version 1 value.
func appendValue(b []byte, rows []kettle.Measurement, received time.Time) []byte {
	b = append(b, `{"v":1,"device":"`...)
	b = append(b, rows[0].Device.String()...)
	b = append(b, `","received_at":"`...)
	b = received.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","readings":[`...)
	num := func(b []byte, name string, f float64) []byte {
		b = append(b, `,"`...)
		b = append(b, name...)
		b = append(b, `":`...)
		return strconv.AppendFloat(b, f, 'g', -1, 64)
	}
	for i := range rows {
		m := &rows[i]
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"time":"`...)
		b = m.Time.UTC().AppendFormat(b, time.RFC3339Nano)
		b = append(b, '"')
		b = num(b, "battery_charge_mwh", m.ChargeMWh)
		b = num(b, "battery_full_mwh", m.FullMWh)
		b = num(b, "battery_rate_mw", m.RateMW)
		b = num(b, "ambient_temp_c", m.AmbientC)
		b = num(b, "water_temp_c", m.WaterC)
		b = num(b, "water_level_ml", m.LevelML)
		b = append(b, '}')
	}
	return append(b, "]}"...)
}

// NewRecord makes the record of one device's readings (all of rows are
// one device's), received being when the front node got them.
func NewRecord(rows []kettle.Measurement, received time.Time) *kgo.Record {
	return &kgo.Record{
		Key:       []byte(rows[0].Device.String()),
		Value:     appendValue(make([]byte, 0, 64+200*len(rows)), rows, received),
		Timestamp: received,
		Headers: []kgo.RecordHeader{
			{Key: HeaderSchema, Value: schemaV1},
			{Key: "content-type", Value: contentJSON},
		},
	}
}

// Decode reads a record of the topic into measurements (appended to dst)
// and the time the front node received them. An unknown schema or a value
// that does not parse is an error naming what is wrong; the caller skips
// such a record (it cannot be written, and retrying does not change it).
func Decode(r *kgo.Record, dst []kettle.Measurement) ([]kettle.Measurement, time.Time, error) {
	schema := ""
	for _, h := range r.Headers {
		if h.Key == HeaderSchema {
			schema = string(h.Value)
		}
	}
	if schema != SchemaV1 {
		return dst, time.Time{}, fmt.Errorf("record %s/%d@%d: schema header %q: this version reads only %q", r.Topic, r.Partition, r.Offset, schema, SchemaV1)
	}
	var v Value
	if err := json.Unmarshal(r.Value, &v); err != nil {
		return dst, time.Time{}, fmt.Errorf("record %s/%d@%d: value: %w", r.Topic, r.Partition, r.Offset, err)
	}
	if v.V != 1 || v.Device == uuid.Nil || len(v.Readings) == 0 {
		return dst, time.Time{}, fmt.Errorf("record %s/%d@%d: value needs v 1, a device and readings", r.Topic, r.Partition, r.Offset)
	}
	for _, x := range v.Readings {
		dst = append(dst, kettle.Measurement{Device: v.Device, Time: x.Time, ChargeMWh: x.Charge, FullMWh: x.Full,
			RateMW: x.Rate, AmbientC: x.Ambient, WaterC: x.Water, LevelML: x.Level})
	}
	return dst, v.ReceivedAt, nil
}
