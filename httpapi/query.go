package httpapi

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/google/uuid"
	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// parameter given empty (?after=) is a value the document does not allow,
// not an absent one.
func queryValue(r *http.Request, name string) (string, bool) {
	vs, ok := r.URL.Query()[name]
	if !ok {
		return "", false
	}
	return vs[0], true
}

// queryTime parses an RFC 3339 query parameter into dst (UTC) when given.
func queryTime(r *http.Request, name string, dst *time.Time, errs *[]kettle.FieldError) {
	v, ok := queryValue(r, name)
	if !ok {
		return
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		*errs = append(*errs, kettle.FieldError{Field: name, Message: fmt.Sprintf("must be an RFC 3339 time, got %q", wire.Truncate(v, 64))})
		return
	}
	*dst = t.UTC()
}

// checkRange refuses a range whose end is not after its start: the same
// rule for history and statistics, stated in openapi.json's descriptions.
func checkRange(from, to time.Time, errs *[]kettle.FieldError) {
	if len(*errs) == 0 && !from.IsZero() && !to.IsZero() && !to.After(from) {
		*errs = append(*errs, kettle.FieldError{Field: "to", Message: fmt.Sprintf("must be after from (%s), got %s", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))})
	}
}

func queryInt(r *http.Request, name string, def, min, max int, errs *[]kettle.FieldError) int {
	v, ok := queryValue(r, name)
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < min || n > max {
		*errs = append(*errs, kettle.FieldError{Field: name, Message: fmt.Sprintf("must be an integer from %d to %d, got %q", min, max, wire.Truncate(v, 32))})
		return def
	}
	return n
}

func (a *API) statistics(r *http.Request) (kettle.Statistics, kettle.StatsQuery, error) {
	q := kettle.StatsQuery{ReportingSince: a.registry.Now().Add(-ReportingWindow)}
	var errs []kettle.FieldError
	queryTime(r, "from", &q.From, &errs)
	queryTime(r, "to", &q.To, &errs)
	checkRange(q.From, q.To, &errs)
	if len(errs) > 0 {
		return kettle.Statistics{}, q, &kettle.Error{Code: kettle.EInvalid, Message: "invalid query", Fields: errs}
	}
	s, err := a.reads.Statistics(r.Context(), q)
	return s, q, err
}

// pathDevice is the request's {id}; ok false means the 400 naming the field
// is written.
func (a *API) pathDevice(w http.ResponseWriter, r *http.Request) (kettle.DeviceID, bool) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		a.writeError(w, &kettle.Error{Code: kettle.EInvalid, Message: "invalid device id", Fields: []kettle.FieldError{{Field: "id", Message: fmt.Sprintf("must be a UUID, got %q", wire.Truncate(r.PathValue("id"), 64))}}})
		return uuid.Nil, false
	}
	return id, true
}
