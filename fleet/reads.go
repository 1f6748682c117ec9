package fleet

import (
	"context"

	"github.com/kettlefleet/kettlefleet"
)

// The reads the adapters answer from the store (statistics, device lists,
// history, readiness) go through the service, never around it: each is
// bounded by Config.StoreTimeout and its failure mapped by storeErr.

// Statistics is the fleet statistics of q, from the store. Refused while
// this node's clock is off the store's: q's reporting window is of its
// clock (clock.go).
func (s *Service) Statistics(ctx context.Context, q kettle.StatsQuery) (kettle.Statistics, error) {
	if err := s.clockErr("statistics"); err != nil {
		return kettle.Statistics{}, err
	}
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	st, err := s.store.Statistics(ctx, q)
	if err != nil {
		return st, s.storeErr("statistics", err)
	}
	return st, nil
}

// Devices is a page of at most limit devices after the id after, in id
// order, from the store.
func (s *Service) Devices(ctx context.Context, after kettle.DeviceID, limit int) ([]kettle.DeviceState, error) {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	ds, err := s.store.Devices(ctx, after, limit)
	if err != nil {
		return nil, s.storeErr("list devices", err)
	}
	return ds, nil
}

// Device is one device's stored state (ENotFound for an unknown one).
func (s *Service) Device(ctx context.Context, id kettle.DeviceID) (kettle.DeviceState, error) {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	d, err := s.store.Device(ctx, id)
	if err != nil {
		return d, s.storeErr("get device", err)
	}
	return d, nil
}

// History is a page of a device's stored readings (ENotFound for an
// unknown device, rather than an empty page).
func (s *Service) History(ctx context.Context, q kettle.HistoryQuery) ([]kettle.Measurement, error) {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	if _, err := s.store.Device(ctx, q.Device); err != nil {
		return nil, s.storeErr("history", err)
	}
	ms, err := s.store.History(ctx, q)
	if err != nil {
		return nil, s.storeErr("history", err)
	}
	return ms, nil
}

// Ping reports whether this node can take uploads (readiness; the error
// is for the log, readiness has no answer to map): whether its clock agrees
// with the store's (clock.go), and whether the store
// answers within Config.StoreTimeout. With the readings log in front
// (Config.Log) uploads are acknowledged by the log and the store is the
// writers' business, so readiness is the log's (its Ping, when it has
// one): every node shares the store, and a store outage (a failover, a
// switchover, PostgreSQL stopped) that made them all not ready would have
// the balancer refuse every kettle at once, turning the writers' lag into
// refusals.
func (s *Service) Ping(ctx context.Context) error {
	if err := s.clockErr("not ready"); err != nil {
		return err
	}
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	if s.cfg.Log != nil {
		if p, ok := s.cfg.Log.(interface{ Ping(context.Context) error }); ok {
			return p.Ping(ctx)
		}
		return nil
	}
	return s.store.Ping(ctx)
}
