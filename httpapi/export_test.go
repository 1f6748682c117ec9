package httpapi

// DecodeV1General is DecodeV1 without its fast path, for the differential
// fuzz test.
var DecodeV1General = decodeV1

// FastV1 is DecodeV1's fast path alone.
var FastV1 = fastV1
