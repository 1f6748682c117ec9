package httpapi

import (
	"hash/fnv"
	"net/http"
	"strconv"
	"sync"
	"time"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// upload is the memory of one v1 upload, reused: allocating ~150 KB per
// batch of 500 (the body and its readings) cost kettle serve 7% of its CPU
// on batched uploads in zeroing it, and the collector ~10% more.
type upload struct {
	body []byte
	ms   []kettle.Measurement
}

var uploads = sync.Pool{New: func() any { return new(upload) }}

func getUpload() *upload { return uploads.Get().(*upload) }

func putUpload(u *upload) {
	u.body, u.ms = u.body[:0], u.ms[:0]
	uploads.Put(u)
}

func (a *API) v1Measurements(w http.ResponseWriter, r *http.Request) {
	release, ok := a.admitIngest(w, r)
	if !ok {
		return
	}
	defer release()
	id, err := a.device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	up := getUpload()
	defer putUpload(up)
	body, err := readBodyBuf(w, r, up.body)
	if err != nil {
		a.writeError(w, err)
		return
	}
	up.body = body
	ms, err := wire.DecodeV1Into(up.ms, body, id, a.ingest.Window())
	if err != nil {
		a.writeError(w, err)
		return
	}
	up.ms = ms
	// Ingest returns after the batcher copied the readings and committed:
	// nothing keeps ms or body past it, so they go back to the pool.
	stored, dups, err := a.ingest.Ingest(r.Context(), ms)
	if err != nil {
		a.writeError(w, err)
		return
	}
	writeJSON(w, 200, map[string]int{"stored": stored, "duplicates": dups})
}

func (a *API) v1Command(w http.ResponseWriter, r *http.Request) {
	id, err := a.device(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	c, next := a.registry.Command(id)
	etag := commandETag(c)
	w.Header().Set("ETag", etag)
	w.Header().Set("Cache-Control", a.commandCaching())
	if inm := r.Header.Get("If-None-Match"); inm != "" && inm == etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	writeJSON(w, 200, wire.NewCommandJSON(c, next))
}

// commandCaching is a v1 command's Cache-Control: no-cache (revalidate on
// every poll: an override may land at any time), or max-age while the
// server asks kettles to poll less often (Config.PollMaxAge).
func (a *API) commandCaching() string {
	if a.cfg.PollMaxAge == nil {
		return "no-cache"
	}
	d := a.cfg.PollMaxAge()
	if d <= 0 {
		return "no-cache"
	}
	return "max-age=" + strconv.Itoa(max(1, int(d/time.Second)))
}

// commandETag is the ETag of a command: FNV-1a of
// "charge|fill|flush|reason" (as fmt's %t|%t|%g|%s would print it), built
// without fmt — it is computed on every poll.
func commandETag(c kettle.Command) string {
	var buf [128]byte
	b := append(c.AppendActions(buf[:0]), '|')
	b = append(b, c.Reason...)
	h := fnv.New64a()
	h.Write(b)
	e := append(buf[:0], '"')
	e = strconv.AppendUint(e, h.Sum64(), 16)
	return string(append(e, '"'))
}

// StatsJSON is GET /v1/statistics's body.
type StatsJSON struct {
	From              *time.Time `json:"from"`
	To                *time.Time `json:"to"`
	MeasurementCount  int64      `json:"measurement_count"`
	RangeCount        int64      `json:"range_measurement_count"`
	DevicesRegistered int64      `json:"devices_registered"`
	DevicesReporting  int64      `json:"devices_reporting"`
	ReportingWindowS  int        `json:"reporting_window_s"`
	TotalChargeMWh    float64    `json:"total_battery_charge_mwh"`
	TotalWaterML      float64    `json:"total_water_volume_ml"`
	TotalPotentialCmL float64    `json:"total_potential_energy_c_ml"`
	TotalPotentialJ   float64    `json:"total_potential_energy_j"`
	ByHour            []HourJSON `json:"temperature_by_hour"`
}

// HourJSON is statistic 5 for one hour of the day.
type HourJSON struct {
	Hour    int      `json:"hour"`
	Count   int64    `json:"count"`
	Water   MeanJSON `json:"water_temp_c"`
	Ambient MeanJSON `json:"ambient_temp_c"`
}

// MeanJSON is a mean with its population standard deviation.
type MeanJSON struct {
	Mean   float64 `json:"mean"`
	Stddev float64 `json:"stddev"`
}

func (a *API) v1Statistics(w http.ResponseWriter, r *http.Request) {
	s, q, err := a.statistics(r)
	if err != nil {
		a.writeError(w, err)
		return
	}
	out := StatsJSON{
		MeasurementCount: s.MeasurementCount, RangeCount: s.RangeCount,
		DevicesRegistered: s.DevicesRegistered, DevicesReporting: s.DevicesReporting,
		ReportingWindowS: int(ReportingWindow / time.Second),
		TotalChargeMWh:   s.TotalChargeMWh, TotalWaterML: s.TotalWaterML,
		TotalPotentialCmL: s.TotalPotentialCmL, TotalPotentialJ: s.TotalPotentialJ(),
		ByHour: make([]HourJSON, 24),
	}
	// The range aggregated: the stores sum whole hours of rollups, from
	// the hour holding from up to the hour holding to, that one excluded.
	if !q.From.IsZero() {
		f := q.From.Truncate(time.Hour)
		out.From = &f
	}
	if !q.To.IsZero() {
		t := q.To.Truncate(time.Hour)
		out.To = &t
	}
	for i, h := range s.ByHour {
		out.ByHour[i] = HourJSON{Hour: i, Count: h.Water.N, Water: MeanJSON{h.Water.Mean, h.Water.Stddev()}, Ambient: MeanJSON{h.Ambient.Mean, h.Ambient.Stddev()}}
	}
	writeJSON(w, 200, out)
}
