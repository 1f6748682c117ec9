package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/kettlefleet/kettlefleet/server"
)

// logFlags defines kettle serve's readings-log flags (--log, --role, …)
// and returns --role.
func logFlags(fs *flag.FlagSet, cfg *server.LogConfig, role *string) {
	fs.StringVar(&cfg.URL, "log", cfg.URL, "readings log between the front and the store: kafka://h1:9092,h2:9092,h3:9092/kettle.readings. Uploads are validated, produced (idempotent, acks=all, key = device id) and acknowledged once the log holds them; --role writer processes store them. Empty: the direct path (ack after the store commit), the default")
	fs.StringVar(role, "role", server.RoleFront, "front: the device API, commands and statistics; writer: with --log, consume the log into --db in large transactions (offsets committed after the store commit) and serve only /metrics, /healthz and /readyz on --addr")
	fs.IntVar(&cfg.Partitions, "log-partitions", cfg.Partitions, "with --log, when the topic does not exist yet: its partitions (the most writers that share the work); replication factor 3 and min.insync.replicas 2 always")
	fs.DurationVar(&cfg.Retention, "log-retention", cfg.Retention, "with --log, when the topic does not exist yet: its retention.ms (how long Kafka keeps a record, written or not)")
	fs.IntVar(&cfg.MaxInflight, "log-max-inflight", cfg.MaxInflight, "with --log: readings a front node may have waiting for the log's acknowledgement; past it uploads are answered 503 + Retry-After")
	fs.DurationVar(&cfg.Timeout, "log-timeout", cfg.Timeout, "with --log: how long an upload waits for the log's acknowledgement before it is answered 503 + Retry-After")
	fs.DurationVar(&cfg.MaxUnwrittenAge, "log-max-unwritten-age", cfg.MaxUnwrittenAge, "with --log: while a reading in the log has waited longer than this for a writer, uploads are answered 503 (Retry-After 10× the usual), so nothing reaches the topic's retention unwritten; below the retention (0: half of it)")
	fs.StringVar(&cfg.Group, "log-group", cfg.Group, "with --log: the writers' consumer group (fronts watch its lag)")
	fs.DurationVar(&cfg.MonitorEvery, "log-monitor-every", cfg.MonitorEvery, "with --log: how often the writers' lag and the age of the oldest unwritten reading are measured")
	fs.StringVar(&cfg.CA, "log-ca", cfg.CA, "with --log: PEM file of the CA the brokers' certificates are checked against (each for the address dialed): the log over TLS; empty: plain TCP")
	fs.StringVar(&cfg.User, "log-user", cfg.User, "with --log: SASL/SCRAM-SHA-512 user at the brokers (fronts and writers each their own: the brokers' ACLs let fronts produce and writers consume); empty: no SASL")
	fs.StringVar(&cfg.Password, "log-password", cfg.Password, "with --log-user: its SCRAM password (better --log-password-file)")
	secretFileVars(fs, "log-password")
}

// runWriter is kettle serve --role writer.
func runWriter(ctx context.Context, cfg server.Config, log *slog.Logger) error {
	w, err := server.StartWriter(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "kettle serve --role writer listening on %s (/metrics, /readyz, /drained), writing %s into %s\n", w.URL(), cfg.Log.URL, w.DB())
	return runUntilStopped(ctx, w, "writing "+cfg.Log.URL, "writer metrics listener failed", log)
}

// checkRole validates --role against --log.
func checkRole(role string, cfg server.LogConfig) error {
	switch role {
	case server.RoleFront:
		return nil
	case server.RoleWriter:
		if cfg.URL == "" {
			return fmt.Errorf("--role writer needs --log kafka://h1:9092,h2:9092,h3:9092/topic (the log it writes from)")
		}
		return nil
	}
	return fmt.Errorf("--role %q: want front or writer", role)
}

// waitFor200 is kettle swarm --audit-after: it polls url every 500 ms
// until it answers 200, for at most 5 minutes.
func waitFor200(url string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		c := &http.Client{Timeout: 10 * time.Second}
		for {
			req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
			if err != nil {
				return err
			}
			if res, err := c.Do(req); err == nil {
				res.Body.Close()
				if res.StatusCode == 200 {
					return nil
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("GET %s did not answer 200 within 5 min", url)
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
}
