package httpapi_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/httpapi"
)

// TestCommandCacheControl: a v1 poll's answer says no-cache (poll on
// schedule) unless the server asks kettles to poll less often
// (Config.PollMaxAge, while overloaded): then max-age in whole seconds, at
// least 1, on a 200 and on a 304 alike.
func TestCommandCacheControl(t *testing.T) {
	ctx := context.Background()
	svc, log := newService(t)
	id := uuid.New()
	if err := svc.RegisterIDs(ctx, []uuid.UUID{id}); err != nil {
		t.Fatal(err)
	}
	var maxAge time.Duration
	api := httpapi.New(svc, httpapi.Config{Secret: []byte("s"), PollMaxAge: func() time.Duration { return maxAge }}, log)
	tok := kettle.DeviceToken([]byte("s"), id)

	f := func(d time.Duration, etag string, wantStatus int, want string) string {
		t.Helper()
		maxAge = d
		req := httptest.NewRequest("GET", "/v1/command", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		if etag != "" {
			req.Header.Set("If-None-Match", etag)
		}
		w := httptest.NewRecorder()
		api.ServeHTTP(w, req)
		if w.Code != wantStatus || w.Header().Get("Cache-Control") != want {
			t.Errorf("max-age %v, If-None-Match %q: %d Cache-Control %q; want %d %q", d, etag, w.Code, w.Header().Get("Cache-Control"), wantStatus, want)
		}
		return w.Header().Get("ETag")
	}
	etag := f(0, "", 200, "no-cache")
	f(7*time.Second, "", 200, "max-age=7")
	f(7*time.Second, etag, 304, "max-age=7")
	f(300*time.Millisecond, etag, 304, "max-age=1")
	f(0, etag, 304, "no-cache")
}
