package fleet

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kettlefleet/kettlefleet"
)

// ErrClockSkew is the cause of every refusal of a node whose clock is more
// than Config.MaxClockSkew from the store's (errors.Is finds it).
var ErrClockSkew = errors.New("clock skewed from the database's")

// clockCheck is the comparison of this node's clock with the store's
// (kettle.StoreClock). Nodes sharing a database judge retention, the
// statistics' reporting window and overrides' expiry each by its own clock:
// one an hour ahead expires readings the others still keep and refuses
// readings inside retention; one an hour behind counts no kettle as
// reporting. So a node past the bound stops serving what its clock decides
// — /readyz 503, readings 503 + Retry-After (the balancer sends the retry to
// a node whose clock agrees), no expiry — and says why, until the clocks
// agree again.
type clockCheck struct {
	skew   atomic.Int64 // this node's clock minus the store's, ns (when known)
	known  atomic.Bool  // a comparison has answered
	skewed atomic.Bool  // |skew| > Config.MaxClockSkew at the last comparison
}

// CheckClock compares this node's clock with the store's and records the
// difference (ClockSkew); a store without a clock of its own has nothing to
// compare with. New calls it before the first expiry, the refresher at
// every beat and Expire before it deletes. An error (the store does not
// answer) keeps the last verdict.
func (s *Service) CheckClock(ctx context.Context) error {
	sc, ok := s.store.(kettle.StoreClock)
	if !ok || s.cfg.MaxClockSkew < 0 {
		return nil
	}
	ctx, cancel := s.storeContext(ctx)
	defer cancel()
	local, sent := s.now(), time.Now()
	theirs, err := sc.Now(ctx)
	if err != nil {
		return s.storeErr("compare clocks", err)
	}
	// The store read its clock somewhere in the round trip: compare with
	// the middle of it (the error is at most half of it).
	skew := local.Add(time.Since(sent) / 2).Sub(theirs)
	s.clock.skew.Store(int64(skew))
	s.clock.known.Store(true)
	off := skew > s.cfg.MaxClockSkew || skew < -s.cfg.MaxClockSkew
	if was := s.clock.skewed.Swap(off); was != off {
		if off {
			s.log.Error("this node's clock is off the database's: not ready, readings refused (503) and nothing expired until it is fixed; "+
				"synchronise the clock (NTP: chronyc tracking, timedatectl timesync-status)",
				"skew", roundSkew(skew).String(), "max_clock_skew", s.cfg.MaxClockSkew.String())
		} else {
			s.log.Info("this node's clock agrees with the database's again: serving", "skew", roundSkew(skew).String())
		}
	}
	return nil
}

// ClockSkew reports this node's clock minus the store's at the last
// comparison, and whether there was one (false on SQLite, or with
// Config.MaxClockSkew negative).
func (s *Service) ClockSkew() (time.Duration, bool) {
	return time.Duration(s.clock.skew.Load()), s.clock.known.Load()
}

// clockErr is the refusal while this node's clock is past the bound (nil
// when it is not).
func (s *Service) clockErr(what string) error {
	if !s.clock.skewed.Load() {
		return nil
	}
	skew := roundSkew(time.Duration(s.clock.skew.Load()))
	dir := "ahead of"
	if skew < 0 {
		dir, skew = "behind", -skew
	}
	return &kettle.Error{Code: kettle.EUnavailable, RetryAfter: s.cfg.RetryAfter, Cause: ErrClockSkew,
		Message: fmt.Sprintf("%s: this node's clock is %s %s the database's (more than --max-clock-skew %s), so it cannot judge retention or "+
			"the statistics' hours; retry after %s (another node will answer); operator: synchronise this node's clock (NTP)",
			what, skew, dir, s.cfg.MaxClockSkew, s.cfg.RetryAfter)}
}

// roundSkew is d as an operator reads it: to the second past a minute (the
// measurement's own error is milliseconds), to the millisecond below.
func roundSkew(d time.Duration) time.Duration {
	if d >= time.Minute || d <= -time.Minute {
		return d.Round(time.Second)
	}
	return d.Round(time.Millisecond)
}
