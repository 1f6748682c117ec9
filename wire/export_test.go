package wire

import "github.com/kettlefleet/kettlefleet"

// DecodeV1General is DecodeV1 without its fast path, for the differential
// tests.
var DecodeV1General = decodeV1

// FastV1 is DecodeV1's fast path alone.
func FastV1(body []byte, dev kettle.DeviceID, win kettle.Window) ([]kettle.Measurement, bool) {
	return fastV1(body, dev, win, nil)
}

var ParseUTC = parseUTC
