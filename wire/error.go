package wire

import (
	"fmt"

	"github.com/kettlefleet/kettlefleet"
)

// ErrorJSON is every error answer's body: a stable code, a message for a
// person (never the internal cause: no driver, SQL, DSN or path text), the
// bad fields, and the request id the server's log names it by.
type ErrorJSON struct {
	Error     kettle.Code         `json:"error"`
	Message   string              `json:"message"`
	Fields    []kettle.FieldError `json:"fields,omitempty"`
	RequestID string              `json:"request_id"`
}

// MaxFieldsAnswered is how many field errors an error body lists.
const MaxFieldsAnswered = 100

// NewErrorJSON is e's body. Past MaxFieldsAnswered fields, one more entry
// counts the rest: the first ones name the problem, and all 7,000 of a
// batch of empty readings would be a ~500 KB answer to a 3 KB request.
func NewErrorJSON(e *kettle.Error, requestID string) ErrorJSON {
	fields := e.Fields
	if len(fields) > MaxFieldsAnswered {
		fields = append(fields[:MaxFieldsAnswered:MaxFieldsAnswered], kettle.FieldError{Field: "…", Message: fmt.Sprintf("%d more field errors not listed", len(e.Fields)-MaxFieldsAnswered)})
	}
	return ErrorJSON{Error: e.Code, Message: e.Public(), Fields: fields, RequestID: requestID}
}
