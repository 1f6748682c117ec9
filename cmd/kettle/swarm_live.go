package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kettlefleet/kettlefleet/report"
	"github.com/kettlefleet/kettlefleet/sim"
	"github.com/kettlefleet/kettlefleet/sysstat"
)

// liveFlags are kettle swarm's live view (--ui).
type liveFlags struct {
	ui          string
	uiTokenFile string
	sampler     *sysstat.Sampler // the run's system sampler (instrument), nil: none
}

// minUIToken is the shortest token --ui-token-file may hold.
const minUIToken = 16

func (f *swarmFlags) registerLive(fs *flag.FlagSet) {
	fs.StringVar(&f.ui, "ui", "", "serve the live view on ADDR while the run goes, e.g. 127.0.0.1:9102: the report page updated every second (server-sent events), with a button that stops the run (its results are still written); off loopback it needs --ui-token-file (empty: off)")
	fs.StringVar(&f.uiTokenFile, "ui-token-file", "", "file holding the live view's token (at least 16 characters): open http://ADDR/?token=TOKEN once; scripts send Authorization: Bearer TOKEN. Needed when --ui is not a loopback address")
}

// startLive serves the live view when --ui is set. The returned context is
// the run's: the page's stop button cancels it. end tells the page how the
// run ended and stops serving; call it once the results are written.
func (f *swarmFlags) startLive(ctx context.Context) (context.Context, func(res *sim.Results, err error), error) {
	if f.ui == "" {
		return ctx, func(*sim.Results, error) {}, nil
	}
	token := ""
	if f.uiTokenFile != "" {
		b, err := os.ReadFile(f.uiTokenFile)
		if err != nil {
			return nil, nil, fmt.Errorf("--ui-token-file: %w", err)
		}
		if token = strings.TrimSpace(string(b)); len(token) < minUIToken {
			return nil, nil, fmt.Errorf("--ui-token-file %s: want a token of at least %d characters", f.uiTokenFile, minUIToken)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	o := report.LiveOptions{Addr: f.ui, Params: f.cfg.PlannedParams(), Token: token, Stop: cancel}
	o.Title = fmt.Sprintf("kettle swarm, live: %d kettles → %s", o.Params.Devices, o.Params.Target)
	if smp := f.sampler; smp != nil {
		o.Samples = smp.Since
	}
	l, err := report.StartLive(o)
	if err != nil {
		cancel()
		return nil, nil, err
	}
	prev := f.cfg.OnSecond
	f.cfg.OnSecond = func(s sim.Second) {
		if prev != nil {
			prev(s)
		}
		l.Second(s)
	}
	fmt.Fprintf(f.log, "swarm: live view at %s\n", l.URL())
	end := func(res *sim.Results, err error) {
		defer cancel()
		stopped := ctx.Err() != nil
		var final *report.Summary
		path, failure := "", ""
		if res != nil {
			final, _ = report.Build(res, report.Options{})
			if f.out != "" {
				path = filepath.Join(f.out, "results.json")
				if f.report {
					path = filepath.Join(f.out, "report.html")
				}
			}
		}
		if err != nil {
			failure = err.Error()
		}
		if stopped && res != nil {
			fmt.Fprintf(f.log, "swarm: stopped from the live view after %.0f s\n", res.End.Sub(res.Start).Seconds())
		}
		l.End(final, path, failure, 3*time.Second)
	}
	return ctx, end, nil
}
