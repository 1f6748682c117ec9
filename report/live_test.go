package report

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/sim"
)

// The live view's bounds and guards: loopback only without a token, a
// DNS-rebound Host refused, the token taken once from the address and
// kept in a cookie (or sent as a bearer), the stop only with its header,
// at most liveMaxClients streams, and nothing to stop once the run ended.
func TestLiveGuards(t *testing.T) {
	if _, err := StartLive(LiveOptions{Addr: "0.0.0.0:0"}); err == nil || !strings.Contains(err.Error(), "--ui-token-file") {
		t.Errorf("off loopback without a token: %v, want a refusal naming --ui-token-file", err)
	}
	var stops atomic.Int32
	const token = "0123456789abcdef-live"
	l, err := StartLive(LiveOptions{Addr: "127.0.0.1:0", Token: token, Stop: func() { stops.Add(1) }, Params: sim.Params{Devices: 5, DurationS: 9}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.End(nil, "", "", time.Second)
	base := strings.TrimSuffix(l.URL(), "/")
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	f := func(method, path string, hdr map[string]string, want int, wantBody string) *http.Response {
		t.Helper()
		r, _ := http.NewRequest(method, base+path, nil)
		for k, v := range hdr {
			r.Header.Set(k, v)
		}
		resp, err := noRedirect.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode != want || !strings.Contains(string(body), wantBody) {
			t.Errorf("%s %s: %d %.200q, want %d with %q", method, path, resp.StatusCode, body, want, wantBody)
		}
		return resp
	}
	bearer := map[string]string{"Authorization": "Bearer " + token}
	f("GET", "/", nil, 401, "token")
	f("GET", "/?token=wrong", nil, 401, "wrong token")
	resp := f("GET", "/?token="+token, nil, 303, "")
	var cookie string
	for _, c := range resp.Cookies() {
		if c.Name == liveCookie && c.HttpOnly && c.SameSite == http.SameSiteStrictMode {
			cookie = c.Name + "=" + c.Value
		}
	}
	if cookie == "" || resp.Header.Get("Location") != "/" {
		t.Fatalf("the token did not become a strict, HTTP-only cookie: %v", resp.Header)
	}
	f("GET", "/", map[string]string{"Cookie": cookie}, 200, `id="live-stop"`)
	f("GET", "/", bearer, 200, "kettle swarm")
	f("POST", "/stop", bearer, 400, LiveStopHeader)
	f("GET", "/stop", bearer, 405, "")
	f("POST", "/stop", map[string]string{LiveStopHeader: "1"}, 401, "")
	withStop := map[string]string{"Authorization": "Bearer " + token, LiveStopHeader: "1"}
	f("POST", "/stop", withStop, 202, "stopping")
	f("POST", "/stop", withStop, 202, "stopping") // twice: still one stop
	if n := stops.Load(); n != 1 {
		t.Errorf("stop called %d times, want once", n)
	}

	// Streams: up to the bound, then 503.
	var open []*http.Response
	for range liveMaxClients {
		r, _ := http.NewRequest("GET", base+"/events", nil)
		r.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(r)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("stream: %v %v", resp, err)
		}
		if line, _ := bufio.NewReader(resp.Body).ReadString('\n'); line != "event: state\n" {
			t.Errorf("stream starts %q, want its state", line)
		}
		open = append(open, resp)
	}
	f("GET", "/events", bearer, 503, "close one")
	for _, r := range open {
		r.Body.Close()
	}

	// Without a token: loopback names only.
	l2, err := StartLive(LiveOptions{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest("GET", l2.URL(), nil)
	r.Host = "attacker.example:80"
	if resp, err := http.DefaultClient.Do(r); err != nil || resp.StatusCode != 403 {
		t.Errorf("a rebound Host: %v %v, want 403", resp, err)
	}
	if resp, err := http.Get(l2.URL()); err != nil || resp.StatusCode != 200 {
		t.Errorf("loopback: %v %v, want 200", resp, err)
	}
	l2.End(nil, "", "", time.Second)
	if _, err := http.Get(l2.URL()); err == nil {
		t.Error("the live view still answers after End")
	}
}

// The stages of a shaped run become bands over its time series, as the
// faults do: one per change of the fleet (a step one second wide), and the
// rollout.
func TestStageBands(t *testing.T) {
	r := loadRecorded(t)
	r.Params.Stages = []sim.StageMark{{StartS: 0, EndS: 10, From: 0, To: 50}, {StartS: 10, EndS: 20, From: 50, To: 50}, {StartS: 20, EndS: 20, From: 50, To: 0}}
	r.Params.Rollout = &sim.RolloutMark{StartS: 5, EndS: 8, Share: 0.3, Batch: 10}
	s, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := []Band{
		{Name: "stage 1: 0 → 50 kettles over 10 s", Kind: "→ 50 kettles", T0: 0, T1: 10},
		{Name: "stage 3: 50 → 0 kettles at once", Kind: "→ 0 kettles", T0: 20, T1: 20},
		{Name: "firmware rollout: 30 % of the fleet to batches of 10", Kind: "rollout → batch 10", T0: 5, T1: 8},
	}
	if len(s.Stages) != len(want) {
		t.Fatalf("stage bands %+v, want %+v", s.Stages, want)
	}
	for i := range want {
		if s.Stages[i] != want[i] {
			t.Errorf("band %d: %+v, want %+v", i, s.Stages[i], want[i])
		}
	}
}
