package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	gojson "github.com/goccy/go-json"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

// readBody reads a body of at most kettle.MaxBody bytes.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	return readBodyBuf(w, r, nil)
}

// readBodyBuf is readBody into buf's memory when it is large enough.
func readBodyBuf(w http.ResponseWriter, r *http.Request, buf []byte) ([]byte, error) {
	rd := http.MaxBytesReader(w, r.Body, kettle.MaxBody)
	var body []byte
	var err error
	if n := r.ContentLength; n > 0 && n <= kettle.MaxBody {
		// Sized from the header (net/http delivers exactly that many bytes
		// or an error): one allocation instead of io.ReadAll's doublings,
		// which cost a v1 batch of 500 readings ten copies.
		if int64(cap(buf)) >= n {
			body = buf[:n]
		} else {
			body = make([]byte, n)
		}
		_, err = io.ReadFull(rd, body)
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
	} else {
		body, err = io.ReadAll(rd)
	}
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, kettle.Errorf(kettle.ETooLarge, "request body over %d bytes; split the upload", kettle.MaxBody)
		}
		return nil, kettle.Errorf(kettle.EInvalid, "reading request body: %v", err)
	}
	return body, nil
}

// decodeJSON decodes body into v, rejecting trailing data and invalid UTF-8.
func decodeJSON(body []byte, v any) error {
	if !utf8.Valid(body) {
		return kettle.Errorf(kettle.EInvalid, "body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return kettle.Errorf(kettle.EInvalid, "empty body; send a JSON object")
		}
		return wire.JSONError(err, "")
	}
	if dec.More() {
		return kettle.Errorf(kettle.EInvalid, "malformed JSON: data after the first value")
	}
	return nil
}

// decodeObject decodes a request body that must be one JSON object whose
// members named in known are never null: the document gives each a type,
// and null is none of them (taking it as "absent" accepted what the
// document calls invalid: {"count": null}, and the body null itself, made a
// device). Other members are ignored, as the document allows.
func decodeObject(body []byte, v any, known ...string) error {
	var members map[string]json.RawMessage
	if err := decodeJSON(body, &members); err != nil {
		return err
	}
	if members == nil {
		return &kettle.Error{Code: kettle.EInvalid, Message: "invalid request", Fields: []kettle.FieldError{{Field: "body", Message: "must be a JSON object, got null"}}}
	}
	var errs []kettle.FieldError
	for k, raw := range members {
		if slices.Contains(known, k) && string(bytes.TrimSpace(raw)) == "null" {
			errs = append(errs, kettle.FieldError{Field: k, Message: "must not be null: leave it out for its default"})
		}
	}
	if len(errs) > 0 {
		slices.SortFunc(errs, func(a, b kettle.FieldError) int { return strings.Compare(a.Field, b.Field) })
		return &kettle.Error{Code: kettle.EInvalid, Message: "invalid request", Fields: errs}
	}
	return decodeJSON(body, v)
}

// writeJSON answers v as JSON with goccy/go-json, as the ingest path
// decodes: the same output as encoding/json (HTML-safe escaping, sorted map
// keys, shortest float forms), without its reflection on every value. A page
// of 1,000 readings of history spent half its CPU in encoding/json.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := gojson.Marshal(v)
	if err != nil {
		http.Error(w, `{"error":"internal","message":"encoding response"}`, 500)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}
