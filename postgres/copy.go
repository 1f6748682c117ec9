package postgres

import (
	"encoding/binary"
	"io"
	"math"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// copyReader streams measurements in PostgreSQL's binary COPY format, in the
// column order of the measurements table. It encodes straight into the
// driver's buffer: no per-value boxing, no allocation per row.
//
// It is the one encoder of these rows: bench/pgbench's raw-COPY ceiling uses
// it through NewCopyReader, so the ceiling encodes exactly what the store does.
type copyReader struct {
	rows    []kettle.Measurement
	i       int
	header  bool
	trailer bool
}

const (
	copyHeader  = "PGCOPY\n\xff\r\n\x00\x00\x00\x00\x00\x00\x00\x00\x00" // signature, flags, extension length
	copyRowSize = 2 + (4 + 16) + (4 + 8) + 6*(4+8)
	copyColumns = "(device, t, charge_mwh, full_mwh, rate_mw, ambient_c, water_c, level_ml)"
)

// pgEpochMicros is 2000-01-01 UTC in unix microseconds: the origin of
// PostgreSQL's timestamps.
var pgEpochMicros = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()

func newCopyReader(rows []kettle.Measurement) *copyReader { return &copyReader{rows: rows} }

// NewCopyReader returns rows in PostgreSQL's binary COPY format, for
// `COPY table CopyColumns FROM STDIN (FORMAT binary)` into a table shaped
// like measurements.
func NewCopyReader(rows []kettle.Measurement) io.Reader { return newCopyReader(rows) }

// CopyColumns is the column list of a COPY fed by NewCopyReader.
const CopyColumns = copyColumns

func (r *copyReader) Read(p []byte) (int, error) {
	n := 0
	if !r.header {
		if len(p) < len(copyHeader) {
			return 0, io.ErrShortBuffer
		}
		n += copy(p, copyHeader)
		r.header = true
	}
	for r.i < len(r.rows) && len(p)-n >= copyRowSize {
		encodeRow(p[n:n+copyRowSize], &r.rows[r.i])
		n += copyRowSize
		r.i++
	}
	if r.i == len(r.rows) && !r.trailer && len(p)-n >= 2 {
		binary.BigEndian.PutUint16(p[n:], 0xffff) // -1: end of data
		n += 2
		r.trailer = true
	}
	if r.trailer {
		return n, io.EOF
	}
	return n, nil
}

func encodeRow(b []byte, m *kettle.Measurement) {
	be := binary.BigEndian
	be.PutUint16(b[0:], 8)
	be.PutUint32(b[2:], 16)
	copy(b[6:22], m.Device[:])
	be.PutUint32(b[22:], 8)
	be.PutUint64(b[26:], uint64(m.Time.UnixMicro()-pgEpochMicros))
	o := 34
	for _, v := range [6]float64{m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML} {
		be.PutUint32(b[o:], 8)
		be.PutUint64(b[o+4:], math.Float64bits(v))
		o += 12
	}
}
