package httpapi

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strconv"
	"sync/atomic"
)

// RequestIDHeader carries a request's id, on every answer.
const RequestIDHeader = "X-Request-Id"

// requestIDs makes request ids: a random prefix per process and a counter,
// unique across nodes and restarts without reading randomness per request.
type requestIDs struct {
	prefix string
	n      atomic.Uint64
}

func newRequestIDs() requestIDs {
	b := make([]byte, 6)
	rand.Read(b)
	return requestIDs{prefix: hex.EncodeToString(b) + "-"}
}

// of is the id of r: the one a client or a proxy in front (HAProxy's
// unique-id) sent, when it is short and plain, so that their logs and
// ours name a request alike; else a new one.
func (g *requestIDs) of(r *http.Request) string {
	if v := r.Header[RequestIDHeader]; len(v) == 1 && plainID(v[0]) {
		return v[0]
	}
	return g.prefix + strconv.FormatUint(g.n.Add(1), 36)
}

// plainID reports whether s may be echoed as a request id: 1 to 64 letters,
// digits and . _ : - (nothing a log or a header could be confused by).
func plainID(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == ':' || c == '-') {
			return false
		}
	}
	return true
}
