// Command bare is the ceiling for bench/ingest.sh: the case-study
// POST /measurement decoded and validated exactly as kettle serve does it
// (wire.DecodeV0), then answered without storing anything. Comparing
// kettle serve against it, with the same client in the same run, shows what
// queueing, committing and acknowledging cost.
package main

import (
	"flag"
	"io"
	"log"
	"net/http"
	"time"

	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8090", "listen address")
	delay := flag.Duration("delay", 0, "hold each decoded measurement this long before answering, as kettle serve holds it until its commit: shows what a request's wait alone costs the server (parked goroutines, colder caches)")
	flag.Parse()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /login", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte(`{"username":"` + uuid.NewString() + `"}`))
	})
	mux.HandleFunc("POST /measurement", func(w http.ResponseWriter, r *http.Request) {
		id, err := uuid.Parse(r.Header.Get("servant-auth-cookie"))
		if err != nil {
			http.Error(w, "unauthorized", 401)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
		if err != nil {
			http.Error(w, "too large", 413)
			return
		}
		if _, err := wire.DecodeV0(body, id, kettle.Window{Now: time.Now()}); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		if *delay > 0 {
			time.Sleep(*delay)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte("[]\n"))
	})
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 120 * time.Second}
	log.Fatal(srv.ListenAndServe())
}
