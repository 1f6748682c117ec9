package kettle

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Code classifies an Error; adapters map it once to an HTTP status or an
// MQTT reason code.
type Code string

// Error codes.
const (
	EInvalid      Code = "invalid"            // bad input: 400
	EUnauthorized Code = "unauthorized"       // missing or wrong credentials: 401
	EForbidden    Code = "forbidden"          // right credentials, wrong resource: 403
	ENotFound     Code = "not_found"          // 404
	EMethod       Code = "method_not_allowed" // a route with other methods: 405
	ETooLarge     Code = "too_large"          // body or batch over its limit: 413
	ETooMany      Code = "rate_limited"       // a device over its request rate: 429
	EUnavailable  Code = "unavailable"        // queue full, store down: 503
	EInternal     Code = "internal"           // a bug or an unexpected store failure: 500
)

// FieldError names one bad input field and says what is wrong with it.
type FieldError struct {
	Field   string `json:"field"`
	Message string `json:"message"`
}

func (f FieldError) String() string { return fmt.Sprintf("field %q: %s", f.Field, f.Message) }

// Error is kettlefleet's one error type. Message tells the operator or
// client what to do about it.
type Error struct {
	Code       Code
	Message    string
	Fields     []FieldError
	RetryAfter time.Duration // for EUnavailable and ETooMany
	// Cause is the internal failure behind the error (a driver error, a
	// path): in Error() for the log, never in Public() for a client, who
	// could read host, user, database or file names from it.
	Cause error
}

// Unwrap returns the internal cause.
func (e *Error) Unwrap() error { return e.Cause }

// MaxFieldsInMessage is how many field errors Error's text names; the rest
// are counted. A batch of 1,000 empty readings has 7,000 field errors: in
// full, ~250 KB of text for every log line, PUBACK reason and 400 answer
// that carries it.
const MaxFieldsInMessage = 10

// Error is the whole text, with the internal cause: for the log.
func (e *Error) Error() string {
	if e.Cause == nil {
		return e.Public()
	}
	return e.Public() + ": " + e.Cause.Error()
}

// Public is the text a client may read: the message and the fields it
// names, without the internal cause.
func (e *Error) Public() string {
	if len(e.Fields) == 0 {
		return e.Message
	}
	n := min(len(e.Fields), MaxFieldsInMessage)
	parts := make([]string, n, n+1)
	for i, f := range e.Fields[:n] {
		parts[i] = f.String()
	}
	if more := len(e.Fields) - n; more > 0 {
		parts = append(parts, fmt.Sprintf("and %d more", more))
	}
	if e.Message == "" {
		return strings.Join(parts, "; ")
	}
	return e.Message + ": " + strings.Join(parts, "; ")
}

// Errorf returns an *Error with the code and a formatted message.
func Errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// ErrorCode returns the code of the first *Error in err's chain, EInternal
// for any other error, and "" for nil.
func ErrorCode(err error) Code {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return EInternal
}
