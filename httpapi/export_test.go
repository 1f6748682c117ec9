package httpapi

import (
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// DecodeV1General is DecodeV1 without its fast path, for the differential
// fuzz test.
var DecodeV1General = decodeV1

// FastV1 is DecodeV1's fast path alone.
func FastV1(body []byte, dev kettle.DeviceID, now time.Time) ([]kettle.Measurement, bool) {
	return fastV1(body, dev, now, nil)
}

var ParseUTC = parseUTC

// WriteJSON is how every JSON answer is written.
var WriteJSON = writeJSON
