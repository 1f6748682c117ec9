package fleet

import (
	"context"

	"github.com/kettlefleet/kettlefleet"
)

// The reads the adapters answer from the store (statistics, device lists,
// history, readiness) go through the service, never around it: each is
// bounded by Config.StoreTimeout and its failure mapped by storeErr.

// Statistics is the fleet statistics of q, from the store.
func (s *Service) Statistics(ctx context.Context, q kettle.StatsQuery) (kettle.Statistics, error) {
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

// Ping reports whether the store answers within Config.StoreTimeout (the
// store's own error, for the log: readiness has no answer to map).
func (s *Service) Ping(ctx context.Context) error {
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	return s.store.Ping(ctx)
}
