package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Slow and hostile clients: slowloris headers, slow bodies, thousands of
// idle keep-alive connections, connections past --max-conns, and clients
// that pipeline requests and never read. Each must be cut off by its
// timeout or limit while a normal kettle keeps being served.
//
// The server runs with shorter clocks than its defaults (same code, so the
// part takes a minute instead of ten): --read-header-timeout 2s
// --read-timeout 5s --write-timeout 5s --idle-timeout 10s --max-conns 6000.
func partSlow(ctx context.Context, e *env) *Result {
	const (
		rht      = 2 * time.Second
		rt       = 5 * time.Second
		wt       = 5 * time.Second
		it       = 10 * time.Second
		maxConns = 6000
		nSlowH   = 300
		nSlowB   = 300
		nIdle    = 5000
		nExcess  = 2000
		nNoRead  = 20
	)
	r := &Result{Pass: true, Done: fmt.Sprintf("kettle serve (SQLite; --read-header-timeout %s --read-timeout %s --write-timeout %s --idle-timeout %s --max-conns %d: the defaults' code with shorter clocks) "+
		"attacked at once by: %d slowloris clients (a header line a second, never finishing), %d slow bodies (a byte a second of a 10 kB body), "+
		"%d idle keep-alive connections (one request, then silence), %d connections past the cap, %d clients pipelining GET /openapi.json without ever reading. "+
		"The normal client is a separate kettle swarm process (50 kettles, each polling and uploading every second on its own connection) running before, during and after the attack; "+
		"under attack its p99 must stay within 100 ms, or within 1.5× its own p99 outside the attack when the machine's noise already puts that near 100 ms.",
		rht, rt, wt, it, maxConns, nSlowH, nSlowB, nIdle, nExcess, nNoRead)}
	dir := filepath.Join(e.out, "slow")
	os.RemoveAll(dir)
	data := filepath.Join(dir, "data")
	os.MkdirAll(data, 0o755)
	addr, err := freeAddr()
	if err != nil {
		return r.fail("%v", err)
	}
	srv, err := startServe(ctx, e, addr, data, "sqlite:"+filepath.Join(data, "kettle.db"), filepath.Join(dir, "serve.log"),
		"--read-header-timeout", rht.String(), "--read-timeout", rt.String(), "--write-timeout", wt.String(), "--idle-timeout", it.String(),
		"--max-conns", fmt.Sprint(maxConns))
	if err != nil {
		return r.fail("%v", err)
	}
	defer srv.stop()
	secret := readSecret(data, "secret")
	idev := newProbeDevice(secret)
	sleep(ctx, time.Second)
	rss0 := rssKiB(srv.pid())
	rss := sampleRSS(srv.pid())
	// The normal client is a separate process (kettle swarm), so that the
	// attackers' goroutines here do not delay its measurements.
	sw, err := startSwarm(e, srv.url, filepath.Join(dir, "normal"), "--devices", "50", "--interval", "1s", "--duration", "45s",
		"--api", "v1", "--data-dir", data, "--conns", "per-device")
	if err != nil {
		rss.end()
		return r.fail("%v", err)
	}
	sleep(ctx, 8*time.Second)
	start := time.Now()

	var wg sync.WaitGroup
	var mu sync.Mutex
	closed := map[string][]time.Duration{} // attack → time until the server closed it
	unclosed := map[string]int{}
	dialErr := map[string]int{}
	note := func(kind string, d time.Duration, ok bool) {
		mu.Lock()
		defer mu.Unlock()
		if ok {
			closed[kind] = append(closed[kind], d)
		} else {
			unclosed[kind]++
		}
	}
	dial := func(kind string) net.Conn {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			mu.Lock()
			dialErr[kind]++
			mu.Unlock()
			return nil
		}
		return c
	}
	const limit = 40 * time.Second // every attacker gives up by then

	// Slowloris: headers that never end.
	for i := 0; i < nSlowH; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := dial("slow headers")
			if c == nil {
				return
			}
			defer c.Close()
			t0 := time.Now()
			c.SetDeadline(t0.Add(limit))
			if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: kettle\r\n"); err != nil {
				note("slow headers", time.Since(t0), true)
				return
			}
			// A reader notices the close (the server may answer 408 first).
			gone := make(chan struct{})
			go func() { io.Copy(io.Discard, c); close(gone) }()
			for j := 0; time.Since(t0) < limit; j++ {
				select {
				case <-gone:
					note("slow headers", time.Since(t0), true)
					return
				case <-time.After(time.Second):
				}
				if _, err := fmt.Fprintf(c, "X-Slow-%d: %d\r\n", j, j); err != nil {
					note("slow headers", time.Since(t0), true)
					return
				}
			}
			note("slow headers", 0, false)
		}(i)
	}
	// Slow bodies: complete headers, then a byte a second.
	for i := 0; i < nSlowB; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := dial("slow bodies")
			if c == nil {
				return
			}
			defer c.Close()
			t0 := time.Now()
			c.SetDeadline(t0.Add(limit))
			fmt.Fprintf(c, "POST /v1/measurements HTTP/1.1\r\nHost: kettle\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n[", idev.token)
			gone := make(chan struct{})
			go func() { io.Copy(io.Discard, c); close(gone) }()
			for time.Since(t0) < limit {
				select {
				case <-gone:
					note("slow bodies", time.Since(t0), true)
					return
				case <-time.After(time.Second):
				}
				if _, err := io.WriteString(c, " "); err != nil {
					note("slow bodies", time.Since(t0), true)
					return
				}
			}
			note("slow bodies", 0, false)
		}(i)
	}
	// Idle keep-alive connections: one request each, then nothing.
	var idleOpen atomic.Int64
	for i := 0; i < nIdle; i++ {
		time.Sleep(time.Millisecond) // a ramp of 1,000 connections/s, not one burst
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := dial("idle")
			if c == nil {
				return
			}
			defer c.Close()
			t0 := time.Now()
			c.SetDeadline(t0.Add(limit))
			br := bufio.NewReader(c)
			io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: kettle\r\n\r\n")
			res, err := http.ReadResponse(br, nil)
			if err != nil {
				note("idle", 0, false)
				return
			}
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode != 200 {
				mu.Lock()
				dialErr[fmt.Sprintf("idle got %d", res.StatusCode)]++
				mu.Unlock()
				return
			}
			idleOpen.Add(1)
			t1 := time.Now()
			_, err = br.ReadByte() // blocks until the server closes it
			idleOpen.Add(-1)
			note("idle", time.Since(t1), err == io.EOF || (err != nil && !isTimeout(err)))
		}(i)
	}
	// Wait for the idle connections to be in place before the cap is tested.
	for t := time.Now(); time.Since(t) < 20*time.Second && idleOpen.Load() < nIdle*9/10; {
		sleep(ctx, 100*time.Millisecond)
	}
	idleAt := idleOpen.Load()
	rssIdle := rssKiB(srv.pid())
	mtxt, _ := metricsText(srv.url)
	openNow := metricSum(mtxt, "kettle_http_connections_open")

	// Never-reading clients: pipeline requests, never read a byte.
	var pipelined atomic.Int64
	for i := 0; i < nNoRead; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := dial("never reads")
			if c == nil {
				return
			}
			defer c.Close()
			if tc, ok := c.(*net.TCPConn); ok {
				tc.SetReadBuffer(4096)
			}
			t0 := time.Now()
			// 1,000 pipelined requests ask for ~36 MB of answers, far more
			// than the socket buffers hold; then one more every 100 ms
			// notices when the server gives up on the connection. (Not a
			// tight loop: the attacker must not eat the CPU it shares.)
			req := []byte("GET /openapi.json HTTP/1.1\r\nHost: kettle\r\n\r\n")
			c.SetWriteDeadline(t0.Add(limit))
			if _, err := c.Write(bytes.Repeat(req, 1000)); err != nil {
				note("never reads", time.Since(t0), !isTimeout(err))
				return
			}
			pipelined.Add(1000)
			for time.Since(t0) < limit {
				time.Sleep(100 * time.Millisecond)
				c.SetWriteDeadline(time.Now().Add(limit - time.Since(t0)))
				if _, err := c.Write(req); err != nil {
					note("never reads", time.Since(t0), !isTimeout(err))
					return
				}
				pipelined.Add(1)
			}
			note("never reads", 0, false)
		}()
	}
	sleep(ctx, time.Second)

	// Past the cap: answered 503 at once and closed.
	var excess503, excessOther atomic.Int64
	var excessLat []time.Duration
	for i := 0; i < nExcess; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := dial("excess")
			if c == nil {
				return
			}
			defer c.Close()
			t0 := time.Now()
			c.SetDeadline(t0.Add(limit))
			io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: kettle\r\n\r\n")
			res, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				excessOther.Add(1)
				return
			}
			res.Body.Close()
			if res.StatusCode == 503 {
				excess503.Add(1)
				mu.Lock()
				excessLat = append(excessLat, time.Since(t0))
				mu.Unlock()
				return
			}
			// Admitted (a slot was free): hold it like an idle client would.
			br := bufio.NewReader(c)
			br.ReadByte()
		}()
	}
	wg.Wait()
	attackEnd := time.Now()
	res, code, err := sw.wait(ctx, 5*time.Minute)
	samples := rss.end()
	if err != nil {
		return r.fail("normal client (swarm): %v", err)
	}
	m2, _ := metricsText(srv.url)
	openAfter := metricSum(m2, "kettle_http_connections_open")

	expect := map[string]time.Duration{"slow headers": rht, "slow bodies": rt, "idle": it, "never reads": wt}
	for _, k := range []string{"slow headers", "slow bodies", "idle", "never reads"} {
		d := closed[k]
		slices.Sort(d)
		line := fmt.Sprintf("%s: %d cut off by the server", k, len(d))
		if len(d) > 0 {
			line += fmt.Sprintf(" after %.1f–%.1f s (median %.1f s; its bound %s)", d[0].Seconds(), d[len(d)-1].Seconds(), d[len(d)/2].Seconds(), expect[k])
		}
		if unclosed[k] > 0 {
			line += fmt.Sprintf(", %d NOT cut off within %s", unclosed[k], limit)
			r.fail("%s: %d connections outlived their bound", k, unclosed[k])
		}
		if dialErr[k] > 0 {
			line += fmt.Sprintf(", %d could not connect", dialErr[k])
		}
		r.measure("%s", line)
		if len(d) > 0 && d[len(d)-1] > expect[k]+expect[k]/2+2*time.Second {
			r.fail("%s: the slowest was cut off after %.1fs, bound %s", k, d[len(d)-1].Seconds(), expect[k])
		}
	}
	if n := pipelined.Load(); n > 0 {
		r.measure("never-reading clients wrote %d pipelined requests before being cut off", n)
	}
	r.measure("%d idle keep-alive connections held at once (server reported %.0f open); server RSS %d MiB before the attack, %d MiB with them (%.1f KiB per connection), max %d MiB",
		idleAt, openNow, rss0>>10, rssIdle>>10, float64(rssIdle-rss0)/float64(max(idleAt, 1)), slices.Max(append(samples, 0))>>10)
	exl := latStats{}
	if len(excessLat) > 0 {
		ss := make([]sample, len(excessLat))
		for i, d := range excessLat {
			ss[i].lat = d
		}
		exl = stats(ss, nil)
	}
	r.measure("connections past --max-conns %d: %d answered 503 (%s), %d other", maxConns, excess503.Load(), exl, excessOther.Load())
	if excess503.Load() == 0 {
		r.fail("no connection was refused at --max-conns")
	}
	r.measure("open connections after the attack: %.0f (the probes' own: ≤ 4)", openAfter)
	if openAfter > 10 {
		r.fail("%.0f connections still open after every attacker was cut off or gave up", openAfter)
	}
	for _, k := range []string{"idle got 503", "idle got 500"} {
		if dialErr[k] > 0 {
			r.measure("%s: %d", k, dialErr[k])
		}
	}

	line := fmt.Sprintf("normal client (kettle swarm, 50 kettles polling and uploading every second, own process; attack from %.0fs to %.0fs of its run): ",
		start.Sub(res.Start).Seconds(), attackEnd.Sub(res.Start).Seconds())
	var cst, ist latStats
	for _, ep := range []string{"command", "measurement"} {
		// The same client outside the attack is its normal latency on this
		// (shared) machine; under attack it must stay within the 100 ms SLO
		// or, if the machine's noise already puts it near that, within 1.5×
		// its normal p99.
		before := swarmLatency(res, ep, res.Start.Add(2*time.Second), start)
		during := swarmLatency(res, ep, start, attackEnd)
		after := swarmLatency(res, ep, attackEnd.Add(time.Second), res.End)
		normal := max(before.p99, after.p99)
		line += fmt.Sprintf("%s before the attack %s, during %s, after %s; ", ep, before, during, after)
		if lim := max(100*time.Millisecond, normal*3/2); during.p99 > lim {
			r.fail("the normal client's %s p99 under attack %s > %s (normal p99 %s)", ep, ms(during.p99), ms(lim), ms(normal))
		}
		if ep == "command" {
			cst = during
		} else {
			ist = during
		}
	}
	line += fmt.Sprintf("errors %d (%s)", res.Totals.Errors, fmtCounts(kindsInt(res.Totals.ErrorsByKind)))
	if res.Audit != nil {
		line += "; audit " + res.Audit.Line()
		if res.Audit.Lost > 0 || res.Audit.Duplicated > 0 {
			r.fail("normal client's audit: %d lost, %d duplicated", res.Audit.Lost, res.Audit.Duplicated)
		}
	}
	r.measure("%s", line)
	if res.Totals.Errors > 0 || code != 0 {
		r.fail("the normal client saw %d errors (swarm exit %d)", res.Totals.Errors, code)
	}
	if !srv.alive() || srv.panicked() {
		r.fail("server died or panicked")
	}
	if r.Pass {
		r.Verdict = fmt.Sprintf("every slow/idle/non-reading client cut off by its bound, excess connections 503 (%s p99), normal client p99 under attack %s poll / %s upload, 0 errors",
			ms(exl.p99), ms(cst.p99), ms(ist.p99))
	}
	return r
}

func isTimeout(err error) bool {
	var ne net.Error
	if e, ok := err.(net.Error); ok {
		ne = e
		return ne.Timeout()
	}
	return strings.Contains(err.Error(), "timeout")
}
