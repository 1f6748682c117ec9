package wire

import (
	"bytes"
	"strconv"
	"time"
	"unsafe"

	"github.com/kettlefleet/kettlefleet"
)

// fastV1 decodes the v1 upload every well-behaved kettle sends (one reading,
// or an array of readings, each an object of exactly the seven v1 fields
// spelled as documented, numbers and a time string without escapes) straight
// into measurements: no reflection, no pointer per field, no allocation per
// reading. It returns ok false for anything else (an unknown, missing,
// duplicated or differently cased key, null, an escape or a non-ASCII byte, a
// number out of float64 range, an invalid reading, a batch too large or
// empty, malformed JSON), and DecodeV1 then decodes the body the general way,
// which finds the same readings or names the error. So it changes speed,
// never the answer (FuzzDecodeV1Fast checks that against the general path).
// The readings go into dst's memory when it is large enough.
func fastV1(body []byte, dev kettle.DeviceID, win kettle.Window, dst []kettle.Measurement) (ms []kettle.Measurement, ok bool) {
	p := fastParser{b: body}
	p.ws()
	if p.i < len(p.b) && p.b[p.i] == '[' {
		p.i++
		// one reading is at least this long: presize from the body
		if n := min(kettle.MaxBatch, len(body)/minReadingBytes+1); cap(dst) >= n {
			ms = dst[:0]
		} else {
			ms = make([]kettle.Measurement, 0, n)
		}
		p.ws()
		for {
			if len(ms) == kettle.MaxBatch {
				return nil, false
			}
			ms = append(ms, kettle.Measurement{Device: dev})
			if !p.reading(&ms[len(ms)-1], win) {
				return nil, false
			}
			p.ws()
			if p.i >= len(p.b) {
				return nil, false
			}
			c := p.b[p.i]
			p.i++
			if c == ']' {
				break
			}
			if c != ',' {
				return nil, false
			}
			p.ws()
		}
	} else {
		if cap(dst) >= 1 {
			ms = dst[:1]
			ms[0] = kettle.Measurement{}
		} else {
			ms = make([]kettle.Measurement, 1)
		}
		ms[0].Device = dev
		if !p.reading(&ms[0], win) {
			return nil, false
		}
	}
	p.ws()
	if p.i != len(p.b) {
		return nil, false
	}
	return ms, true
}

// minReadingBytes is the length of the shortest reading fastV1 accepts:
// the seven keys with quotes and colons, one-digit values, a minimal time.
const minReadingBytes = 140

type fastParser struct {
	b []byte
	i int
}

func (p *fastParser) ws() {
	// Compact JSON (what kettles send) has none: one comparison.
	if p.i < len(p.b) && p.b[p.i] > ' ' {
		return
	}
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// reading parses one object into m (whose Device is set) and validates it.
func (p *fastParser) reading(m *kettle.Measurement, win kettle.Window) bool {
	if p.i >= len(p.b) || p.b[p.i] != '{' {
		return false
	}
	p.i++
	// the values of v1Keys[i]; the time (nil) is parsed apart
	fields := [len(v1Keys)]*float64{nil, &m.ChargeMWh, &m.FullMWh, &m.RateMW, &m.AmbientC, &m.WaterC, &m.LevelML}
	var seen uint8
	normal := false // m.Time is as Normalize leaves it
	for k := 0; ; k++ {
		p.ws()
		// A kettle sends the keys in the documented order: try the next
		// one first, a comparison instead of a search for the closing quote.
		idx := -1
		if k < len(v1Keys) && bytes.HasPrefix(p.b[p.i:], v1Keys[k]) {
			idx = k
			p.i += len(v1Keys[k])
		} else {
			key, ok := p.raw()
			if !ok {
				return false
			}
			for i, q := range v1Keys {
				if string(q[1:len(q)-1]) == key {
					idx = i
				}
			}
			if idx < 0 {
				return false
			}
		}
		p.ws()
		if p.i >= len(p.b) || p.b[p.i] != ':' {
			return false
		}
		p.i++
		p.ws()
		bit := uint8(1) << idx
		if seen&bit != 0 {
			return false
		}
		seen |= bit
		if dst := fields[idx]; dst == nil {
			s, ok := p.raw()
			if !ok {
				return false
			}
			t, ok := parseUTC(s)
			if !ok {
				var err error
				if t, err = time.Parse(time.RFC3339Nano, s); err != nil {
					return false
				}
			}
			m.Time = t
			// parseUTC's times are UTC already: only a fraction finer than
			// the stored precision (or another offset) needs Normalize.
			normal = ok && t.Nanosecond()%int(kettle.TimePrecis) == 0
		} else if !p.num(dst) {
			return false
		}
		p.ws()
		if p.i >= len(p.b) {
			return false
		}
		c := p.b[p.i]
		p.i++
		if c == '}' {
			break
		}
		if c != ',' {
			return false
		}
	}
	if seen != 127 {
		return false
	}
	if !normal {
		m.Normalize()
	}
	return m.Valid(win)
}

// v1Keys are kettle.V1Names quoted, in the documented order.
var v1Keys = func() (q [7][]byte) {
	n := kettle.V1Names
	for i, k := range [...]string{n.Time, n.Charge, n.Full, n.Rate, n.Ambient, n.Water, n.Level} {
		q[i] = []byte(`"` + k + `"`)
	}
	return q
}()

// parseUTC parses the time every kettle sends, 2026-10-13T07:00:05Z with
// up to nine fractional digits, to the time.Time time.Parse(RFC3339Nano)
// returns for it (FuzzParseUTC holds it to that), several times faster: the
// seconds since 1970 come from the calendar date by arithmetic (days from
// civil, proleptic Gregorian), not from time.Date's normalization. ok false:
// anything else (another offset, a field out of range, another layout),
// which time.Parse then parses or rejects.
func parseUTC(s string) (t time.Time, ok bool) {
	if len(s) < 20 || s[4] != '-' || s[7] != '-' || s[10] != 'T' || s[13] != ':' || s[16] != ':' || s[len(s)-1] != 'Z' {
		return t, false
	}
	d := func(i int) int { return int(s[i]) - '0' }
	for _, i := range [...]int{0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18} {
		if uint(d(i)) > 9 {
			return t, false
		}
	}
	year := d(0)*1000 + d(1)*100 + d(2)*10 + d(3)
	month, day := d(5)*10+d(6), d(8)*10+d(9)
	hour, minute, sec := d(11)*10+d(12), d(14)*10+d(15), d(17)*10+d(18)
	if month < 1 || month > 12 || day < 1 || day > daysIn(month, year) || hour > 23 || minute > 59 || sec > 59 {
		return t, false // time.Parse refuses April 31 and February 29 of 2023 too
	}
	ns := 0
	if frac := s[19 : len(s)-1]; frac != "" {
		if frac[0] != '.' || len(frac) < 2 || len(frac) > 10 {
			return t, false
		}
		for i := 1; i < 10; i++ {
			ns *= 10
			if i < len(frac) {
				if c := frac[i]; c >= '0' && c <= '9' {
					ns += int(c - '0')
				} else {
					return t, false
				}
			}
		}
	}
	secs := daysFromCivil(year, month, day)*86400 + int64(hour*3600+minute*60+sec)
	return time.Unix(secs, int64(ns)).UTC(), true
}

// daysIn is the length of month in year (proleptic Gregorian).
func daysIn(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

// daysFromCivil is the number of days from 1970-01-01 to year-month-day
// (proleptic Gregorian, year ≥ 0): the year taken to start in March, so
// that the leap day is the last of its year, in 400-year eras of 146,097
// days.
func daysFromCivil(year, month, day int) int64 {
	y := year
	if month <= 2 {
		y--
	}
	era := (y+400)/400 - 1                 // floor(y / 400) for y ≥ -1
	yoe := y - era*400                     // [0, 399]
	mp := (month + 9) % 12                 // March = 0
	doy := (153*mp+2)/5 + day - 1          // [0, 365]
	doe := yoe*365 + yoe/4 - yoe/100 + doy // [0, 146096]
	return int64(era)*146097 + int64(doe) - 719468
}

// raw returns the bytes of a string up to its closing quote, unchecked: a
// key is only compared with the seven names (plain ASCII: an escape, a
// control or non-ASCII byte cannot be equal to one), and the time is only
// given to time.Parse, which takes none of them either. So a string that is
// not plain ASCII fails here as it would after decoding, and DecodeV1
// decodes it the general way. Finding the quote with bytes.IndexByte
// (vectorized) instead of checking each byte was 13% of kettle serve's CPU
// on batched uploads. The result aliases the body, which the caller neither
// changes nor keeps past the decode.
func (p *fastParser) raw() (string, bool) {
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return "", false
	}
	j := bytes.IndexByte(p.b[p.i+1:], '"')
	if j < 0 {
		return "", false
	}
	s := p.b[p.i+1 : p.i+1+j]
	p.i += j + 2
	return unsafe.String(unsafe.SliceData(s), len(s)), true
}

// num parses a JSON number (RFC 8259 grammar: strconv.ParseFloat alone would
// also take "+1", "0x1p3", "inf", "1_0") that is finite as a float64.
//
// A number of at most 15 digits without exponent (what kettles send:
// 57, -2.5, 88.25) is an integer below 2⁵³ divided by a power of ten below
// 10²²: both exact in float64, so one division is correctly rounded, the
// same float64 strconv.ParseFloat returns (its own exact fast path).
// Anything else goes to strconv.ParseFloat.
func (p *fastParser) num(dst *float64) bool {
	b, start := p.b, p.i
	i := p.i
	neg := false
	if i < len(b) && b[i] == '-' {
		neg = true
		i++
	}
	var mant uint64
	digits, frac := 0, 0
	switch {
	case i < len(b) && b[i] == '0':
		i++
		digits++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			mant = mant*10 + uint64(b[i]-'0')
			digits++
			i++
		}
	default:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			mant = mant*10 + uint64(b[i]-'0')
			digits++
			i++
		}
		frac = i - d
		if frac == 0 {
			return false
		}
	}
	exact := digits <= 15
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		exact = false
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			return false
		}
	}
	if exact {
		v := float64(mant) / pow10[frac] // digits ≤ 15: mant < 10¹⁵ < 2⁵³, frac ≤ 15
		if neg {
			v = -v
		}
		*dst = v
		p.i = i
		return true
	}
	s := b[start:i]
	v, err := strconv.ParseFloat(unsafe.String(unsafe.SliceData(s), len(s)), 64)
	if err != nil {
		return false
	}
	*dst = v
	p.i = i
	return true
}

var pow10 = [16]float64{1, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15}
