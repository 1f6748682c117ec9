package httpapi

import (
	"net/http"
	"strconv"

	"github.com/google/uuid"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// v0Device is the case-study credential: a UUID the fleet issued, on any
// node (an id this node has not seen yet is looked up in the store: 503 +
// Retry-After while the store cannot say, never 401 for an issued id). The
// request is taken against the device's rate (--device-rate: 429 over it).
func (a *API) v0Device(r *http.Request) (kettle.DeviceID, error) {
	c := r.Header.Get("servant-auth-cookie")
	if c == "" {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "missing servant-auth-cookie header; POST /login first")
	}
	id, err := uuid.Parse(c)
	ok := err == nil
	if ok {
		if ok, err = a.registry.Issued(r.Context(), id); err != nil {
			return uuid.Nil, err
		}
	}
	if !ok {
		return uuid.Nil, kettle.Errorf(kettle.EUnauthorized, "unknown device; POST /login to register")
	}
	return id, a.allow(r, id)
}

func (a *API) v0Login(w http.ResponseWriter, r *http.Request) {
	if err := holdOverRate(r, a.limits.AllowLogin(remoteAddr(r))); err != nil {
		a.writeError(w, err)
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	var req struct {
		Username *string `json:"username"`
	}
	if err := decodeJSON(body, &req); err != nil {
		a.writeError(w, err)
		return
	}
	if req.Username == nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid login", Fields: []kettle.FieldError{{Field: "username", Message: "required"}}})
		return
	}
	ids, err := a.registry.Register(r.Context(), 1)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]string{"username": ids[0].String()})
}

func (a *API) v0Command(w http.ResponseWriter, r *http.Request) {
	id, err := a.v0Device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	c, _ := a.registry.Command(id)
	b := wire.AppendCommandV0(make([]byte, 0, 128), c)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Write(b)
}

func (a *API) v0Measurement(w http.ResponseWriter, r *http.Request) {
	release, ok := a.admitIngest(w, r)
	if !ok {
		return
	}
	defer release()
	id, err := a.v0Device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	body, err := readBody(w, r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	m, err := wire.DecodeV0(body, id, a.ingest.Window())
	if err != nil {
		a.writeError(w, err)
		return
	}
	if _, _, err := a.ingest.Ingest(r.Context(), []kettle.Measurement{m}); err != nil {
		a.writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", "3")
	w.Write([]byte("[]\n"))
}

func (a *API) v0Statistics(w http.ResponseWriter, r *http.Request) {
	s, _, err := a.statistics(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	hours := make([][2]any, 0, 24)
	for _, h := range s.ByHour {
		if h.Water.N > 0 {
			hours = append(hours, [2]any{h.Hour, [2]float64{h.Water.Mean, h.Water.Stddev()}})
		}
	}
	writeJSON(w, 200, map[string]any{
		"statsMeasurementCount":   s.MeasurementCount,
		"statsNumDevices":         s.DevicesRegistered,
		"statsTotalBatteryCharge": s.TotalChargeMWh,
		"statsTotalWaterVolume":   s.TotalWaterML,
		"statsMeanTemperature":    hours,
		"statsTotalWaterEnergy":   s.TotalPotentialJ(),
	})
}
