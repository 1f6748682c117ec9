package report

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// LiveOptions configure a live view.
type LiveOptions struct {
	Addr   string     // host:port to listen on (port 0: any)
	Params sim.Params // the run's, as planned
	// Samples, if set, are the system samples taken after a time (the
	// swarm's sampler); nil: the page shows the client's figures only.
	Samples func(since time.Time) (cpus int, samples []sysstat.Sample)
	// Stop ends the run early (the page's stop button); it must not block.
	Stop func()
	// Token, if set, must come with every request: as ?token= once (the
	// page then keeps it in a cookie) or as Authorization: Bearer. Without
	// it only loopback addresses may listen.
	Token string
	Title string
}

// Live is a run's report page served while the run goes (kettle swarm
// --ui): the page kettle report writes, its charts fed once a second by
// server-sent events with the run's newest seconds, its system samples
// beside them, and a stop button. It owns its listener and goroutines;
// End says how the run ended and stops them.
type Live struct {
	o    LiveOptions
	ln   net.Listener
	srv  *http.Server
	done chan struct{} // closed by End: handlers return
	wg   sync.WaitGroup

	mu      sync.Mutex
	start   time.Time // the run's start, estimated from its seconds' arrival
	secs    []sim.Second
	sent    int // seconds up to secs[sent-1] went out in a tick
	clients map[chan []byte]struct{}
	state   string // running, stopping, ended
	ended   []byte // the end event, for a client that connects after it
}

// Bounds of the live view.
const (
	liveMaxClients = 8  // pages watching at once
	liveClientBuf  = 16 // events queued per page; a page that lags further is dropped (it reconnects and reloads)
	liveWindow     = 5  // seconds each tick carries: samples that arrive late fill in
	liveCookie     = "kettle_live"
	// LiveStopHeader must come with POST /stop: a header a cross-site form
	// cannot send, so another site open in the browser cannot stop a run.
	LiveStopHeader = "X-Kettle-Stop"
)

// StartLive listens on o.Addr and serves the live view until End.
func StartLive(o LiveOptions) (*Live, error) {
	host, _, err := net.SplitHostPort(o.Addr)
	if err != nil {
		return nil, fmt.Errorf("--ui %q: want HOST:PORT, e.g. 127.0.0.1:9102", o.Addr)
	}
	if o.Token == "" && !loopbackHost(host) {
		return nil, fmt.Errorf("--ui %s is not a loopback address: give --ui-token-file (anyone who reaches the page can stop the run)", o.Addr)
	}
	ln, err := net.Listen("tcp", o.Addr)
	if err != nil {
		return nil, fmt.Errorf("--ui: listen on %s: %w", o.Addr, err)
	}
	l := &Live{o: o, ln: ln, done: make(chan struct{}), clients: map[chan []byte]struct{}{}, state: "running"}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", l.page)
	mux.HandleFunc("GET /events", l.events)
	mux.HandleFunc("POST /stop", l.stop)
	l.srv = &http.Server{Handler: l.guard(mux), ReadHeaderTimeout: 5 * time.Second, MaxHeaderBytes: 16 << 10}
	l.wg.Add(2)
	go func() { defer l.wg.Done(); _ = l.srv.Serve(ln) }()
	go func() { defer l.wg.Done(); l.tick() }()
	return l, nil
}

// URL is the page's address.
func (l *Live) URL() string { return "http://" + l.ln.Addr().String() + "/" }

func loopbackHost(h string) bool {
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	return ip != nil && ip.IsLoopback()
}

// guard checks the token (or, without one, that the page was asked for by
// a loopback name: a DNS-rebound name reaching this port is refused).
func (l *Live) guard(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if l.o.Token == "" {
			host, _, err := net.SplitHostPort(r.Host)
			if err != nil {
				host = r.Host
			}
			if !loopbackHost(host) {
				http.Error(w, "the live view answers loopback names only (Host "+r.Host+")", http.StatusForbidden)
				return
			}
			h.ServeHTTP(w, r)
			return
		}
		ok := func(t string) bool { return subtle.ConstantTimeCompare([]byte(t), []byte(l.o.Token)) == 1 }
		if t := r.URL.Query().Get("token"); t != "" && r.Method == http.MethodGet && r.URL.Path == "/" {
			if !ok(t) {
				http.Error(w, "wrong token", http.StatusUnauthorized)
				return
			}
			http.SetCookie(w, &http.Cookie{Name: liveCookie, Value: t, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
			http.Redirect(w, r, "/", http.StatusSeeOther) // the token leaves the address bar
			return
		}
		if c, err := r.Cookie(liveCookie); err == nil && ok(c.Value) {
			h.ServeHTTP(w, r)
			return
		}
		if b, found := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); found && ok(b) {
			h.ServeHTTP(w, r)
			return
		}
		http.Error(w, "give the live view's token: open /?token=TOKEN once (the content of --ui-token-file), or send Authorization: Bearer TOKEN", http.StatusUnauthorized)
	})
}

// Second takes a second of the run as it closes (sim.Config.OnSecond).
func (l *Live) Second(s sim.Second) {
	l.mu.Lock()
	defer l.mu.Unlock()
	// Second T closes at the start + T s, or later (a lab's controller
	// hears of it a status round after): the earliest estimate is the best.
	if at := time.Now().Add(-time.Duration(s.T) * time.Second); l.start.IsZero() || at.Before(l.start) {
		l.start = at
	}
	l.secs = append(l.secs, s)
}

// results is the run so far, the seconds from secs[from] on, with the
// system samples that fall in them. l.mu held.
func (l *Live) results(from int) *sim.Results {
	r := &sim.Results{Schema: sim.SchemaVersion, Params: l.o.Params, Start: l.start, Seconds: l.secs[from:]}
	if l.o.Samples != nil && len(r.Seconds) > 0 {
		since := l.start.Add(time.Duration(r.Seconds[0].T-1)*time.Second - 500*time.Millisecond)
		cpus, smp := l.o.Samples(since)
		r.System = &sysstat.Series{CPUs: cpus, Samples: smp}
	}
	return r
}

// tick sends, once a second, the newest seconds to every page.
func (l *Live) tick() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-l.done:
			return
		case <-t.C:
		}
		l.mu.Lock()
		if l.sent == len(l.secs) || l.state == "ended" {
			l.mu.Unlock()
			continue
		}
		r := l.results(max(0, len(l.secs)-liveWindow))
		l.sent = len(l.secs)
		state := l.state
		l.mu.Unlock()
		s := &Summary{}
		if _, err := s.buildSeries(r); err != nil {
			continue
		}
		l.broadcast(event("tick", map[string]any{"state": state, "t": r.Seconds[len(r.Seconds)-1].T, "series": s.Series}))
	}
}

func event(name string, v any) []byte {
	b, _ := json.Marshal(v) // our own types: no error
	return fmt.Appendf(nil, "event: %s\ndata: %s\n\n", name, b)
}

// broadcast queues ev for every page; a page too far behind is dropped.
func (l *Live) broadcast(ev []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for c := range l.clients {
		select {
		case c <- ev:
		default:
			delete(l.clients, c)
			close(c)
		}
	}
}

// page is the report page of the run so far, in its live form.
func (l *Live) page(w http.ResponseWriter, r *http.Request) {
	l.mu.Lock()
	res := l.results(0)
	res.End = time.Now()
	l.mu.Unlock()
	if res.Start.IsZero() {
		res.Start = time.Now()
	}
	s, err := Build(res, Options{Title: l.o.Title})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	var buf bytes.Buffer
	if err := s.writeHTML(&buf, true); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(buf.Bytes())
}

// events streams the run's ticks to one page.
func (l *Live) events(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	c := make(chan []byte, liveClientBuf)
	l.mu.Lock()
	ended, state := l.ended, l.state
	if ended == nil {
		if len(l.clients) >= liveMaxClients {
			l.mu.Unlock()
			w.Header().Set("Retry-After", "5")
			http.Error(w, fmt.Sprintf("%d pages watch this run already; close one", liveMaxClients), http.StatusServiceUnavailable)
			return
		}
		l.clients[c] = struct{}{}
	}
	l.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	if ended != nil {
		_, _ = w.Write(ended)
		fl.Flush()
		return
	}
	_, _ = w.Write(event("state", map[string]string{"state": state}))
	fl.Flush()
	defer func() {
		l.mu.Lock()
		if _, in := l.clients[c]; in {
			delete(l.clients, c)
			close(c)
		}
		l.mu.Unlock()
	}()
	for {
		select {
		case ev, open := <-c:
			if !open {
				return
			}
			if _, err := w.Write(ev); err != nil {
				return
			}
			fl.Flush()
		case <-r.Context().Done():
			return
		case <-l.done:
			return
		}
	}
}

// stop ends the run early.
func (l *Live) stop(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(LiveStopHeader) == "" {
		http.Error(w, "POST /stop needs the header "+LiveStopHeader+": 1 (the page sends it)", http.StatusBadRequest)
		return
	}
	l.mu.Lock()
	state := l.state
	if state == "running" {
		l.state = "stopping"
	}
	l.mu.Unlock()
	switch state {
	case "ended":
		http.Error(w, "the run has ended", http.StatusConflict)
		return
	case "running":
		if l.o.Stop != nil {
			l.o.Stop()
		}
		l.broadcast(event("state", map[string]string{"state": "stopping"}))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write([]byte(`{"state":"stopping"}` + "\n"))
}

// End tells every page how the run ended — its final summary (nil: the
// run failed before it had one), where its report went, and why it failed
// if it did — waits up to wait for the pages to take it, and stops
// serving.
func (l *Live) End(final *Summary, reportPath, failure string, wait time.Duration) {
	ev := event("end", map[string]any{"summary": final, "report": reportPath, "error": failure})
	l.mu.Lock()
	l.state, l.ended = "ended", ev
	clients := make([]chan []byte, 0, len(l.clients))
	for c := range l.clients {
		clients = append(clients, c)
	}
	l.mu.Unlock()
	l.broadcast(ev)
	// Each page's stream writes what is queued; give them the time to.
	deadline := time.Now().Add(wait)
	for _, c := range clients {
		for len(c) > 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	close(l.done)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := l.srv.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		_ = l.srv.Close()
	}
	l.wg.Wait()
}
