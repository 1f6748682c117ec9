package postgres

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/kettlefleet/kettlefleet"
)

// The write transaction talks to pgconn directly, with parameters and
// results in PostgreSQL's binary format encoded here. pgx's generic encoder
// is fine for a handful of values, but a batch of 2000 readings sends arrays
// of thousands of elements, and pgx encodes []uuid.UUID element by element
// through reflection, an allocation or more per element, twice a batch:
// enough to cap a writer's rows/s (docs/performance.md).

// Statements of the write path, prepared on every connection of the pool
// (see prepareWrite) and executed by name.
var writeStmts = map[string]string{
	"kettle_lock":       sqlLock,
	"kettle_register":   sqlRegister,
	"kettle_insert":     sqlInsertArrays,
	"kettle_insert_new": sqlInsertNew,
	"kettle_devs":       sqlUpdateDevs,
	"kettle_rollups":    sqlMergeRollups,
	"kettle_hods":       sqlMergeHods,
	"kettle_totals":     sqlAddTotals,
	"kettle_seen":       sqlMoveSeen,
}

func prepareWrite(ctx context.Context, c *pgconn.PgConn) error {
	for name, sql := range writeStmts {
		if _, err := c.Prepare(ctx, name, sql, nil); err != nil {
			return fmt.Errorf("prepare %s: %w", name, err)
		}
	}
	return nil
}

var binFormats = [16]int16{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}

// bin returns n binary format codes (for parameters or results).
func bin(n int) []int16 { return binFormats[:n] }

// arrayHeader appends the header of a one-dimensional binary array without
// NULLs of n elements of type oid.
func arrayHeader(b []byte, oid uint32, n int) []byte {
	b = binary.BigEndian.AppendUint32(b, 1) // dimensions
	b = binary.BigEndian.AppendUint32(b, 0) // no NULLs
	b = binary.BigEndian.AppendUint32(b, oid)
	b = binary.BigEndian.AppendUint32(b, uint32(n))
	return binary.BigEndian.AppendUint32(b, 1) // lower bound
}

func uuidArray(ids []kettle.DeviceID) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(ids)*20), pgtype.UUIDOID, len(ids))
	for _, id := range ids {
		b = binary.BigEndian.AppendUint32(b, 16)
		b = append(b, id[:]...)
	}
	return b
}

func tidArray(tids [][6]byte) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(tids)*10), pgtype.TIDOID, len(tids))
	for _, t := range tids {
		b = binary.BigEndian.AppendUint32(b, 6)
		b = append(b, t[:]...)
	}
	return b
}

func float8Array(xs []float64) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(xs)*12), pgtype.Float8OID, len(xs))
	for _, x := range xs {
		b = binary.BigEndian.AppendUint32(b, 8)
		b = binary.BigEndian.AppendUint64(b, math.Float64bits(x))
	}
	return b
}

func int8Array(xs []int64) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(xs)*12), pgtype.Int8OID, len(xs))
	for _, x := range xs {
		b = binary.BigEndian.AppendUint32(b, 8)
		b = binary.BigEndian.AppendUint64(b, uint64(x))
	}
	return b
}

func int2Array(xs []int16) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(xs)*6), pgtype.Int2OID, len(xs))
	for _, x := range xs {
		b = binary.BigEndian.AppendUint32(b, 2)
		b = binary.BigEndian.AppendUint16(b, uint16(x))
	}
	return b
}

func timestamptzArray(ts []time.Time) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(ts)*12), pgtype.TimestamptzOID, len(ts))
	for _, t := range ts {
		b = binary.BigEndian.AppendUint32(b, 8)
		b = binary.BigEndian.AppendUint64(b, uint64(t.UnixMicro()-pgEpochMicros))
	}
	return b
}

// timestampsMicroArray is timestamptzArray of times given in unix µs.
func timestampsMicroArray(us []int64) []byte {
	b := arrayHeader(make([]byte, 0, 20+len(us)*12), pgtype.TimestamptzOID, len(us))
	for _, u := range us {
		b = binary.BigEndian.AppendUint32(b, 8)
		b = binary.BigEndian.AppendUint64(b, uint64(u-pgEpochMicros))
	}
	return b
}

func int8Bin(x int64) []byte     { return binary.BigEndian.AppendUint64(nil, uint64(x)) }
func float8Bin(x float64) []byte { return binary.BigEndian.AppendUint64(nil, math.Float64bits(x)) }
func timestamptzBin(t time.Time) []byte {
	return binary.BigEndian.AppendUint64(nil, uint64(t.UnixMicro()-pgEpochMicros))
}

// Decoders of binary result values. A NULL arrives as a nil slice.

func decInt8(v []byte) int64     { return int64(binary.BigEndian.Uint64(v)) }
func decFloat8(v []byte) float64 { return math.Float64frombits(binary.BigEndian.Uint64(v)) }
func decTime(v []byte) time.Time {
	return time.UnixMicro(int64(binary.BigEndian.Uint64(v)) + pgEpochMicros).UTC()
}

func decFloat8Null(v []byte) float64 {
	if v == nil {
		return 0
	}
	return decFloat8(v)
}

func decTimeNull(v []byte) *time.Time {
	if v == nil {
		return nil
	}
	t := decTime(v)
	return &t
}

// readLocked reads the rows of kettle_lock into devs.
func readLocked(rr *pgconn.ResultReader, devs map[kettle.DeviceID]*devState) error {
	for rr.NextRow() {
		v := rr.Values()
		if len(v) != 12 || len(v[0]) != 6 || len(v[1]) != 16 {
			rr.Close()
			return fmt.Errorf("lock devices: unexpected row shape (%d columns)", len(v))
		}
		var id kettle.DeviceID
		copy(id[:], v[1])
		d := &devState{n: decInt8(v[2]), capML: decFloat8(v[3]), lastSeen: decTimeNull(v[4])}
		copy(d.tid[:], v[0])
		if lt := decTimeNull(v[5]); lt != nil {
			d.latest = &kettle.Measurement{Device: id, Time: *lt,
				ChargeMWh: decFloat8Null(v[6]), FullMWh: decFloat8Null(v[7]), RateMW: decFloat8Null(v[8]),
				AmbientC: decFloat8Null(v[9]), WaterC: decFloat8Null(v[10]), LevelML: decFloat8Null(v[11])}
		}
		devs[id] = d
	}
	_, err := rr.Close()
	return err
}

// insertParams are the parameters of kettle_insert: one array per column.
func insertParams(rows []kettle.Measurement) [][]byte {
	ids := make([]kettle.DeviceID, len(rows))
	ts := make([]time.Time, len(rows))
	var cols [6][]float64
	for j := range cols {
		cols[j] = make([]float64, len(rows))
	}
	for i := range rows {
		m := &rows[i]
		ids[i], ts[i] = m.Device, m.Time
		cols[0][i], cols[1][i], cols[2][i], cols[3][i], cols[4][i], cols[5][i] = m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML
	}
	p := [][]byte{uuidArray(ids), timestamptzArray(ts)}
	for _, c := range cols {
		p = append(p, float8Array(c))
	}
	return p
}
