package httpapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/google/uuid"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// MeasurementJSON is a stored reading as the v1 API returns it.
// kafka.ReadingJSON has the same fields and names on purpose, but it is the
// readings log's record, versioned with the log's schema: the two change
// apart.
type MeasurementJSON struct {
	Time    time.Time `json:"time"`
	Charge  float64   `json:"battery_charge_mwh"`
	Full    float64   `json:"battery_full_mwh"`
	Rate    float64   `json:"battery_rate_mw"`
	Ambient float64   `json:"ambient_temp_c"`
	Water   float64   `json:"water_temp_c"`
	Level   float64   `json:"water_level_ml"`
}

func toJSON(m *kettle.Measurement) *MeasurementJSON {
	if m == nil {
		return nil
	}
	return &MeasurementJSON{m.Time, m.ChargeMWh, m.FullMWh, m.RateMW, m.AmbientC, m.WaterC, m.LevelML}
}

// OverrideJSON is an operator override on the wire.
type OverrideJSON struct {
	Charge      *bool      `json:"charge,omitempty"`
	Fill        *bool      `json:"fill,omitempty"`
	FlushMLPerS *float64   `json:"flush_ml_per_s,omitempty"`
	ExpiresAt   *time.Time `json:"expires_at"`
	SetAt       *time.Time `json:"set_at,omitempty"`
	Active      bool       `json:"active"`
}

// DeviceJSON is a device with its latest state.
type DeviceJSON struct {
	ID           kettle.DeviceID   `json:"id"`
	RegisteredAt time.Time         `json:"registered_at"`
	LastSeen     *time.Time        `json:"last_seen"`
	Latest       *MeasurementJSON  `json:"latest"`
	CapacityML   float64           `json:"capacity_ml"`
	Measurements int64             `json:"measurements"`
	Command      *wire.CommandJSON `json:"command,omitempty"`
	Override     *OverrideJSON     `json:"override,omitempty"`
	RevokedAt    *time.Time        `json:"revoked_at,omitempty"`
}

func (a *API) deviceJSON(d kettle.DeviceState, withCommand bool) DeviceJSON {
	j := DeviceJSON{ID: d.ID, RegisteredAt: d.RegisteredAt, Latest: toJSON(d.Latest), CapacityML: d.CapacityML, Measurements: d.Measurements}
	if !d.RevokedAt.IsZero() {
		t := d.RevokedAt
		j.RevokedAt = &t
	}
	if !d.LastSeen.IsZero() {
		t := d.LastSeen
		j.LastSeen = &t
	}
	now := a.registry.Now()
	if o := d.Override; o != nil {
		exp, set := o.ExpiresAt, o.SetAt
		j.Override = &OverrideJSON{Charge: o.Charge, Fill: o.Fill, FlushMLPerS: o.FlushMLPerS, ExpiresAt: &exp, SetAt: &set, Active: o.ActiveAt(now)}
	}
	if withCommand {
		c := kettle.Decide(kettle.PolicyInput{Latest: d.Latest, CapacityML: d.CapacityML, Override: d.Override, Now: now})
		next := kettle.NextChange(now, d.Override, a.registry.PollInterval())
		cj := wire.NewCommandJSON(c, next)
		j.Command = &cj
	}
	return j
}

func (a *API) createDevices(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	req := struct {
		Count *int `json:"count"`
	}{}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := decodeObject(body, &req, "count"); err != nil {
			a.writeError(w, err)
			return
		}
	}
	n := 1
	if req.Count != nil {
		n = *req.Count
	}
	if n < 1 || n > kettle.MaxBatch {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid request", Fields: []kettle.FieldError{{Field: "count", Message: fmt.Sprintf("must be between 1 and %d, got %d", kettle.MaxBatch, n)}}})
		return
	}
	ids, err := a.registry.Register(r.Context(), n)
	if err != nil {
		a.writeError(w, err)
		return
	}
	type dev struct {
		ID    kettle.DeviceID `json:"id"`
		Token string          `json:"token"`
	}
	out := make([]dev, len(ids))
	for i, id := range ids {
		out[i] = dev{id, kettle.DeviceToken(a.cfg.Secret, id)}
	}
	writeJSON(w, http.StatusCreated, map[string]any{"devices": out})
}

func (a *API) listDevices(w http.ResponseWriter, r *http.Request) {
	var errs []kettle.FieldError
	limit := queryInt(r, "limit", 20, 1, 1000, &errs)
	after := uuid.Nil
	if v, ok := queryValue(r, "after"); ok {
		id, err := uuid.Parse(v)
		if err != nil {
			errs = append(errs, kettle.FieldError{Field: "after", Message: fmt.Sprintf("must be a device id (the previous page's next), got %q", wire.Truncate(v, 64))})
		}
		after = id
	}
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs})
		return
	}
	ds, err := a.reads.Devices(r.Context(), after, limit)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := make([]DeviceJSON, len(ds))
	for i, d := range ds {
		out[i] = a.deviceJSON(d, false)
	}
	next := ""
	if len(ds) == limit {
		next = ds[len(ds)-1].ID.String()
	}
	writeJSON(w, 200, map[string]any{"devices": out, "next": next})
}

func (a *API) getDevice(w http.ResponseWriter, r *http.Request, id kettle.DeviceID) {
	d, err := a.reads.Device(r.Context(), id)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, a.deviceJSON(d, true))
}

func (a *API) history(w http.ResponseWriter, r *http.Request, id kettle.DeviceID) {
	var errs []kettle.FieldError
	q := kettle.HistoryQuery{Device: id}
	q.Limit = queryInt(r, "limit", 100, 1, 1000, &errs)
	queryTime(r, "from", &q.From, &errs)
	queryTime(r, "to", &q.To, &errs)
	queryTime(r, "after", &q.After, &errs)
	checkRange(q.From, q.To, &errs)
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs})
		return
	}
	ms, err := a.reads.History(r.Context(), q)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := make([]*MeasurementJSON, len(ms))
	for i := range ms {
		out[i] = toJSON(&ms[i])
	}
	next := ""
	if len(ms) == q.Limit {
		next = ms[len(ms)-1].Time.Format(time.RFC3339Nano)
	}
	writeJSON(w, 200, map[string]any{"measurements": out, "next": next})
}

func (a *API) putOverride(w http.ResponseWriter, r *http.Request) {
	id, ok := a.pathDevice(w, r)
	if !ok {
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req OverrideJSON
	if err := decodeObject(body, &req, "charge", "fill", "flush_ml_per_s", "expires_at"); err != nil {
		a.writeError(w, err)
		return
	}
	now := a.registry.Now()
	var errs []kettle.FieldError
	if req.ExpiresAt == nil {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "required (RFC 3339)"})
	} else if !req.ExpiresAt.After(now) {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "must be in the future"})
	} else if req.ExpiresAt.After(now.Add(366 * 24 * time.Hour)) {
		errs = append(errs, kettle.FieldError{Field: "expires_at", Message: "must be within a year"})
	}
	if req.FlushMLPerS != nil && (*req.FlushMLPerS < 0 || *req.FlushMLPerS > 1000 || *req.FlushMLPerS != *req.FlushMLPerS) {
		errs = append(errs, kettle.FieldError{Field: "flush_ml_per_s", Message: "must be between 0 (off) and 1000"})
	}
	if req.Charge == nil && req.Fill == nil && req.FlushMLPerS == nil {
		errs = append(errs, kettle.FieldError{Field: "charge", Message: "set at least one of charge, fill, flush_ml_per_s"})
	}
	if len(errs) > 0 {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid override", Fields: errs})
		return
	}
	o := kettle.Override{Charge: req.Charge, Fill: req.Fill, FlushMLPerS: req.FlushMLPerS, ExpiresAt: req.ExpiresAt.UTC().Truncate(kettle.TimePrecis), SetAt: now.UTC().Truncate(kettle.TimePrecis)}
	if err := a.registry.SetOverride(r.Context(), id, o); err != nil {
		a.writeError(w, err)
		return
	}
	d, err := a.reads.Device(r.Context(), id)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, a.deviceJSON(d, true))
}

// revokeDevice decommissions a device: its credentials are refused from now
// on, its history stays in the statistics.
func (a *API) revokeDevice(w http.ResponseWriter, r *http.Request) {
	a.onDevice(w, r, a.registry.Revoke)
}

// PruneJSON is the body of POST /v1/devices/prune.
type PruneJSON struct {
	OlderThan string `json:"older_than"` // "24h", "7d"
	DryRun    bool   `json:"dry_run"`
}

// pruneDevices removes stale registrations: devices registered more than
// older_than ago that never stored a reading (fleet.Service.Prune).
func (a *API) pruneDevices(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req PruneJSON
	if err := decodeObject(body, &req, "older_than", "dry_run"); err != nil {
		a.writeError(w, err)
		return
	}
	age, err := kettle.ParseAge(req.OlderThan)
	if req.OlderThan == "" {
		err = errors.New("required: an age such as 24h or 7d")
	}
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid prune", Fields: []kettle.FieldError{{Field: "older_than", Message: err.Error()}}})
		return
	}
	// A registry of a million stale devices takes a thousand transactions:
	// longer than the server's write timeout allows an ordinary answer.
	http.NewResponseController(w).SetWriteDeadline(time.Now().Add(pruneWriteTimeout))
	res, err := a.registry.Prune(r.Context(), age, req.DryRun)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]any{
		"removed":            res.Removed,
		"registered_before":  res.Before.Format(time.RFC3339Nano),
		"dry_run":            res.DryRun,
		"took_ms":            float64(res.Took.Microseconds()) / 1000,
		"devices_registered": a.registry.DeviceCount(),
	})
}

// pruneWriteTimeout is how long a prune may run before its answer.
const pruneWriteTimeout = 10 * time.Minute

func (a *API) deleteOverride(w http.ResponseWriter, r *http.Request) {
	a.onDevice(w, r, a.registry.ClearOverride)
}

// onDevice runs act on the path's device and answers 204 once it is done.
func (a *API) onDevice(w http.ResponseWriter, r *http.Request, act func(context.Context, kettle.DeviceID) error) {
	id, ok := a.pathDevice(w, r)
	if !ok {
		return
	}
	if err := act(r.Context(), id); err != nil {
		a.writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
