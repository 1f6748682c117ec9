package web_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/browsertest"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/web"
)

// fleetUnderTest is a real kettle serve with readings from a few kettles,
// and the URL the browser opens.
type fleetUnderTest struct {
	srv   *server.Server
	url   string
	devs  []kettle.DeviceID // [0], [1] report now; [2] went silent 10 min ago; [3] never reported
	token map[kettle.DeviceID]string
}

// startFleet starts the real server on :0, as kettle serve does, with the
// dashboard it mounts.
func startFleet(t *testing.T) *fleetUnderTest {
	t.Helper()
	dir := t.TempDir()
	var lag atomic.Int64 // the server clock runs this far behind, to make a kettle go silent in the past
	srv, err := server.Start(t.Context(), server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + filepath.Join(dir, "k.db"), DataDir: dir,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now:    func() time.Time { return time.Now().Add(-time.Duration(lag.Load())) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	f := &fleetUnderTest{srv: srv, url: srv.URL(), token: map[kettle.DeviceID]string{}}

	// server.Start mounts the dashboard and lets its sessions reach the API
	// as the operator (httpapi.Config.OperatorSession): the browser talks
	// to the server directly.
	res, err := http.Get(srv.URL() + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if ct := res.Header.Get("Content-Type"); res.StatusCode != 200 || !strings.HasPrefix(ct, "text/html") {
		t.Fatalf("GET / → %d %s %.200q: server.Start does not serve the dashboard", res.StatusCode, ct, body)
	}

	// Provision four kettles over the API.
	var created struct {
		Devices []struct {
			ID    kettle.DeviceID `json:"id"`
			Token string          `json:"token"`
		} `json:"devices"`
	}
	f.call(t, "POST", "/v1/devices", srv.OperatorToken(), `{"count":4}`, 201, &created)
	for _, d := range created.Devices {
		f.devs = append(f.devs, d.ID)
		f.token[d.ID] = kettle.DeviceToken(srv.Secret(), d.ID)
		if f.token[d.ID] != d.Token {
			t.Fatalf("token of %s from the API differs from kettle.DeviceToken", d.ID)
		}
	}
	// 24 h of readings every 10 min for three of them, in one batch each.
	now := time.Now()
	for k, id := range f.devs[:3] {
		var ms []map[string]any
		for i := 143; i >= 0; i-- {
			ts := now.Add(-time.Duration(i)*10*time.Minute - 5*time.Second)
			h := float64(ts.UTC().Hour()) + float64(ts.UTC().Minute())/60
			ms = append(ms, map[string]any{
				"time":               ts.UTC().Format(time.RFC3339Nano),
				"battery_charge_mwh": 2000 + 1500*math.Sin(float64(i)/20+float64(k)) + float64(300*k),
				"battery_full_mwh":   4000,
				"battery_rate_mw":    -50 + 10*float64(k),
				"ambient_temp_c":     19 + 4*math.Sin((h-9)*math.Pi/12) + float64(k),
				"water_temp_c":       55 + 15*math.Sin((h-6)*math.Pi/12+float64(k)) + 4*math.Sin(float64(i)),
				"water_level_ml":     700 + 250*math.Sin(float64(i)/9+float64(k)),
			})
		}
		if k == 2 {
			lag.Store(int64(10 * time.Minute))
		}
		b, _ := json.Marshal(ms)
		f.call(t, "POST", "/v1/measurements", f.token[id], string(b), 200, nil)
		lag.Store(0)
	}
	return f
}

// call does one API request with a bearer token and decodes the answer.
func (f *fleetUnderTest) call(t *testing.T, method, path, token, body string, want int, out any) {
	t.Helper()
	req, _ := http.NewRequest(method, f.srv.URL()+path, strings.NewReader(body))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != want {
		t.Fatalf("%s %s: %d %s, want %d", method, path, res.StatusCode, b, want)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
	}
}

// browserEvents collects what the page must not do (console errors,
// exceptions, failed loads) and what it transfers.
type browserEvents struct {
	mu       sync.Mutex
	phase    string
	problems []string
	bytes    map[string]float64 // by phase
	requests map[string]int
}

func (b *browserEvents) setPhase(p string) { b.mu.Lock(); b.phase = p; b.mu.Unlock() }

func (b *browserEvents) listen(ev any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch ev := ev.(type) {
	case *runtime.EventConsoleAPICalled:
		if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeAssert || ev.Type == runtime.ConsoleAPICalledTypeWarning {
			var args []string
			for _, a := range ev.Args {
				args = append(args, string(a.Value)+a.Description)
			}
			b.problems = append(b.problems, fmt.Sprintf("[%s] console.%s: %s", b.phase, ev.Type, strings.Join(args, " ")))
		}
	case *runtime.EventExceptionThrown:
		d := ev.ExceptionDetails
		desc := d.Text
		if d.Exception != nil {
			desc += " " + d.Exception.Description
		}
		b.problems = append(b.problems, fmt.Sprintf("[%s] exception at %s:%d: %s", b.phase, d.URL, d.LineNumber+1, desc))
	case *log.EventEntryAdded:
		e := ev.Entry
		if e.Level != log.EntryLevelError {
			return
		}
		// The one error a user may see: the refused sign-in with a wrong token.
		if b.phase == "wrong-token" && strings.HasSuffix(e.URL, "/session") && strings.Contains(e.Text, "401") {
			return
		}
		b.problems = append(b.problems, fmt.Sprintf("[%s] browser log: %s %s", b.phase, e.Text, e.URL))
	case *network.EventLoadingFinished:
		b.bytes[b.phase] += ev.EncodedDataLength
		b.requests[b.phase]++
	}
}

// TestDashboardInBrowser drives the dashboard in Chromium against the real
// server: refused with a wrong token, signed in, statistics equal to the API,
// devices, one kettle, an override that changes the kettle's command and is
// cleared, sign out. Screenshots go to $KETTLE_TEST_OUT or a temp dir.
func TestDashboardInBrowser(t *testing.T) {
	start := time.Now()
	f := startFleet(t)
	out := browsertest.OutDir(t)
	t.Logf("screenshots in %s", out)

	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	bctx := browsertest.New(t, ctx, 1280, 900, chromedp.Flag("mute-audio", true), chromedp.Flag("lang", "en-US"))

	ev := &browserEvents{phase: "first-page", bytes: map[string]float64{}, requests: map[string]int{}}
	if err := chromedp.Listen(bctx, ev.listen); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	t.Logf("Chromium up after %v", time.Since(start).Round(time.Millisecond))

	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		must(what, chromedp.Do(bctx, steps...))
	}
	// until waits for a JavaScript condition.
	until := func(what, expr string) {
		t.Helper()
		_, err := chromedp.Run(bctx, chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingTimeout(15*time.Second)))
		must("wait for "+what+" ("+expr+")", err)
	}
	eval := func(expr string, out any) {
		t.Helper()
		raw, err := chromedp.Run(bctx, chromedp.Evaluate[[]byte](expr))
		must(expr, err)
		if out != nil {
			must("decode "+expr, json.Unmarshal(raw, out))
		}
	}
	shot := func(name string) {
		t.Helper()
		// Let the charts settle on their final width before the picture.
		do("settle", chromedp.Sleep(150*time.Millisecond))
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		must("screenshot "+name, err)
		must("write screenshot", os.WriteFile(filepath.Join(out, name+".png"), png, 0o644))
	}
	// setField sets a form field as a user would, with its events.
	setField := func(sel, value string) {
		t.Helper()
		eval(fmt.Sprintf(`(() => { const el = document.querySelector(%q); el.value = %q;
			el.dispatchEvent(new Event('input', {bubbles: true})); el.dispatchEvent(new Event('change', {bubbles: true})); return true })()`, sel, value), nil)
	}
	bodyText := func() string {
		var s string
		eval(`document.body.innerText`, &s)
		return s
	}
	var stats struct {
		MeasurementCount  int64   `json:"measurement_count"`
		DevicesRegistered int64   `json:"devices_registered"`
		DevicesReporting  int64   `json:"devices_reporting"`
		TotalCharge       float64 `json:"total_battery_charge_mwh"`
		TotalWater        float64 `json:"total_water_volume_ml"`
		TotalPotentialJ   float64 `json:"total_potential_energy_j"`
		ByHour            []struct {
			Hour  int   `json:"hour"`
			Count int64 `json:"count"`
			Water struct {
				Mean, Stddev float64
			} `json:"water_temp_c"`
			Ambient struct {
				Mean, Stddev float64
			} `json:"ambient_temp_c"`
		} `json:"temperature_by_hour"`
	}
	f.call(t, "GET", "/v1/statistics", f.srv.OperatorToken(), "", 200, &stats)
	if stats.MeasurementCount != 3*144 || stats.DevicesRegistered != 4 || stats.DevicesReporting != 2 {
		t.Fatalf("seeded fleet: %+v", stats)
	}

	// ---- first page, and a wrong token ----
	do("open the page", chromedp.EmulateViewport(1280, 900), chromedp.Navigate(f.url+"/"))
	until("sign-in form", `document.querySelector('#token') !== null`)
	ev.setPhase("wrong-token")
	do("type a wrong token", chromedp.SendKeys(chromedp.CSS("#token"), "not-the-token"), chromedp.Click(chromedp.CSS("#signin-form button[type=submit]")))
	until("refusal", `document.querySelector('#signin-error').textContent.length > 0`)
	text := bodyText()
	for _, id := range f.devs {
		if strings.Contains(text, id.String()[:8]) {
			t.Errorf("a refused visitor sees kettle %s", id)
		}
	}
	var leaked int
	eval(`document.querySelectorAll('[data-stat], #dev-table, #hour-chart, #top:not([hidden])').length`, &leaked)
	if leaked != 0 || strings.Contains(text, fmt.Sprint(stats.MeasurementCount)) {
		t.Errorf("a refused visitor sees fleet elements (%d) or figures:\n%s", leaked, text)
	}
	cookies, err := chromedp.Call(bctx, network.GetCookies, network.GetCookiesParams{URLs: []string{f.url}})
	must("cookies", err)
	if len(cookies.Cookies) != 0 {
		t.Errorf("a refused sign-in left cookies: %+v", cookies.Cookies[0])
	}
	shot("signin-refused-1280")

	// ---- sign in ----
	ev.setPhase("sign-in")
	setField("#token", "")
	do("type the operator token", chromedp.SendKeys(chromedp.CSS("#token"), f.srv.OperatorToken()),
		chromedp.Click(chromedp.CSS("#signin-form button[type=submit]")))
	until("fleet statistics", `document.querySelector('[data-stat="measurement_count"]')?.dataset.value !== undefined && document.querySelector('#hour-chart svg') !== null`)
	ev.mu.Lock()
	firstPage := ev.bytes["first-page"] + ev.bytes["wrong-token"] + ev.bytes["sign-in"]
	nreq := ev.requests["first-page"] + ev.requests["wrong-token"] + ev.requests["sign-in"]
	ev.mu.Unlock()
	t.Logf("first page, signed in with the fleet shown: %.1f KB transferred in %d requests", firstPage/1024, nreq)
	if firstPage > 300*1024 {
		t.Errorf("first page transferred %.0f bytes, budget 300 KB", firstPage)
	}
	cookies, err = chromedp.Call(bctx, network.GetCookies, network.GetCookiesParams{URLs: []string{f.url}})
	must("cookies", err)
	var session *network.Cookie
	for _, c := range cookies.Cookies {
		if c.Name == web.CookieName {
			session = c
		}
	}
	if session == nil || !session.HTTPOnly || session.SameSite != network.CookieSameSiteStrict || session.Path != "/" {
		t.Fatalf("session cookie %+v: want HttpOnly, SameSite=Strict, Path=/", session)
	}
	var jsCookies string
	eval(`document.cookie`, &jsCookies)
	if strings.Contains(jsCookies, web.CookieName) {
		t.Errorf("the page's scripts can read the session cookie")
	}

	// ---- fleet: the figures are the API's ----
	ev.setPhase("fleet")
	var shown map[string]string
	eval(`Object.fromEntries([...document.querySelectorAll('[data-stat]')].map(e => [e.dataset.stat, e.dataset.value]))`, &shown)
	check := func(name string, want float64) {
		t.Helper()
		var got float64
		if _, err := fmt.Sscan(shown[name], &got); err != nil || math.Abs(got-want) > 1e-9*math.Max(1, math.Abs(want)) {
			t.Errorf("page shows %s = %q, API says %v", name, shown[name], want)
		}
	}
	check("measurement_count", float64(stats.MeasurementCount))
	check("devices_registered", float64(stats.DevicesRegistered))
	check("devices_reporting", float64(stats.DevicesReporting))
	check("total_battery_charge_mwh", stats.TotalCharge)
	check("total_water_volume_ml", stats.TotalWater)
	check("total_potential_energy_j", stats.TotalPotentialJ)
	var hours []map[string]string
	eval(`[...document.querySelectorAll('#hour-table tbody tr')].map(r => ({...r.dataset}))`, &hours)
	if len(hours) != 24 {
		t.Fatalf("hour table has %d rows, want 24", len(hours))
	}
	for i, h := range stats.ByHour {
		row := hours[i]
		if row["count"] != fmt.Sprint(h.Count) {
			t.Errorf("hour %d: page count %q, API %d", i, row["count"], h.Count)
			continue
		}
		if h.Count == 0 {
			continue
		}
		for k, want := range map[string]float64{"waterMean": h.Water.Mean, "waterSd": h.Water.Stddev, "ambientMean": h.Ambient.Mean, "ambientSd": h.Ambient.Stddev} {
			var got float64
			fmt.Sscan(row[k], &got)
			if math.Abs(got-want) > 1e-9*math.Max(1, math.Abs(want)) {
				t.Errorf("hour %d %s: page %q, API %v", i, k, row[k], want)
			}
		}
	}
	var bandPaths int
	eval(`document.querySelectorAll('#hour-chart path.band').length`, &bandPaths)
	if bandPaths < 2 {
		t.Errorf("temperature chart has %d ±1σ bands, want water and ambient", bandPaths)
	}
	// The live refresh measures the ingest rate from the second poll on.
	until("live measurements/s", `/^[0-9.,]+$/.test(document.querySelector('#mps').textContent)`)
	// The range picker re-queries: the last 24 h hold every seeded reading but one
	// batch's oldest, so range_measurement_count changes and the label says so.
	setField("#preset", "1")
	until("range applied", `document.querySelector('#range-label').textContent !== 'All time'`)
	setField("#preset", "all")
	until("range reset", `document.querySelector('#range-label').textContent === 'All time'`)
	shot("fleet-1280")

	// ---- devices ----
	ev.setPhase("devices")
	do("open devices", chromedp.Click(chromedp.CSS(`a[data-nav="devices"]`)))
	until("device rows", `document.querySelectorAll('#dev-table tbody tr[data-id]').length === 4`)
	var statuses map[string]string
	eval(`Object.fromEntries([...document.querySelectorAll('#dev-table tbody tr[data-id]')].map(r => [r.dataset.id, r.className]))`, &statuses)
	want := map[kettle.DeviceID]string{f.devs[0]: "online", f.devs[1]: "online", f.devs[2]: "offline", f.devs[3]: "never"}
	for id, w := range want {
		if statuses[id.String()] != w {
			t.Errorf("kettle %s marked %q, want %q", id, statuses[id.String()], w)
		}
	}
	// Sort by battery: lowest first, never-reported last.
	do("sort by battery", chromedp.Click(chromedp.CSS(`th[data-key="battery"] button`)))
	var order []string
	eval(`[...document.querySelectorAll('#dev-table tbody tr[data-id]')].map(r => r.dataset.id)`, &order)
	if order[3] != f.devs[3].String() {
		t.Errorf("sorted by battery, the kettle with no reading is not last: %v", order)
	}
	shot("devices-1280")
	// Search by id prefix pages through the API from that prefix.
	prefix := f.devs[1].String()[:3]
	do("search", chromedp.SendKeys(chromedp.CSS("#q"), prefix))
	until("search result", fmt.Sprintf(`(() => { const ids = [...document.querySelectorAll('#dev-table tbody tr[data-id]')].map(r => r.dataset.id);
		return ids.includes(%q) && ids.every(id => id.startsWith(%q)) })()`, f.devs[1].String(), prefix))
	setField("#q", "")

	// ---- one kettle ----
	ev.setPhase("kettle")
	dev := f.devs[0]
	do("open a kettle", chromedp.Click(chromedp.CSS(fmt.Sprintf(`tr[data-id="%s"] a.id`, dev))))
	until("kettle state and charts", `document.querySelector('#cmd-reason')?.textContent.length > 0 && document.querySelector('#c-temp svg path.line') !== null && document.querySelector('#c-battery svg') !== null`)
	var before, after kettleCommand
	f.call(t, "GET", "/v1/command", f.token[dev], "", 200, &before)
	var reason string
	eval(`document.querySelector('#cmd-reason').textContent`, &reason)
	if reason != before.Reason {
		t.Errorf("page shows reason %q, the kettle is told %q", reason, before.Reason)
	}
	shot("kettle-1280")

	// Override: the opposite of what the policy says for charge and fill, and a flush.
	setField("#ov-charge", fmt.Sprint(!before.Charge))
	setField("#ov-fill", fmt.Sprint(!before.Fill))
	setField("#ov-flush", "rate")
	setField("#ov-rate", "7.5")
	setField("#ov-for", "60")
	do("apply override", chromedp.Click(chromedp.CSS("#ov-apply")))
	until("override applied", `document.querySelector('#ov-ok').textContent.includes('applied')`)
	f.call(t, "GET", "/v1/command", f.token[dev], "", 200, &after)
	if after.Charge == before.Charge || after.Fill == before.Fill || after.FlushMLPerS != 7.5 || !strings.Contains(after.Reason, "override") {
		t.Errorf("after the override the kettle is told %+v; before %+v", after, before)
	}
	eval(`document.querySelector('#cmd-reason').textContent`, &reason)
	if reason != after.Reason {
		t.Errorf("page shows reason %q after the override, the kettle is told %q", reason, after.Reason)
	}
	shot("kettle-override-1280")
	do("clear override", chromedp.Click(chromedp.CSS("#ov-clear")))
	until("override cleared", `document.querySelector('#ov-ok').textContent.includes('cleared')`)
	f.call(t, "GET", "/v1/command", f.token[dev], "", 200, &after)
	if after != before {
		t.Errorf("after clearing the override the kettle is told %+v, want %+v", after, before)
	}

	// ---- phone width ----
	ev.setPhase("phone")
	do("phone viewport", chromedp.EmulateViewport(390, 844, chromedp.EmulateMobile, chromedp.EmulatePortrait))
	do("phone: kettle", chromedp.Sleep(200*time.Millisecond))
	shot("kettle-phone")
	do("phone: devices", chromedp.Click(chromedp.CSS(`a[data-nav="devices"]`)))
	until("device rows", `document.querySelectorAll('#dev-table tbody tr[data-id]').length === 4`)
	shot("devices-phone")
	do("phone: fleet", chromedp.Click(chromedp.CSS(`a[data-nav="fleet"]`)))
	until("fleet", `document.querySelector('[data-stat="measurement_count"]')?.dataset.value !== undefined && document.querySelector('#hour-chart svg') !== null`)
	shot("fleet-phone")
	var overflow bool
	eval(`document.documentElement.scrollWidth > window.innerWidth + 1`, &overflow)
	if overflow {
		t.Errorf("at phone width the page scrolls sideways")
	}

	// ---- sign out ----
	ev.setPhase("sign-out")
	withSession := func() int {
		req, _ := http.NewRequest("GET", f.url+"/v1/statistics", nil)
		req.AddCookie(&http.Cookie{Name: session.Name, Value: session.Value})
		res, err := http.DefaultClient.Do(req)
		must("GET /v1/statistics with the cookie", err)
		res.Body.Close()
		return res.StatusCode
	}
	if code := withSession(); code != 200 {
		t.Fatalf("with the session cookie /v1/statistics answers %d before sign-out", code)
	}
	do("sign out", chromedp.Click(chromedp.CSS("#signout")))
	until("sign-in form", `document.querySelector('#token') !== null`)
	if code := withSession(); code != 401 {
		t.Errorf("after sign-out the old cookie gets %d from /v1/statistics, want 401", code)
	}
	text = bodyText()
	if strings.Contains(text, dev.String()[:8]) {
		t.Errorf("after sign-out the page still shows the fleet:\n%s", text)
	}

	ev.mu.Lock()
	defer ev.mu.Unlock()
	for _, p := range ev.problems {
		t.Errorf("browser: %s", p)
	}
	t.Logf("browser test took %v", time.Since(start).Round(time.Millisecond))
}

type kettleCommand struct {
	Charge      bool    `json:"charge"`
	Fill        bool    `json:"fill"`
	FlushMLPerS float64 `json:"flush_ml_per_s"`
	Reason      string  `json:"reason"`
	PollAfterS  int     `json:"poll_after_s"`
}
