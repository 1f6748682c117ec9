package fleet

import (
	"time"
)

// Config sizes the ingest pipeline. DefaultConfig holds every default (and
// is kettle serve's configuration when no flag is given); a zero field
// takes its DefaultConfig value, except the ones whose zero is documented
// as off (rates, bounds, retention).
type Config struct {
	// QueueRows bounds the readings waiting for a transaction. When full,
	// Ingest fails fast with EUnavailable (HTTP 503 + Retry-After).
	QueueRows int
	// BatchRows is the most readings committed in one transaction.
	BatchRows int
	// BatchWait is how long the batcher waits for more readings after the
	// first one before committing a partial batch (0: commit what is there;
	// batches still grow under load while the previous commit runs).
	BatchWait time.Duration
	// Writers is the number of concurrent batch transactions (1 for SQLite,
	// which has one writer; a few for PostgreSQL). Each writer has its own
	// queue and owns the devices hashed to it, so two transactions never
	// lock the same device row and one device's readings commit in order.
	Writers int
	// PollInterval is the poll_after_s a kettle is told when nothing
	// time-dependent is due sooner.
	PollInterval time.Duration
	// RetryAfter is what a refused client is told to wait.
	RetryAfter time.Duration
	// Refresh, when > 0, reloads the device cache from the store this
	// often, so that a node sharing its store with other nodes (PostgreSQL)
	// answers polls with what the others committed. 0: never (one node).
	// With a store that knows who writes it (kettle.Nodes), the node beats
	// this often and reloads only while another process writes (and once
	// after the last one stopped).
	Refresh time.Duration
	// Retention, when > 0, is how long readings are kept, by device time:
	// readings older than now − Retention are refused (kettle.Window), and
	// every ExpireEvery the store expires the days wholly older than that
	// (kettle.ExpireBefore). 0 keeps everything.
	Retention time.Duration
	// ExpireEvery is how often the expiry runs when Retention > 0, and
	// the automatic prune when PruneUnreported > 0; the first run is at
	// start.
	ExpireEvery time.Duration
	// PruneUnreported, when > 0 (at least MinPruneAge), prunes every
	// ExpireEvery the devices registered longer ago that never stored a
	// reading (Prune). 0: only when the operator asks.
	PruneUnreported time.Duration
	// DeviceRate, when > 0, is the requests a second one device may make
	// (Allow, Pace), with bursts of DeviceBurst. 0: no limit.
	DeviceRate  float64
	DeviceBurst int
	// LoginRate, when > 0, is the case-study registrations (POST /login)
	// a second over all clients (AllowLogin), in bursts of LoginBurst.
	// 0: no limit.
	LoginRate  float64
	LoginBurst int
	// LoginSourceRate, when > 0, is the case-study registrations a second
	// from one source address (an IPv4 address, an IPv6 /64) in bursts of
	// LoginSourceBurst, checked before LoginRate: one client
	// looping on POST /login is refused on its own and leaves the shared
	// rate to the others. 0: no limit.
	LoginSourceRate  float64
	LoginSourceBurst int
	// MaxDevices, when > 0, bounds the registry: Register refuses devices
	// past it (EForbidden). Devices a v1 token registers by uploading are
	// not refused (their tokens come from the operator's secret).
	MaxDevices int
	// StoreTimeout bounds every store call the service and the adapters'
	// reads make (a batch commit, a registration, an override, one prune
	// transaction, a read): with the database unreachable (packets
	// dropped, not refused) a call would otherwise wait until TCP gives up,
	// minutes, and every upload with it.
	StoreTimeout time.Duration
	// MaxClockSkew bounds how far this node's clock may be from the
	// store's (kettle.StoreClock: PostgreSQL), measured at start, at every
	// cache-refresh beat and before every expiry. Past it the node is not
	// ready, refuses readings with 503 + Retry-After and expires nothing,
	// until the clocks agree again (clock.go). Negative: not checked.
	MaxClockSkew time.Duration
	// Log, when set (kettle serve --log), takes validated readings in
	// place of the ingest queue and the store (log.go).
	Log Log
}

// DefaultConfig is the ingest pipeline of one node on the embedded store.
func DefaultConfig() Config {
	return Config{
		QueueRows:    65536,
		BatchRows:    2000,
		Writers:      1,
		PollInterval: 30 * time.Second,
		RetryAfter:   time.Second,
		ExpireEvery:  time.Hour,
		DeviceBurst:  10,
		// A whole fleet may log in again at once after an outage; past
		// that, 100 registrations a second over all clients.
		LoginRate:        100,
		LoginBurst:       20000,
		LoginSourceBurst: 100,
		MaxDevices:       1_000_000,
		StoreTimeout:     DefaultStoreTimeout,
		MaxClockSkew:     DefaultMaxClockSkew,
	}
}

// DefaultStoreTimeout is Config.StoreTimeout's default (--store-timeout):
// longer than any healthy commit of a full batch, short enough that a kettle
// hears 503 + Retry-After long before its own request times out.
const DefaultStoreTimeout = 5 * time.Second

// DefaultMaxClockSkew is Config.MaxClockSkew's default (--max-clock-skew):
// NTP keeps a synchronised host within milliseconds of true time, so 5 s
// is far past any clock that is being kept, and past the measurement's own
// error (half a round trip to the database) on any database that answers
// within --store-timeout; yet it is small against every window the node
// judges by its clock (the 5-minute reporting window of the statistics, a
// retention bound of days, overrides' expiry in minutes), so a node within
// it gets none of them noticeably wrong.
const DefaultMaxClockSkew = 5 * time.Second

// defaults fills the zero fields that have no meaning of their own with
// DefaultConfig's values.
func (c *Config) defaults() {
	d := DefaultConfig()
	for _, f := range []struct{ v, def *int }{
		{&c.QueueRows, &d.QueueRows}, {&c.BatchRows, &d.BatchRows}, {&c.Writers, &d.Writers},
		{&c.DeviceBurst, &d.DeviceBurst}, {&c.LoginBurst, &d.LoginBurst}, {&c.LoginSourceBurst, &d.LoginSourceBurst},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	for _, f := range []struct{ v, def *time.Duration }{
		{&c.PollInterval, &d.PollInterval}, {&c.RetryAfter, &d.RetryAfter}, {&c.ExpireEvery, &d.ExpireEvery},
		{&c.StoreTimeout, &d.StoreTimeout},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	if c.MaxClockSkew == 0 { // negative is off
		c.MaxClockSkew = d.MaxClockSkew
	}
}
