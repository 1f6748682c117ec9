package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

func init() {
	register("serve", "run the backend: device API, commands, statistics", runServe)
}

const serveDoc = `
Runs the kettlefleet backend. Kettles post measurements and poll commands over
the case-study protocol (POST /login, POST /measurement, GET /command) or the
v1 API (/v1/…, bearer tokens); operators read statistics and set overrides.
The API is described at GET /openapi.json.

Every reading is validated, queued (bounded: a full queue answers 503 with
Retry-After), committed in a batch transaction together with the latest state
and statistics rollups, and only then acknowledged. Command polls are answered
from memory. Under overload uploads are refused before their body is read:
when the queue is full, or, if --shed-latency is set, when the CPU is saturated (then with a long Retry-After, so kettles
send their readings later in one request), and polls keep being answered
(while the CPU is saturated, with Cache-Control max-age: poll again later).
SIGTERM/SIGINT: stop accepting, drain the queue, commit, exit 0 (behind a
load balancer, --drain-delay first answers /readyz 503 while serving on).

High availability: --db may name several hosts
(postgres://h1,h2,h3/kettle?target_session_attrs=read-write): the node
connects to whichever is the writable primary and follows it through a
failover; while none is, uploads get 503 + Retry-After and polls answer
from memory. --db-read sends reads that tolerate lag to a standby. See
docs/operations.md, High availability.

Retention: by default every reading is kept. With --retention 90d, uploads
older than 90 days (device time) are refused, and at start and every
--expire-every the whole UTC days older than that are removed from the
store together with their share of the statistics; a kettle's latest state
stays.

Registrations that never report (a flood of POST /login): with
--prune-unreported 7d, at start and every --expire-every the devices
registered more than 7 days ago that never stored a reading are removed,
as POST /v1/devices/prune does; by default only when an operator asks.

Secrets: when --operator-token or --secret is empty, a random value is
generated at first start and kept in --data-dir (files operator-token and
secret, mode 0600); the log says where. To rotate one without cutting
clients off, restart every node with the new value and the old one as
--operator-token-previous or --secret-previous (both accepted, each use of
the old counted in kettle_previous_credentials_used_total and logged), move
clients and kettles over (kettle token --secret NEW), then restart without
the old once the counter stops rising.

TLS: with --tls-cert and --tls-key (PEM files) the HTTP API and the embedded
MQTT listener speak TLS 1.2+ only (HTTP/1.1; a plain request to the port is
answered 400). A renewed pair written over the files (certbot, cert-manager)
is picked up within a second by the next handshake, without a restart; a
pair that does not load leaves the old one in force and is logged.
kettle_tls_certificate_expiry_timestamp_seconds feeds the alert
KettleTLSCertificateExpiring.`

func runServe(ctx context.Context, args []string) error {
	fs := newFlagSet("serve", "[flags]", serveDoc)
	o := newServeOptions(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	log, err := o.finish(fs, stderrSink())
	if err != nil {
		return err
	}
	cfg := o.cfg
	defer stderrSink().Flush() // last: after the deferred writers below logged
	if o.debugAddr != "" {
		stop, err := serveDebug(o.debugAddr, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if o.role == server.RoleWriter {
		return runWriter(ctx, cfg, log)
	}
	srv, err := server.Start(ctx, cfg)
	if err != nil {
		return err
	}
	if o.sample {
		stop, err := sampleServer(ctx, srv, cfg.DataDir, log)
		if err != nil {
			srv.Close()
			return err
		}
		defer stop()
	}
	printServing(srv, cfg)
	return runUntilStopped(ctx, srv, "serving on "+srv.URL(), "serve failed", log)
}

// sampleServer is --sample: system samples every second, written to
// <data-dir>/system.json by stop.
func sampleServer(ctx context.Context, srv *server.Server, dataDir string, log *slog.Logger) (stop func(), err error) {
	smp, err := sysstat.Start(ctx, sysstat.Config{ServerPID: os.Getpid(), SimulatorPID: -1, MetricsURL: srv.MetricsURL()})
	if err != nil {
		return nil, fmt.Errorf("--sample: %w", err)
	}
	out := filepath.Join(dataDir, "system.json")
	return func() {
		if err := smp.Close().WriteFile(out); err != nil {
			log.Error("write system samples", "file", out, "err", err)
		} else {
			log.Info("system samples written", "file", out)
		}
	}, nil
}

// printServing tells the operator where the server listens and where its
// generated secrets are.
func printServing(srv *server.Server, cfg server.Config) {
	tok, sec := srv.TokenFiles()
	fmt.Fprintf(os.Stderr, "kettle serve listening on %s\n", srv.URL())
	if a := srv.MQTTAddr(); a != "" {
		over := ""
		if cfg.TLSCert != "" {
			over = " over TLS"
		}
		fmt.Fprintf(os.Stderr, "  MQTT%s on %s (username: device id, password: its token)\n", over, a)
	}
	if tok != "" {
		fmt.Fprintf(os.Stderr, "  operator token: %s (curl -H \"Authorization: Bearer $(cat %s)\" %s/v1/statistics)\n", tok, tok, srv.URL())
	}
	if sec != "" {
		fmt.Fprintf(os.Stderr, "  device-token secret: %s (kettle token --data-dir %s --device UUID)\n", sec, strings.TrimSuffix(cfg.DataDir, "/"))
	}
}

// serveDebug serves pprof on its own listener, never on the API address.
func serveDebug(addr string, log *slog.Logger) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--debug-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	// The command line holds what was given as flags, secrets among them.
	mux.HandleFunc("/debug/pprof/cmdline", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not served: the command line may hold secrets", http.StatusNotFound)
	})
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(l)
	log.Info("pprof listening", "addr", l.Addr().String())
	return func() { srv.Close() }, nil
}
