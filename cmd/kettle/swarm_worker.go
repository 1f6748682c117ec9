package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/tlscert"
	"github.com/kettlefleet/kettlefleet/sim"
)

const swarmWorkerDoc = `
A worker of the distributed lab: it waits on --listen for a controller
(kettle swarm --workers …, or kettle capacity --workers …) to hand it a shard
of a fleet, runs that shard with the same simulator as kettle swarm, and
hands back its per-second results and its acknowledged readings. The
controller merges every worker's histograms exactly, judges the one merged
run and audits every shard; a worker prints no verdict of its own.

The control channel is HTTP on --listen; every request must carry --token
(a shared secret of at least 16 characters; the controller's
--worker-token). It carries the fleet's device secret or operator token, so
listen on loopback or a network you trust. Requests are bounded (1 MiB
plans, 5 s to send headers, at most 8 at once) and a run whose controller
has been silent for --orphan is stopped: a dead controller leaves no load
behind.

The worker loads only this machine's loopback addresses, or a host named in
its own --allow-target (the controller cannot widen that). Its shard's
connections leave from --source-addrs, or from the --listen address itself
when that is a loopback one (127.0.45.11 → source 127.0.45.11): each worker
then has its own ephemeral ports.

One worker holds at most as many connections as its open-file limit allows
(about 19,800 here); run several for a fleet with a connection per kettle.
Stop it with SIGINT or SIGTERM.`

func runSwarmWorker(ctx context.Context, args []string) error {
	fs := newFlagSet("swarm worker", "--listen HOST:PORT --token T [--allow-target HOST,…]", swarmWorkerDoc)
	listen := fs.String("listen", "127.0.0.1:7070", "address of the control listener (port 0: any free port, printed)")
	token := fs.String("token", "", "shared secret every control request must carry (≥ 16 characters; the controller's --worker-token)")
	allow := fs.String("allow-target", "", "comma-separated non-loopback hosts this worker may load, named exactly (empty: loopback only)")
	src := fs.String("source-addrs", "", "loopback source addresses for the shard's connections, e.g. 127.0.45.11-127.0.45.12 (empty: the --listen address when it is loopback)")
	reserve := fs.Int("reserve-fds", 0, "file descriptors to leave to others in this process")
	orphan := fs.Duration("orphan", 30*time.Second, "stop a run when the controller has been silent this long")
	debugAddr := fs.String("debug-addr", "", "serve Go's pprof profiles of this worker on this address, e.g. 127.0.0.1:6062 (empty: off)")
	tlsCert := fs.String("tls-cert", "", "PEM certificate (chain): with --tls-key the control listener is TLS only; required when --listen is not a loopback address (the controller's plans carry the device secret)")
	tlsKey := fs.String("tls-key", "", "PEM private key of --tls-cert")
	clientCA := fs.String("client-ca", "", "with --tls-cert: PEM certificate(s) the controller's --worker-cert must be signed by (mutual TLS; empty: the --token alone authenticates, over TLS)")
	secretFileVars(fs, "token")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	lowGCHeadroom()
	if *debugAddr != "" {
		stop, err := serveDebug(*debugAddr, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			return err
		}
		defer stop()
	}
	wc := sim.WorkerConfig{Token: *token, AllowHosts: splitList(*allow), ReserveFDs: *reserve, Orphan: *orphan, Log: os.Stderr}
	switch {
	case *src != "":
		ips, err := sim.ParseSourceAddrs(*src)
		if err != nil {
			return err
		}
		wc.SourceAddrs = ips
	case sim.LoopbackSource(*listen) != nil && !sim.LoopbackSource(*listen).Equal(net.IPv4(127, 0, 0, 1)):
		wc.SourceAddrs = []net.IP{sim.LoopbackSource(*listen)}
	}
	w, err := sim.NewWorker(wc)
	if err != nil {
		return err
	}
	srvTLS, err := workerServerTLS(*listen, *tlsCert, *tlsKey, *clientCA)
	if err != nil {
		w.Close()
		return err
	}
	l, err := net.Listen("tcp", *listen)
	if err == nil && srvTLS != nil {
		l = tls.NewListener(l, srvTLS)
	}
	if err != nil {
		w.Close()
		return fmt.Errorf("--listen %s: %w", *listen, err)
	}
	fmt.Fprintf(os.Stderr, "worker: listening on %s (source addresses %v)\n", l.Addr(), wc.SourceAddrs)
	defer notifyReady(ctx, "worker listening on "+l.Addr().String())()
	return sim.ServeWorker(ctx, l, w)
}

// registerLab adds the flags that drive a fleet from workers.
func (f *swarmFlags) registerLab(fs *flag.FlagSet) {
	fs.StringVar(&f.workers, "workers", "", "comma-separated HOST:PORT of kettle swarm worker processes: the fleet is split over them and merged into one run (empty: this process runs it all)")
	fs.StringVar(&f.workerToken, "worker-token", "", "the workers' --token")
	secretFileVars(fs, "worker-token")
	fs.StringVar(&f.allowTarget, "allow-target", "", "comma-separated non-loopback hosts that may be loaded, named exactly (empty: loopback only); each worker needs its own --allow-target too")
	fs.StringVar(&f.workerCA, "worker-ca", "", "PEM certificate(s) the workers' --tls-cert is signed with: the control channel (plans carry the device secret) is then TLS and each worker verified; needed for workers off loopback (empty: plain HTTP to loopback workers only)")
	fs.StringVar(&f.workerCert, "worker-cert", "", "with --worker-ca: PEM client certificate the controller presents, for workers started with --client-ca (mutual TLS)")
	fs.StringVar(&f.workerKey, "worker-key", "", "PEM private key of --worker-cert")
}

// workerTLS is the control channel's client side (nil without --worker-ca).
func (f *swarmFlags) workerTLS() (*tls.Config, error) {
	if f.workerCA == "" {
		if f.workerCert != "" {
			return nil, errors.New("--worker-cert needs --worker-ca (the workers' certificate authority)")
		}
		return nil, nil
	}
	pool, err := tlscert.Pool("--worker-ca", f.workerCA)
	if err != nil {
		return nil, err
	}
	c := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if (f.workerCert == "") != (f.workerKey == "") {
		return nil, errors.New("--worker-cert and --worker-key go together")
	}
	if f.workerCert != "" {
		cert, err := tls.LoadX509KeyPair(f.workerCert, f.workerKey)
		if err != nil {
			return nil, fmt.Errorf("--worker-cert: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// resolveLab checks the targets and the lab flags.
func (f *swarmFlags) resolveLab() error {
	c := &f.cfg
	c.AllowHosts = splitList(f.allowTarget)
	f.targets = splitList(c.Target)
	if len(f.targets) == 0 {
		return errors.New("--target: want a URL")
	}
	if len(f.targets) > 1 && f.workers == "" {
		return fmt.Errorf("--target %s: several nodes need --workers (one process loads one node)", c.Target)
	}
	for _, t := range f.targets {
		if _, err := sim.CheckTarget(t, c.AllowHosts); err != nil {
			return err
		}
	}
	c.Target = f.targets[0]
	if f.mqttTargets = splitList(c.MQTTTarget); len(f.mqttTargets) > 0 {
		c.MQTTTarget = f.mqttTargets[0]
	}
	if f.workers != "" {
		if len(f.workerToken) < sim.MinWorkerToken {
			return fmt.Errorf("--worker-token: give the workers' --token (at least %d characters)", sim.MinWorkerToken)
		}
		if f.metricsAddr != "" {
			return errors.New("--metrics-addr with --workers: not supported (the workers see the requests); the controller's progress line and results.json carry the merged figures")
		}
		for _, w := range splitList(f.workers) {
			if _, _, err := net.SplitHostPort(w); err != nil {
				return fmt.Errorf("--workers %q: want HOST:PORT,HOST:PORT,…", f.workers)
			}
		}
	}
	return nil
}

// runOnce runs the configured fleet: in this process, or over the workers.
func (f *swarmFlags) runOnce(ctx context.Context) (*sim.Results, error) {
	if f.workers == "" {
		return sim.Run(ctx, f.cfg)
	}
	wt, err := f.workerTLS()
	if err != nil {
		return nil, err
	}
	return sim.RunLab(ctx, sim.LabConfig{Config: f.cfg, Workers: splitList(f.workers), Token: f.workerToken,
		Targets: f.targets, MQTTTargets: f.mqttTargets, WorkerTLS: wt})
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// workerServerTLS is the control listener's TLS (nil: plain, which only a
// loopback --listen may be).
func workerServerTLS(listen, cert, key, clientCA string) (*tls.Config, error) {
	if cert == "" && key == "" {
		if clientCA != "" {
			return nil, errors.New("--client-ca needs --tls-cert and --tls-key")
		}
		host, _, err := net.SplitHostPort(listen)
		if err != nil {
			return nil, fmt.Errorf("--listen %q: want HOST:PORT", listen)
		}
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			return nil, fmt.Errorf("--listen %s is not a loopback address: give --tls-cert and --tls-key (plans carry the device secret; the controller verifies them with --worker-ca)", listen)
		}
		return nil, nil
	}
	if cert == "" || key == "" {
		return nil, errors.New("--tls-cert and --tls-key go together")
	}
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert: %w", err)
	}
	c := &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	if clientCA != "" {
		pool, err := tlscert.Pool("--client-ca", clientCA)
		if err != nil {
			return nil, err
		}
		c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return c, nil
}
