package fleet

import (
	"context"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/kettlefleet/kettlefleet"
)

// registry is the devices as this node knows them: the cache that answers
// polls and credential checks from memory, and who is told of changes.
type registry struct {
	mu          sync.RWMutex
	cache       cache
	registering int // slots held by registrations in flight (Register; under mu)
	// devices this node pruned while a refresh scanned the store (under mu;
	// Refresh drops them again when its scan ends)
	prunedInScan []kettle.DeviceID

	watchMu  sync.RWMutex
	watchers []ChangeFunc
}

// OnChange registers fn to be told of device state changes (MQTT pushes
// commands with it).
func (s *Service) OnChange(fn ChangeFunc) {
	s.watchMu.Lock()
	s.watchers = append(s.watchers, fn)
	s.watchMu.Unlock()
}

func (s *Service) changed(ids []kettle.DeviceID) {
	s.watchMu.RLock()
	defer s.watchMu.RUnlock()
	for _, fn := range s.watchers {
		fn(ids)
	}
}

// Register creates new devices with fresh random ids, durably, and returns
// their ids; past Config.MaxDevices it refuses them (EForbidden). The bound
// is exact on this node: registrations in flight hold their slots
// (s.registering) from the check until they are cached or have failed.
func (s *Service) Register(ctx context.Context, n int) ([]kettle.DeviceID, error) {
	reserved := 0
	if s.cfg.MaxDevices > 0 {
		s.mu.Lock()
		full := s.cache.len()+s.registering+n > s.cfg.MaxDevices
		if !full {
			s.registering += n
			reserved = n
		}
		s.mu.Unlock()
		if full {
			return nil, s.registryFull(n)
		}
	}
	ids := make([]kettle.DeviceID, n)
	for i := range ids {
		ids[i] = uuid.New()
	}
	return ids, s.register(ctx, ids, reserved)
}

// RegisterIDs creates the given devices (existing ones are left alone).
func (s *Service) RegisterIDs(ctx context.Context, ids []kettle.DeviceID) error {
	return s.register(ctx, ids, 0)
}

// register stores ids and caches them, releasing the reserved slots (see
// Register) in the same critical section as the devices take theirs. The
// store call does not run on the client's context: a client that goes away
// while the registration commits must not leave it stored but unknown to
// this node (its count, the registry bound and a prune all go by the
// cache); Config.StoreTimeout bounds it instead.
func (s *Service) register(ctx context.Context, ids []kettle.DeviceID, reserved int) error {
	at := s.now().UTC().Truncate(kettle.TimePrecis)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.StoreTimeout)
	defer cancel()
	err := s.store.Register(ctx, ids, at)
	s.mu.Lock()
	s.registering -= reserved
	if err == nil {
		for _, id := range ids {
			s.cache.add(id)
		}
	}
	s.mu.Unlock()
	if err != nil {
		return s.unavailable("register devices", err)
	}
	return nil
}

// Registered reports whether this node knows the device and it is not
// revoked, from memory only; the case-study credential check is Issued,
// which also asks the store about a device this node has not seen.
func (s *Service) Registered(id kettle.DeviceID) bool {
	s.mu.RLock()
	d := s.cache.get(id)
	ok := d != nil && !d.revoked
	s.mu.RUnlock()
	return ok
}

// Revoked reports whether the device was decommissioned: its credentials
// (v1 token, MQTT password, case-study UUID) are refused. From memory.
func (s *Service) Revoked(id kettle.DeviceID) bool {
	s.mu.RLock()
	d := s.cache.get(id)
	r := d != nil && d.revoked
	s.mu.RUnlock()
	return r
}

// Revoke decommissions a device durably, then in the cache: from then on its
// credentials are refused; its history stays in the statistics.
func (s *Service) Revoke(ctx context.Context, id kettle.DeviceID) error {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	if err := s.store.Revoke(ctx, id, s.now().UTC().Truncate(kettle.TimePrecis)); err != nil {
		return s.storeErr("revoke", err)
	}
	s.mu.Lock()
	s.cache.add(id).revoked = true
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}

// DeviceCount is the number of registered devices in the cache.
func (s *Service) DeviceCount() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cache.len()
}

// ReportingSince counts devices whose last stored reading was committed at
// or after t, from memory.
func (s *Service) ReportingSince(t time.Time) int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n, since := 0, t.UnixNano()
	s.cache.each(func(d *device) {
		if d.lastSeen != 0 && d.lastSeen >= since {
			n++
		}
	})
	return n
}

// Command is the device's current command, from memory: the policy applied
// to the cached latest reading, capacity and override at the service clock.
// An unknown device gets the policy's answer for a kettle with no reading.
func (s *Service) Command(id kettle.DeviceID) (kettle.Command, time.Duration) {
	now := s.now()
	s.mu.RLock()
	in := kettle.PolicyInput{Now: now}
	var latest kettle.Measurement
	if d := s.cache.get(id); d != nil {
		if d.hasLatest {
			latest = d.latest.measurement(id)
			in.Latest = &latest
		}
		in.CapacityML, in.Override = d.capacityML, s.cache.override(id, d)
	}
	s.mu.RUnlock()
	return kettle.Decide(in), kettle.NextChange(now, in.Override, s.cfg.PollInterval)
}

// SetOverride stores an override durably, then applies it to the cache so
// the kettle's next poll sees it. Refused while this node's clock is off
// the store's: the override's expiry is of its clock (clock.go).
func (s *Service) SetOverride(ctx context.Context, id kettle.DeviceID, o kettle.Override) error {
	if err := s.clockErr("set override"); err != nil {
		return err
	}
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	if err := s.store.SetOverride(ctx, id, o); err != nil {
		return s.storeErr("set override", err)
	}
	s.mu.Lock()
	if d := s.cache.get(id); d != nil {
		c := o
		s.cache.setOverride(id, d, &c)
	}
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}

// ClearOverride removes a device's override, durably, then from the cache.
func (s *Service) ClearOverride(ctx context.Context, id kettle.DeviceID) error {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	if _, err := s.store.Device(ctx, id); err != nil {
		return s.storeErr("clear override", err)
	}
	if err := s.store.ClearOverride(ctx, id); err != nil {
		return s.storeErr("clear override", err)
	}
	s.mu.Lock()
	if d := s.cache.get(id); d != nil {
		s.cache.setOverride(id, d, nil)
	}
	s.mu.Unlock()
	s.changed([]kettle.DeviceID{id})
	return nil
}
