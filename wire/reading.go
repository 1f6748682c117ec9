// Package wire is how kettles and the server speak: readings in the
// case-study (v0) and v1 JSON (decode, the fast v1 path, encode), commands
// and error bodies. The HTTP and MQTT adapters and the simulator all go
// through it, so a kettle, the server and the lab cannot disagree on a byte.
package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	gojson "github.com/goccy/go-json"

	"github.com/kettlefleet/kettlefleet"
)

// V0Reading is the case-study firmware's body. "id" is ignored.
type V0Reading struct {
	Time    *string  `json:"time"`
	Charge  *float64 `json:"charge_now"`
	Full    *float64 `json:"charge_full"`
	Rate    *float64 `json:"charge_rate"`
	Ambient *float64 `json:"ambient_temp"`
	Water   *float64 `json:"water_temp"`
	Level   *float64 `json:"water_level"`
}

// V1Reading is one reading in the v1 API and MQTT payloads.
type V1Reading struct {
	Time    *string  `json:"time"`
	Charge  *float64 `json:"battery_charge_mwh"`
	Full    *float64 `json:"battery_full_mwh"`
	Rate    *float64 `json:"battery_rate_mw"`
	Ambient *float64 `json:"ambient_temp_c"`
	Water   *float64 `json:"water_temp_c"`
	Level   *float64 `json:"water_level_ml"`
}

type wireFields struct {
	time                                    *string
	charge, full, rate, ambient, water, lvl *float64
}

func (v *V0Reading) fields() wireFields {
	return wireFields{v.Time, v.Charge, v.Full, v.Rate, v.Ambient, v.Water, v.Level}
}

func (v *V1Reading) fields() wireFields {
	return wireFields{v.Time, v.Charge, v.Full, v.Rate, v.Ambient, v.Water, v.Level}
}

// toMeasurement checks presence, parses the time, validates ranges and
// appends field errors. The result is normalized (UTC, µs).
func (w wireFields) toMeasurement(dev kettle.DeviceID, win kettle.Window, names *kettle.FieldNames, prefix string, errs []kettle.FieldError) (kettle.Measurement, []kettle.FieldError) {
	m := kettle.Measurement{Device: dev}
	n0 := len(errs)
	missing := func(field string) {
		errs = append(errs, kettle.FieldError{Field: prefix + field, Message: "required"})
	}
	if w.time == nil {
		missing(names.Time)
	} else if t, err := time.Parse(time.RFC3339Nano, *w.time); err != nil {
		errs = append(errs, kettle.FieldError{Field: prefix + names.Time, Message: fmt.Sprintf("must be an RFC 3339 time such as 2026-11-22T14:02:10.5Z, got %q", Truncate(*w.time, 64))})
	} else {
		m.Time = t
	}
	get := func(p *float64, field string, dst *float64) {
		if p == nil {
			missing(field)
			return
		}
		*dst = *p
	}
	get(w.charge, names.Charge, &m.ChargeMWh)
	get(w.full, names.Full, &m.FullMWh)
	get(w.rate, names.Rate, &m.RateMW)
	get(w.ambient, names.Ambient, &m.AmbientC)
	get(w.water, names.Water, &m.WaterC)
	get(w.lvl, names.Level, &m.LevelML)
	if len(errs) > n0 {
		return m, errs
	}
	m.Normalize()
	return m, m.Validate(win, names, prefix, errs)
}

// Truncate shortens s to n bytes and an ellipsis, for quoting a client's
// value in an error message without echoing a whole body back.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// JSONError turns an encoding/json (or goccy/go-json) error into a 400
// naming the field (prefix goes before the field's name).
func JSONError(err error, prefix string) error {
	typeErr := func(field, value, kind string) error {
		if field == "" {
			field = "body"
		}
		msg := fmt.Sprintf("must be a %s, got %s", jsonKind(kind), value)
		if value == "number" || strings.HasPrefix(value, "number ") {
			msg = fmt.Sprintf("must be a finite number representable as float64, got %s", value)
		}
		return &kettle.Error{Code: kettle.EInvalid, Message: "invalid measurement", Fields: []kettle.FieldError{{Field: prefix + field, Message: msg}}}
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return typeErr(te.Field, te.Value, te.Type.Kind().String())
	}
	var gte *gojson.UnmarshalTypeError
	if errors.As(err, &gte) {
		return typeErr(gte.Field, gte.Value, gte.Type.Kind().String())
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return &kettle.Error{Code: kettle.EInvalid, Message: fmt.Sprintf("malformed JSON at byte %d: %v", se.Offset, se)}
	}
	var gse *gojson.SyntaxError
	if errors.As(err, &gse) {
		return &kettle.Error{Code: kettle.EInvalid, Message: fmt.Sprintf("malformed JSON at byte %d: %v", gse.Offset, gse)}
	}
	return &kettle.Error{Code: kettle.EInvalid, Message: fmt.Sprintf("malformed JSON: %v", err)}
}

// decodeReadings decodes a measurement body on the ingest hot path with
// goccy/go-json (about 4× encoding/json's speed on these flat objects;
// same semantics: trailing data, depth and type errors are errors).
func decodeReadings(body []byte, v any) error {
	if !utf8.Valid(body) {
		return kettle.Errorf(kettle.EInvalid, "body is not valid UTF-8")
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return kettle.Errorf(kettle.EInvalid, "empty body; send a JSON object")
	}
	return unmarshal(body, v)
}

// decoder is the JSON decoder of untrusted bodies (a variable for the
// test of unmarshal's recover).
var decoder = gojson.Unmarshal

// DecoderPanics counts bodies whose decoding panicked (refused as invalid).
var DecoderPanics atomic.Int64

// unmarshal decodes with decoder and turns a panic of the decoder into a
// refusal: goccy/go-json has open reports of panics on malformed input,
// and one kettle's bytes must not take a node down. The body is refused as
// invalid (400, or an MQTT message dropped and counted) and counted in
// DecoderPanics.
func unmarshal(body []byte, v any) (err error) {
	defer func() {
		if r := recover(); r != nil {
			DecoderPanics.Add(1)
			err = &kettle.Error{Code: kettle.EInvalid, Message: "malformed JSON: the body could not be decoded"}
		}
	}()
	if err := decoder(body, v); err != nil {
		return JSONError(err, "")
	}
	return nil
}

func jsonKind(k string) string {
	switch k {
	case "ptr", "float64":
		return "number"
	case "string":
		return "string"
	case "slice":
		return "array"
	case "struct":
		return "object"
	}
	return k
}

// DecodeV0 decodes and validates a case-study POST /measurement body.
func DecodeV0(body []byte, dev kettle.DeviceID, win kettle.Window) (kettle.Measurement, error) {
	var v V0Reading
	if err := decodeReadings(body, &v); err != nil {
		return kettle.Measurement{}, err
	}
	m, errs := v.fields().toMeasurement(dev, win, &kettle.V0Names, "", nil)
	if len(errs) > 0 {
		return m, &kettle.Error{Code: kettle.EInvalid, Message: "invalid measurement", Fields: errs}
	}
	return m, nil
}

// DecodeV1 decodes and validates a v1 upload: one reading or an array of up
// to kettle.MaxBatch. Field names in errors of an array are prefixed "[i].".
func DecodeV1(body []byte, dev kettle.DeviceID, win kettle.Window) ([]kettle.Measurement, error) {
	return DecodeV1Into(nil, body, dev, win)
}

// DecodeV1Into is DecodeV1 into dst's memory when it is large enough (a
// pooled buffer on the ingest hot path).
func DecodeV1Into(dst []kettle.Measurement, body []byte, dev kettle.DeviceID, win kettle.Window) ([]kettle.Measurement, error) {
	if ms, ok := fastV1(body, dev, win, dst); ok {
		return ms, nil
	}
	return decodeV1(body, dev, win)
}

// decodeV1 is DecodeV1 the general way: any JSON, every error named.
func decodeV1(body []byte, dev kettle.DeviceID, win kettle.Window) ([]kettle.Measurement, error) {
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	if len(trimmed) > 0 && trimmed[0] == '[' {
		var vs []V1Reading
		if err := decodeReadings(body, &vs); err != nil {
			return nil, err
		}
		if len(vs) > kettle.MaxBatch {
			return nil, &kettle.Error{Code: kettle.EInvalid, Message: "batch too large", Fields: []kettle.FieldError{{Field: "batch", Message: fmt.Sprintf("at most %d readings per upload, got %d; split it", kettle.MaxBatch, len(vs))}}}
		}
		if len(vs) == 0 {
			return nil, &kettle.Error{Code: kettle.EInvalid, Message: "empty batch", Fields: []kettle.FieldError{{Field: "batch", Message: "must hold at least one reading"}}}
		}
		ms := make([]kettle.Measurement, len(vs))
		var errs []kettle.FieldError
		for i := range vs {
			ms[i], errs = vs[i].fields().toMeasurement(dev, win, &kettle.V1Names, fmt.Sprintf("[%d].", i), errs)
		}
		if len(errs) > 0 {
			return nil, &kettle.Error{Code: kettle.EInvalid, Message: "invalid measurements", Fields: errs}
		}
		return ms, nil
	}
	var v V1Reading
	if err := decodeReadings(body, &v); err != nil {
		return nil, err
	}
	m, errs := v.fields().toMeasurement(dev, win, &kettle.V1Names, "", nil)
	if len(errs) > 0 {
		return nil, &kettle.Error{Code: kettle.EInvalid, Message: "invalid measurement", Fields: errs}
	}
	return []kettle.Measurement{m}, nil
}
