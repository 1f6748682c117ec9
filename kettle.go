// Package kettle holds kettlefleet's domain: measurements, devices, commands,
// statistics, the command policy and the small interfaces the adapters
// (sqlite, postgres, httpapi, mqttapi) implement or use. It imports no
// database or HTTP package, so the architecture stays visible in the tree.
package kettle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
)

// DeviceID identifies one kettle. It is the UUID the case-study firmware
// receives from POST /login, and the subject of a v1 device token.
type DeviceID = uuid.UUID

// Measurement is one reading a kettle reports every interval.
// Time is the device's clock (UTC), truncated to microseconds so that every
// store keeps the same value: (Device, Time) is the idempotency key.
type Measurement struct {
	Device    DeviceID
	Time      time.Time
	ChargeMWh float64 // battery charge now
	FullMWh   float64 // battery capacity when full
	RateMW    float64 // charge (+) or discharge (−) rate
	AmbientC  float64 // ambient temperature
	WaterC    float64 // water temperature
	LevelML   float64 // water in the reservoir
}

// PotentialCmL is this reading's contribution to statistic 6:
// (water − ambient) × level, in °C·mL.
func (m Measurement) PotentialCmL() float64 { return (m.WaterC - m.AmbientC) * m.LevelML }

// JoulesPerCmL converts °C·mL of water to joules (specific heat of water,
// 4.186 J/(g·K), 1 mL ≈ 1 g).
const JoulesPerCmL = 4.186

// Override forces parts of a device's command until ExpiresAt. A nil field is
// left to the policy.
type Override struct {
	Charge      *bool
	Fill        *bool
	FlushMLPerS *float64
	ExpiresAt   time.Time
	SetAt       time.Time
}

// ActiveAt reports whether the override is in force at now.
func (o *Override) ActiveAt(now time.Time) bool { return o != nil && now.Before(o.ExpiresAt) }

// DeviceState is what the backend knows about one kettle now.
type DeviceState struct {
	ID           DeviceID
	RegisteredAt time.Time
	// LastSeen is the server time at which the newest stored measurement of
	// this device was committed; zero when it never reported.
	LastSeen time.Time
	// Latest is the measurement with the greatest device time; nil if none.
	Latest *Measurement
	// CapacityML is the largest water level this device ever reported: its
	// usual reservoir capacity, the history input of the command policy.
	CapacityML float64
	// Measurements is how many measurements of this device are stored.
	Measurements int64
	// Override is the operator override, possibly expired; nil if none.
	Override *Override
	// RevokedAt is when the device was decommissioned (zero: active). A
	// revoked device's credentials are refused; its history stays.
	RevokedAt time.Time
}

// Moments holds count, mean and sum of squared deviations (M2) of a sample,
// so that partial aggregates merge exactly (Chan et al.) without the
// cancellation of a sum-of-squares formula.
type Moments struct {
	N    int64
	Mean float64
	M2   float64
}

// Add folds one value into m (Welford).
func (m *Moments) Add(x float64) {
	m.N++
	d := x - m.Mean
	m.Mean += d / float64(m.N)
	m.M2 += d * (x - m.Mean)
}

// Merge returns the moments of the union of the two samples.
func (m Moments) Merge(o Moments) Moments {
	if o.N == 0 {
		return m
	}
	if m.N == 0 {
		return o
	}
	n := m.N + o.N
	d := o.Mean - m.Mean
	return Moments{
		N:    n,
		Mean: m.Mean + d*float64(o.N)/float64(n),
		M2:   m.M2 + o.M2 + d*d*float64(m.N)*float64(o.N)/float64(n),
	}
}

// Without returns the moments of m's sample without part, a subsample of
// it: Merge undone. It is exact in the counts; the mean and M2 lose what
// cancellation loses when little remains (kettlefleet uses it only for
// figures it rebuilds exactly once a removal completes).
func (m Moments) Without(part Moments) Moments {
	n := m.N - part.N
	if n <= 0 || part.N == 0 {
		if part.N == 0 {
			return m
		}
		return Moments{}
	}
	mean := (float64(m.N)*m.Mean - float64(part.N)*part.Mean) / float64(n)
	d := part.Mean - mean
	m2 := m.M2 - part.M2 - d*d*float64(n)*float64(part.N)/float64(m.N)
	return Moments{N: n, Mean: mean, M2: max(m2, 0)}
}

// Stddev is the population standard deviation (0 for an empty sample).
func (m Moments) Stddev() float64 {
	if m.N == 0 || m.M2 <= 0 {
		return 0
	}
	return math.Sqrt(m.M2 / float64(m.N))
}

// Rollup is the stored aggregate of all measurements whose device time falls
// in one UTC hour (Hour is that hour's start). Statistics are sums of rollups,
// never scans of history.
type Rollup struct {
	Hour    time.Time
	Water   Moments
	Ambient Moments
}

// HourStat is statistic 5 for one hour of the day (UTC).
type HourStat struct {
	Hour    int // 0..23
	Water   Moments
	Ambient Moments
}

// StatsQuery selects the range of device time for the by-hour statistics.
// A zero From or To leaves that side open. Bounds are rounded down to whole
// hours (rollups are hourly). ReportingSince is the server time after which a
// device that stored a measurement counts as reporting.
type StatsQuery struct {
	From, To       time.Time
	ReportingSince time.Time
}

// Statistics are the six fleet statistics of DESIGN.md.
type Statistics struct {
	MeasurementCount  int64   // 1. all measurements stored
	RangeCount        int64   // measurements in the queried range (= MeasurementCount when open)
	DevicesRegistered int64   // 2a. registered devices
	DevicesReporting  int64   // 2b. devices that stored a measurement since ReportingSince
	TotalChargeMWh    float64 // 3. Σ latest charge
	TotalWaterML      float64 // 4. Σ latest level
	ByHour            [24]HourStat
	TotalPotentialCmL float64 // 6. Σ (water − ambient) × level over latest states
}

// TotalPotentialJ is statistic 6 in joules.
func (s Statistics) TotalPotentialJ() float64 { return s.TotalPotentialCmL * JoulesPerCmL }

// HistoryQuery pages through one device's measurements in device-time order.
// From is inclusive, To exclusive; After (exclusive) is the cursor: the time of
// the last row of the previous page.
type HistoryQuery struct {
	Device   DeviceID
	From, To time.Time
	After    time.Time
	Limit    int
}

// Store is the source of truth. Everything derived from measurements (latest
// state, capacity, rollups, totals) is written in the transaction that writes
// the measurements. Implementations: sqlite.Store, postgres.Store.
type Store interface {
	// Register creates devices; ids that exist are left as they are.
	Register(ctx context.Context, ids []DeviceID, at time.Time) error
	// Write stores a batch in one transaction and returns, per row, whether
	// it was a duplicate (same device and time already stored, or earlier in
	// the batch). Devices not yet registered are registered at receivedAt.
	// It returns only after the commit.
	Write(ctx context.Context, batch []Measurement, receivedAt time.Time) (dup []bool, err error)
	// Statistics computes the six statistics from rollups and totals.
	Statistics(ctx context.Context, q StatsQuery) (Statistics, error)
	// Devices lists devices in id order after the cursor (uuid.Nil: from the start).
	Devices(ctx context.Context, after DeviceID, limit int) ([]DeviceState, error)
	// Device returns one device or an *Error with code ENotFound. It is
	// how a node learns of a device another process registered (a
	// case-study login on another node): it reads the primary, never a
	// read replica, so it finds every device whose Register or Write has
	// returned, through any handle on the same database; and a store that
	// cannot answer (timeout, down) returns another code, never ENotFound.
	Device(ctx context.Context, id DeviceID) (DeviceState, error)
	// History pages through one device's measurements.
	History(ctx context.Context, q HistoryQuery) ([]Measurement, error)
	// SetOverride stores an override (ENotFound for an unknown device).
	SetOverride(ctx context.Context, id DeviceID, o Override) error
	// ClearOverride removes it (no error when there is none).
	ClearOverride(ctx context.Context, id DeviceID) error
	// Revoke decommissions a device (ENotFound for an unknown one): its
	// credentials are refused from then on; its history stays. Revoking
	// again keeps the first time.
	Revoke(ctx context.Context, id DeviceID, at time.Time) error
	// Prune removes, in one transaction, up to limit devices after the
	// cursor after (in id order) that were registered before before and
	// never stored a measurement, and are neither revoked (a revoked id
	// must stay refused) nor under an override: registrations nothing came
	// of, such as a flood of POST /login. It returns the ids removed and
	// the cursor to pass next, uuid.Nil once it reached the last device.
	// DevicesRegistered counts only the devices that remain. A device that
	// stores a reading while Prune runs is either not removed or, removed,
	// registered again by that write. dryRun: the same answer, nothing
	// removed.
	Prune(ctx context.Context, before time.Time, after DeviceID, limit int, dryRun bool) (removed []DeviceID, next DeviceID, err error)
	// Expire removes every measurement whose device time is before before,
	// which must be the first instant of a UTC day (EInvalid otherwise;
	// see ExpireBefore), and returns how many it removed. The derived
	// figures follow in the same transactions: the fleet's and each
	// device's measurement counts and the by-hour statistics (bounded and
	// all-history) count only the measurements that remain. A device's
	// latest state, capacity and last-seen time stay: they describe the
	// kettle now, not its history. PostgreSQL removes each partition (a
	// day; a month in a database made before day partitions) in one
	// transaction; SQLite in transactions of a few thousand readings, after
	// each of which the counts equal the rows and the by-hour moments are
	// within float rounding of them (exact again once Expire returns).
	Expire(ctx context.Context, before time.Time) (removed int64, err error)
	// Scan calls fn for every device, to rebuild in-memory caches at start.
	Scan(ctx context.Context, fn func(DeviceState) error) error
	// Ping checks that the store answers (readiness).
	Ping(ctx context.Context) error
	// Close releases the store.
	Close() error
}

// ErrExpiring is what a store's Expire returns (wrapped) when another
// process is expiring the same store at that moment (several kettle serve
// nodes on one PostgreSQL): nothing for this one to do.
var ErrExpiring = errors.New("another process is expiring measurements now")

// ExpireBefore is the Expire bound of a retention of keep at now: the start
// of the UTC day that holds now − keep. Readings are kept at least keep
// and removed a whole day at a time, once all of the day is older.
func ExpireBefore(now time.Time, keep time.Duration) time.Time {
	t := now.Add(-keep).UTC()
	return time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
}

// maxRetentionDays bounds a retention in days (100 years; a time.Duration
// holds about 292).
const maxRetentionDays = 36_600

// ParseRetention reads a retention: a whole number of days ("90d", at most
// 36600d), or a Go duration ("2160h"); "0" keeps everything. It must be 0
// or at least a day.
func ParseRetention(v string) (time.Duration, error) {
	if v == "0" {
		return 0, nil
	}
	d, err := ParseAge(v)
	if err != nil {
		return 0, fmt.Errorf("%w, or 0", err)
	}
	if d != 0 && d < 24*time.Hour {
		return 0, fmt.Errorf("must be 0 (keep everything) or at least a day, got %q", v)
	}
	return d, nil
}

// ParseAge reads a non-negative age: a whole number of days ("90d", at
// most 36600d) or a Go duration ("2160h").
func ParseAge(v string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(v, "d"); ok {
		n, err := strconv.ParseInt(days, 10, 32)
		if err != nil || n < 0 || n > maxRetentionDays {
			return 0, fmt.Errorf("want a whole number of days such as 90d (at most %dd) or a duration such as 2160h, got %q", maxRetentionDays, clip(v))
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("want a whole number of days such as 90d or a duration such as 2160h, got %q", clip(v))
	}
	return d, nil
}

// clip cuts a value quoted back in an error to 64 bytes.
func clip(v string) string {
	if len(v) <= 64 {
		return v
	}
	return v[:64] + "…"
}

// FormatRetention writes d as ParseRetention reads it: in days when whole.
func FormatRetention(d time.Duration) string {
	if d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
	}
	return d.String()
}

// CheckDayStart returns an EInvalid error unless t is the first instant
// of a UTC day (the bound Expire takes).
func CheckDayStart(t time.Time) error {
	u := t.UTC()
	if !u.Equal(time.Date(u.Year(), u.Month(), u.Day(), 0, 0, 0, 0, time.UTC)) {
		return Errorf(EInvalid, "expire: the bound must be the first instant of a UTC day (midnight UTC), got %s", t.Format(time.RFC3339Nano))
	}
	return nil
}

// StoreClock is a store with a clock of its own that every node using it
// shares (PostgreSQL's clock_timestamp()). A node compares its clock with
// it: retention, the statistics' reporting window and overrides' expiry are
// judged by the node's clock, and nodes whose clocks disagree would judge
// them differently. A store in the node's own process (SQLite) has no
// second clock and does not implement it.
type StoreClock interface {
	// Now is the store's current time.
	Now(ctx context.Context) (time.Time, error)
}

// Nodes is implemented by a store that several processes may write at once
// (PostgreSQL: kettle serve nodes behind one load balancer, kettle seed):
// each says it is alive, so that a node learns whether anyone else writes
// and its device cache needs refreshing from the store.
type Nodes interface {
	// Beat records node (of kind, e.g. "serve" or "seed") alive now, by the
	// store's clock, beating every every, and returns how many other nodes
	// count as alive: those that beat within three of the longer of their
	// interval and this node's (so that a node sees another's last beat,
	// however seldom either beats), plus any process of a version that
	// writes without beating that the store can see.
	Beat(ctx context.Context, node uuid.UUID, kind string, every time.Duration) (others int, err error)
}

// ScanPages calls fn for every device in id order, reading pages of size
// devices at a time through page (a store's Devices), so a scan never holds
// one cursor or snapshot open while fn runs: a device registered during the
// scan may or may not be seen. fn's error is returned unwrapped. Stores
// implement Scan with it.
func ScanPages(ctx context.Context, size int, page func(ctx context.Context, after DeviceID, limit int) ([]DeviceState, error), fn func(DeviceState) error) error {
	after := uuid.Nil
	for {
		ds, err := page(ctx, after, size)
		if err != nil {
			return err
		}
		for _, d := range ds {
			if err := fn(d); err != nil {
				return err
			}
		}
		if len(ds) < size {
			return nil
		}
		after = ds[len(ds)-1].ID
	}
}
