package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"
)

// Listener serves a metrics handler on an address of its own (kettle swarm's
// --metrics-addr). It owns its goroutine; Close stops it.
type Listener struct {
	ln   net.Listener
	srv  *http.Server
	done chan error
}

// Listen serves h at GET /metrics on addr ("127.0.0.1:0" picks a port).
func Listen(addr string, h http.Handler) (*Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w (choose another --metrics-addr)", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", h)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "only GET /metrics here", http.StatusNotFound)
	})
	l := &Listener{ln: ln, done: make(chan error, 1), srv: &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		WriteTimeout:      30 * time.Second,
	}}
	go func() { l.done <- l.srv.Serve(ln) }()
	return l, nil
}

// Addr is the bound address.
func (l *Listener) Addr() string { return l.ln.Addr().String() }

// URL is the address of the metrics page.
func (l *Listener) URL() string { return "http://" + l.Addr() + "/metrics" }

// Close stops serving (waiting up to 5 s for a scrape in progress) and waits
// for the serving goroutine to return.
func (l *Listener) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := l.srv.Shutdown(ctx)
	if serr := <-l.done; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
