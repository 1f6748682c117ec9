package fleet

import (
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/logthin"
)

// rateLimits are the per-device and login rates and what they refused.
type rateLimits struct {
	deviceRate, loginRate                 gcra
	loginTAT                              atomic.Int64
	rateRefused, ratePaced, loginsRefused atomic.Int64
	registryRefused                       atomic.Int64
	rateLog                               logthin.Limiter // logOverRate
	loginSource                           gcra
	sources                               sourceTable // --login-rate-per-source
	sourceRefused                         atomic.Int64
}

// Each device's requests are held to Config.DeviceRate a second with bursts
// of Config.DeviceBurst (--device-rate, --device-burst), so that one kettle
// whose firmware retries in a tight loop, or one stolen credential, cannot
// take the fleet's share of the server: a kettle sends two requests in 30 s.
// Registrations through the case-study POST /login, which anyone may call,
// are held to Config.LoginRate over all clients (--login-rate) and, if set,
// to Config.LoginSourceRate from one address (--login-rate-per-source), and the
// registry to Config.MaxDevices (--max-devices): each registration is a
// store transaction and a slot in memory, freed only if the operator
// prunes the registrations that never reported (Prune).
//
// The limits are the generic cell rate algorithm (gcra): one number, the
// theoretical arrival time of the next request (TAT, unix ns). A request at
// now conforms when TAT − now ≤ τ = (burst − 1) × T, T = 1/rate, and then
// moves TAT to max(TAT, now) + T. Per device that is one atomic int64 in its
// cache slot, swapped with compare-and-swap under the cache's read lock,
// which keeps the cache free of pointers (see cache) — a token-bucket object
// per kettle (golang.org/x/time/rate's Limiter holds a time.Time, a pointer)
// would put hundreds of thousands of objects back in front of the collector.
//
// A device not in the cache (a v1 token whose first reading is not yet
// stored) is not limited until it is: its credential is still checked.

// gcra is one rate: T and τ in ns (t 0: no limit).
type gcra struct{ t, tau int64 }

func newGCRA(rate float64, burst int) gcra {
	if rate <= 0 {
		return gcra{}
	}
	t := max(1, int64(float64(time.Second)/rate))
	return gcra{t: t, tau: int64(max(burst, 1)-1) * t}
}

func (g gcra) on() bool { return g.t > 0 }

// take applies one request at now to tat and returns how long it is early
// (≤ 0: it conforms, and was taken). An early request is taken only when
// reserve is set (its slot is then the next free one).
func (g gcra) take(tat *atomic.Int64, now int64, reserve bool) time.Duration {
	for {
		old := tat.Load()
		next, wait := g.step(old, now)
		if wait > 0 && !reserve {
			return wait
		}
		if tat.CompareAndSwap(old, next) {
			return wait
		}
	}
}

// step is one request at now against TAT old: the TAT after taking it, and
// how long the request is early (≤ 0: it conforms).
func (g gcra) step(old, now int64) (next int64, early time.Duration) {
	at := max(old, now)
	return at + g.t, time.Duration(at - g.tau - now)
}

// Allow takes one request of device id against its rate. Over it, nothing is
// taken and Allow returns an *kettle.Error with code ETooMany and how long
// until a request would conform (HTTP: 429 + Retry-After).
func (s *Service) Allow(id kettle.DeviceID) error {
	if !s.deviceRate.on() { // inlined: what every request pays without a limit
		return nil
	}
	return s.allow(id)
}

func (s *Service) allow(id kettle.DeviceID) error {
	wait := s.takeDevice(id, false)
	if wait <= 0 {
		return nil
	}
	s.rateRefused.Add(1)
	s.logOverRate(id, "refused")
	return &kettle.Error{Code: kettle.ETooMany, RetryAfter: wait,
		Message: fmt.Sprintf("device %s sends faster than this server allows a kettle (--device-rate %g a second, --device-burst %d); retry after Retry-After seconds", id, s.cfg.DeviceRate, s.cfg.DeviceBurst)}
}

// Pace takes one request of device id and returns how long to wait before
// serving it so that the device keeps to its rate (0: at once). It never
// refuses: a protocol with flow control (MQTT: the connection is not read
// while its publish waits) slows the kettle down instead of losing or
// refusing what it sends. Reservations queue: n connections of one device
// each waiting share its one rate.
func (s *Service) Pace(id kettle.DeviceID) time.Duration {
	if !s.deviceRate.on() {
		return 0
	}
	wait := s.takeDevice(id, true)
	if wait <= 0 {
		return 0
	}
	s.ratePaced.Add(1)
	s.logOverRate(id, "paced")
	return wait
}

// takeDevice is gcra.take on device id's slot (0 for a device not cached).
func (s *Service) takeDevice(id kettle.DeviceID, reserve bool) time.Duration {
	now := s.now().UnixNano()
	s.mu.RLock()
	defer s.mu.RUnlock()
	d := s.cache.get(id)
	if d == nil {
		return 0
	}
	return s.deviceRate.take(&d.tat, now, reserve)
}

// AllowLogin takes one case-study registration (POST /login, anonymous)
// from source (the client's address; the zero Addr: unknown) against
// --login-rate-per-source, then --login-rate over all clients. Over either,
// nothing more is taken and an *kettle.Error with code ETooMany says how
// long to wait.
func (s *Service) AllowLogin(source netip.Addr) error {
	if s.loginSource.on() && source.IsValid() {
		if err := s.allowSource(source); err != nil {
			return err
		}
	}
	if !s.loginRate.on() {
		return nil
	}
	wait := s.loginRate.take(&s.loginTAT, s.now().UnixNano(), false)
	if wait <= 0 {
		return nil
	}
	s.loginsRefused.Add(1)
	return &kettle.Error{Code: kettle.ETooMany, RetryAfter: wait,
		Message: fmt.Sprintf("too many registrations: this server registers at most %g devices a second through POST /login (--login-rate, bursts of --login-burst %d); retry after Retry-After seconds", s.cfg.LoginRate, s.cfg.LoginBurst)}
}

// The per-source login limit keeps one TAT per source in a table of at most
// maxLoginSources. A source whose TAT has passed has its whole burst again,
// exactly as one never seen: a full table drops those (at most once every
// sourceSweepEvery, so that a flood of new addresses does not turn every
// login into a walk of the table). If every source in it is still within
// its burst, a new one is held to --login-rate alone (counted in
// LimitStats.SourcesUntracked): memory stays bounded, and a client with
// that many addresses is past what a per-address limit can stop anyway.
const (
	maxLoginSources  = 65536
	sourceSweepEvery = 100 * time.Millisecond
)

type sourceTable struct {
	mu        sync.Mutex
	tat       map[netip.Prefix]int64
	swept     int64 // unix ns of the last sweep
	untracked atomic.Int64
}

// sourceKey is the limit's key for a client address: an IPv4 address, or
// the /64 an IPv6 address is in (one host's usual allocation).
func sourceKey(a netip.Addr) netip.Prefix {
	a = a.Unmap()
	if a.Is4() {
		return netip.PrefixFrom(a, 32)
	}
	p, _ := a.Prefix(64)
	return p
}

// sourceName is a key as the client knows its address: IPv4 plain.
func sourceName(key netip.Prefix) string {
	if key.Addr().Is4() {
		return key.Addr().String()
	}
	return key.String()
}

func (s *Service) allowSource(source netip.Addr) error {
	key := sourceKey(source)
	now := s.now().UnixNano()
	t := &s.sources
	t.mu.Lock()
	old, known := t.tat[key]
	if !known && len(t.tat) >= maxLoginSources {
		if now-t.swept >= int64(sourceSweepEvery) {
			t.swept = now
			for k, v := range t.tat {
				if v <= now {
					delete(t.tat, k)
				}
			}
		}
		if len(t.tat) >= maxLoginSources {
			t.mu.Unlock()
			t.untracked.Add(1)
			return nil
		}
	}
	next, early := s.loginSource.step(old, now)
	if early <= 0 {
		if t.tat == nil {
			t.tat = make(map[netip.Prefix]int64)
		}
		t.tat[key] = next
	}
	t.mu.Unlock()
	if early <= 0 {
		return nil
	}
	s.sourceRefused.Add(1)
	return &kettle.Error{Code: kettle.ETooMany, RetryAfter: early,
		Message: fmt.Sprintf("too many registrations from %s: this server registers at most %g devices a second from one address (--login-rate-per-source, bursts of --login-burst-per-source %d; IPv6: one /64); retry after Retry-After seconds", sourceName(key), s.cfg.LoginSourceRate, s.cfg.LoginSourceBurst)}
}

// LimitStats counts, since start, what the limits of this file refused.
type LimitStats struct {
	DeviceRefused int64 // requests over a device's rate refused (Allow)
	DevicePaced   int64 // requests over a device's rate held back (Pace)
	LoginsRefused int64 // registrations over --login-rate (AllowLogin)
	RegistryFull  int64 // registrations refused past --max-devices (Register)
	// registrations over --login-rate-per-source (AllowLogin)
	SourceRefused int64
	// logins from a new source not limited by --login-rate-per-source
	// because its table was full of sources within their bursts
	SourcesUntracked int64
}

// Limits reports what the rate limits and the registry bound refused.
func (s *Service) Limits() LimitStats {
	return LimitStats{s.rateRefused.Load(), s.ratePaced.Load(), s.loginsRefused.Load(), s.registryRefused.Load(),
		s.sourceRefused.Load(), s.sources.untracked.Load()}
}

// registryFull counts and returns the error of a registration past
// --max-devices.
func (s *Service) registryFull(n int) error {
	s.registryRefused.Add(1)
	return &kettle.Error{Code: kettle.EForbidden,
		Message: fmt.Sprintf("device registry full: this server registers at most %d devices (--max-devices) and holds %d; registering %d more needs an operator to raise --max-devices", s.cfg.MaxDevices, s.DeviceCount(), n)}
}

// logOverRate names a kettle over its rate in the log, at most once a
// second over all kettles (a runaway kettle is refused many times a
// second), with how many requests over the rate were not logged since.
func (s *Service) logOverRate(id kettle.DeviceID, what string) {
	if ok, skipped := s.rateLog.Allow(time.Now()); ok {
		s.log.Warn("kettle over --device-rate", "device", id, "request", what, "rate", s.cfg.DeviceRate, "burst", s.cfg.DeviceBurst, "over_rate_not_logged_since_last_line", skipped)
	}
}
