package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
)

// The reconnect storm (issue 47): a node holds a fleet of MQTT kettles at
// their 30 s cadence (bench/mqttpub -interval, open model), and the kettles
// of a lost node — each with one QoS 1 reading its old node never
// acknowledged — reconnect to it within a few seconds. Half of those
// readings had in fact been committed by the old node (the PUBACK was lost
// with it): they come again and must be stored once.
//
// What must hold: every CONNECT of the storm gets a CONNACK — accepted, or
// refused with a reason (the node has one process's open files; past
// --mqtt-max-conns it says 0x97 quota exceeded, 3.1.1 0x03) — within
// stormConnackBound, never a bare close; the held fleet's PUBACK p99 stays ≤
// 100 ms and none of it drops; every reading acknowledged is stored once
// (audit); refused kettles back off with jitter and keep their reading.
const (
	stormConnackBound = 5 * time.Second
	stormP99Bound     = 100 * time.Millisecond
	stormRetryFor     = 25 * time.Second // after the window, refused kettles keep trying this long
)

// stormStats are the storm kettles' outcomes.
type stormStats struct {
	attempts, accepted, acked, noConnack, pubFailed atomic.Int64
	dropped                                         atomic.Int64 // accepted connections the node closed before the end
	dropErr                                         atomic.Value
	noConnackErr                                    atomic.Value // the first
	mu                                              sync.Mutex
	byCode                                          map[string]int64
	waits                                           []time.Duration // CONNECT → CONNACK, every attempt
	ackedDev, prestored                             map[uuid.UUID]int64
}

func (s *stormStats) record(code string, wait time.Duration) {
	s.mu.Lock()
	s.byCode[code]++
	s.waits = append(s.waits, wait)
	s.mu.Unlock()
}

func partMQTTStorm(ctx context.Context, e *env) *Result {
	r := &Result{Pass: true}
	held, storm, window, maxConns := e.stormHeld, e.stormKettles, e.stormWindow, e.stormMaxConns
	r.Done = fmt.Sprintf("kettle serve (embedded store, --mqtt-max-conns %d) holding %d MQTT kettles at 30 s (bench/mqttpub -interval 30s, QoS 1); "+
		"%d more kettles (1 in 4 MQTT 3.1.1), each with one unacknowledged QoS 1 reading (half of them already stored by the \"lost\" node), "+
		"connect within %s and retry refusals with jittered backoff for %s more; audit of every acknowledged and every pre-stored reading",
		maxConns, held, storm, window, stormRetryFor)
	pub := filepath.Join(e.out, "bin", "mqttpub")
	build := exec.CommandContext(ctx, "go", "build", "-o", pub, "./bench/mqttpub")
	build.Dir = e.root
	if b, err := build.CombinedOutput(); err != nil {
		return r.fail("go build ./bench/mqttpub: %v %s", err, b)
	}
	maddr, _ := freeAddr()
	srv, dir, data, err := startPartServe(ctx, e, "mqttstorm", "",
		"--mqtt-addr", maddr, "--mqtt-max-conns", strconv.Itoa(maxConns), "--max-conns", "500")
	if err != nil {
		return r.fail("%v", err)
	}
	defer srv.stop()
	sr := &stormRun{r: r, srv: srv, maddr: maddr, secret: readSecret(data, "secret"), held: held, window: window,
		at: time.Now().Add(-10 * time.Minute).Truncate(time.Second).UTC(),
		st: &stormStats{byCode: map[string]int64{}, ackedDev: map[uuid.UUID]int64{}, prestored: map[uuid.UUID]int64{}}}
	if err := sr.prestore(ctx, e, storm); err != nil {
		return r.fail("pre-storing the lost node's committed readings: %v", err)
	}
	hf, err := sr.startHeld(ctx, pub)
	if err != nil {
		return r.fail("start mqttpub: %v", err)
	}
	// The held fleet connects at 2,000/s, then is measured from the
	// storm's start to the end of the retries.
	if !sleep(ctx, hf.warm) {
		return r.fail("interrupted")
	}
	e.logf("mqttstorm: %.0f kettles held; storm of %d over %s", metricValue(srv.url, "kettle_mqtt_connections"), storm, window)
	sr.storm(ctx, hf)
	res := hf.result(r, dir)
	maxWait := sr.judgeConnects(res)
	if err := sr.audit(ctx, readSecret(data, "operator-token")); err != nil {
		return r.fail("audit: %v", err)
	}
	if srv.panicked() || !srv.alive() {
		r.fail("kettle serve died or panicked (see %s)", srv.logPath)
	}
	if r.Pass {
		r.Verdict = fmt.Sprintf("every storm CONNECT answered within %s (max %s), held fleet p99 %.1f ms, audit clean", stormConnackBound, maxWait.Round(time.Millisecond), res.P99)
	}
	return r
}

// stormRun is one reconnect storm: the node, the storm kettles and what
// they saw.
type stormRun struct {
	r      *Result
	srv    *serveProc
	maddr  string // the node's MQTT listener
	secret string
	held   int
	window time.Duration
	devs   []uuid.UUID // the storm kettles
	at     time.Time   // the time of each one's pending reading
	st     *stormStats
}

// prestore makes the storm kettles and stores half of their pending
// readings over HTTP: the lost node had committed them, its PUBACK was lost.
func (sr *stormRun) prestore(ctx context.Context, e *env, storm int) error {
	sr.devs = make([]uuid.UUID, storm)
	for i := range sr.devs {
		sr.devs[i] = uuid.New()
	}
	if err := prestore(ctx, sr.srv.url, sr.secret, sr.devs[:storm/2], sr.at); err != nil {
		return err
	}
	for _, d := range sr.devs[:storm/2] {
		sr.st.prestored[d] = 1
	}
	e.logf("mqttstorm: %d readings pre-stored over HTTP", storm/2)
	return nil
}

// heldFleet is the mqttpub process holding the node's own fleet.
type heldFleet struct {
	warm           time.Duration // its connecting, before it measures
	stdout, stderr bytes.Buffer
	done           chan error
	exit           error
}

// wait waits for mqttpub's end; later calls return the same exit.
func (hf *heldFleet) wait() error {
	if hf.done != nil {
		hf.exit = <-hf.done
		hf.done = nil
	}
	return hf.exit
}

// heldResult is mqttpub's JSON line.
type heldResult struct {
	Up      int64   `json:"up"`
	Acked   int64   `json:"acked"`
	Failed  int64   `json:"failed"`
	P99     float64 `json:"puback_p99_ms"`
	P50     float64 `json:"puback_p50_ms"`
	Seconds float64 `json:"seconds"`
}

// startHeld starts the held fleet: sr.held kettles at their 30 s cadence,
// measured until the storm's retries are over.
func (sr *stormRun) startHeld(ctx context.Context, pub string) (*heldFleet, error) {
	hf := &heldFleet{warm: time.Duration(sr.held/2000+10) * time.Second, done: make(chan error, 1)}
	measure := sr.window + stormRetryFor + 5*time.Second // the held fleet outlasts the storm
	cmd := exec.CommandContext(ctx, pub, "-addr", sr.maddr, "-conns", strconv.Itoa(sr.held), "-interval", "30s", "-connect-rate", "2000",
		"-warmup", hf.warm.String(), "-duration", measure.String(), "-secret", sr.secret, "-pid", strconv.Itoa(sr.srv.pid()), "-json", "-label", "held")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stdout, cmd.Stderr = &hf.stdout, &hf.stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := hf.done
	go func() { done <- cmd.Wait() }()
	return hf, nil
}

// result waits for the held fleet's end and reads its result (kept in
// dir/held.json).
func (hf *heldFleet) result(r *Result, dir string) heldResult {
	perr := hf.wait()
	var res heldResult
	_ = os.WriteFile(filepath.Join(dir, "held.json"), hf.stdout.Bytes(), 0o644)
	if err := json.Unmarshal(hf.stdout.Bytes(), &res); err != nil {
		r.fail("held fleet: no result from mqttpub (%v, %v): %s", perr, err, strings.TrimSpace(hf.stderr.String()))
	}
	return res
}

// storm: every storm kettle connects at a random moment of the window and
// retries refusals until the held fleet's run is over.
func (sr *stormRun) storm(ctx context.Context, hf *heldFleet) {
	stormCtx, stopStorm := context.WithCancel(ctx)
	deadline := time.Now().Add(sr.window + stormRetryFor)
	var wg sync.WaitGroup
	conns := make(chan net.Conn, len(sr.devs))
	for i, d := range sr.devs {
		wg.Go(func() {
			delay := rand.N(sr.window)
			if !sleep(stormCtx, delay) {
				return
			}
			version := byte(5)
			if i%4 == 3 {
				version = 4
			}
			if c := stormKettle(stormCtx, sr.maddr, sr.secret, d, version, sr.at, deadline, sr.st); c != nil {
				conns <- c
			}
		})
	}
	wg.Wait()
	// The accepted kettles stay connected until the held fleet ends: a
	// close by the node before then is a drop.
	hf.wait()
	stopStorm()
	close(conns)
	for c := range conns {
		c.Close()
	}
}

// judgeConnects holds every storm CONNECT to its CONNACK bound and the held
// fleet to its PUBACK bound; it returns the longest CONNECT → CONNACK.
func (sr *stormRun) judgeConnects(res heldResult) time.Duration {
	r, st := sr.r, sr.st
	shed := metricValue(sr.srv.url, `kettle_mqtt_connects_shed_total{reason="quota_exceeded"}`)
	slices.Sort(st.waits)
	q := func(p float64) time.Duration {
		if len(st.waits) == 0 {
			return 0
		}
		return st.waits[min(len(st.waits)-1, int(p*float64(len(st.waits))))]
	}
	maxWait := q(1)
	codes := make([]string, 0, len(st.byCode))
	for c, n := range st.byCode {
		codes = append(codes, fmt.Sprintf("%s×%d", c, n))
	}
	slices.Sort(codes)
	r.measure("held fleet: %d of %d connected at the end, %d PUBACKs in %.0f s, p50 %.1f ms, p99 %.1f ms, failed %d", res.Up, sr.held, res.Acked, res.Seconds, res.P50, res.P99, res.Failed)
	r.measure("storm: %d kettles, %d CONNECT attempts, CONNACKs %s; no CONNACK %d (first: %v); dial→CONNACK p50 %s p99 %s max %s",
		len(sr.devs), st.attempts.Load(), strings.Join(codes, " "), st.noConnack.Load(), st.noConnackErr.Load(), q(0.5).Round(time.Millisecond), q(0.99).Round(time.Millisecond), maxWait.Round(time.Millisecond))
	r.measure("storm kettles accepted %d, of them closed by the node before the end %d (first: %v), readings acknowledged %d, PUBLISH without PUBACK %d; node counted %.0f refusals (quota_exceeded)",
		st.accepted.Load(), st.dropped.Load(), st.dropErr.Load(), st.acked.Load(), st.pubFailed.Load(), shed)
	if st.dropped.Load() > 0 {
		r.fail("the node closed %d accepted storm connections", st.dropped.Load())
	}
	if st.noConnack.Load() > 0 {
		r.fail("%d CONNECTs got no CONNACK", st.noConnack.Load())
	}
	if maxWait > stormConnackBound {
		r.fail("a CONNACK took %s (bound %s)", maxWait.Round(time.Millisecond), stormConnackBound)
	}
	if res.Up != int64(sr.held) || res.Failed > 0 {
		r.fail("held fleet: %d of %d still connected, %d failed PUBACKs", res.Up, sr.held, res.Failed)
	}
	if res.P99 > float64(stormP99Bound/time.Millisecond) {
		r.fail("held fleet's PUBACK p99 %.1f ms > %s during the storm", res.P99, stormP99Bound)
	}
	return maxWait
}

// audit: every acknowledged reading and every pre-stored one, stored once.
func (sr *stormRun) audit(ctx context.Context, operator string) error {
	devs := map[uuid.UUID]bool{}
	for d := range sr.st.ackedDev {
		devs[d] = true
	}
	for d := range sr.st.prestored {
		devs[d] = true
	}
	lost, dup, checked, err := auditOnce(ctx, sr.srv.url, operator, devs, sr.at)
	if err != nil {
		return err
	}
	sr.r.measure("audit: %d devices (acknowledged or pre-stored), lost %d, duplicated %d", checked, lost, dup)
	if lost > 0 || dup > 0 {
		sr.r.fail("audit: %d lost, %d duplicated", lost, dup)
	}
	return nil
}

// stormKettle connects one storm kettle until accepted (or the deadline),
// backing off with jitter after each refusal, then resends its reading and
// returns the open connection (nil: never accepted).
func stormKettle(ctx context.Context, addr, secret string, id uuid.UUID, version byte, at, deadline time.Time, st *stormStats) net.Conn {
	backoff := time.Second
	for attempt := 0; time.Now().Before(deadline) && ctx.Err() == nil; attempt++ {
		if attempt > 0 {
			wait := time.Duration(float64(backoff) * (0.5 + rand.Float64()))
			if time.Now().Add(wait).After(deadline) || !sleep(ctx, wait) {
				return nil
			}
			backoff = min(2*backoff, 8*time.Second)
		}
		st.attempts.Add(1)
		c, code, wait, err := stormConnect(addr, stormSource(id), secret, id, version)
		if err != nil {
			st.noConnack.Add(1)
			st.noConnackErr.CompareAndSwap(nil, err.Error())
			st.record("none", wait)
			continue
		}
		st.record(code, wait)
		if code != "0x00" {
			continue
		}
		st.accepted.Add(1)
		t := time.Now()
		if stormPublish(c, id, version, at) {
			st.acked.Add(1)
			st.mu.Lock()
			st.ackedDev[id]++
			st.mu.Unlock()
		} else {
			st.pubFailed.Add(1)
		}
		go func() { // the node keeps it open: anything but our own close at the end is a drop
			for {
				if _, _, err := readMQTT(c); err != nil {
					if ctx.Err() == nil {
						st.dropped.Add(1)
						st.dropErr.CompareAndSwap(nil, fmt.Sprintf("%s after %s", err, time.Since(t)))
					}
					return
				}
			}
		}()
		return c
	}
	return nil
}

// stormConnect dials and sends CONNECT; code is the CONNACK's reason (v5) or
// return code (3.1.1) as 0x%02x, wait the time from dial to CONNACK.
func stormConnect(addr string, src net.Addr, secret string, id uuid.UUID, version byte) (c net.Conn, code string, wait time.Duration, err error) {
	t0 := time.Now()
	d := net.Dialer{Timeout: 10 * time.Second, LocalAddr: src}
	c, err = d.Dial("tcp", addr)
	if err != nil {
		return nil, "", time.Since(t0), err
	}
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: version}
	pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 120, ClientIdentifier: id.String(),
		UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken([]byte(secret), id))}
	var buf bytes.Buffer
	_ = pk.ConnectEncode(&buf)
	if _, err := c.Write(buf.Bytes()); err != nil {
		c.Close()
		return nil, "", time.Since(t0), err
	}
	typ, body, err := readMQTT(c)
	wait = time.Since(t0)
	if err != nil || typ != packets.Connack || len(body) < 2 {
		c.Close()
		if err == nil {
			err = fmt.Errorf("want CONNACK, got packet type %d", typ)
		}
		return nil, "", wait, err
	}
	code = fmt.Sprintf("0x%02x", body[1])
	if body[1] != 0 {
		c.Close()
		return nil, code, wait, nil
	}
	_ = c.SetDeadline(time.Time{})
	return c, code, wait, nil
}

// stormSource spreads the storm over source addresses 127.0.47.10–59 (the
// chaos address block of issue 47): from one address, the held fleet and
// the storm's attempts (each refused one leaves a TIME_WAIT) would run out
// of the ~28,000 ephemeral ports to one server port.
func stormSource(id uuid.UUID) net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 47, 10+id[0]%50)}
}

// stormPublish resends the kettle's pending reading at QoS 1 and waits for
// its PUBACK (the retained command may come first).
func stormPublish(c net.Conn, id uuid.UUID, version byte, at time.Time) bool {
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	defer c.SetDeadline(time.Time{})
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, ProtocolVersion: version, PacketID: 1,
		TopicName: "kettles/" + id.String() + "/measurements", Payload: stormReading(at)}
	var buf bytes.Buffer
	if err := pk.PublishEncode(&buf); err != nil {
		return false
	}
	if _, err := c.Write(buf.Bytes()); err != nil {
		return false
	}
	for {
		typ, body, err := readMQTT(c)
		if err != nil {
			return false
		}
		if typ == packets.Puback {
			return len(body) >= 2 && body[0] == 0 && body[1] == 1 && (len(body) < 3 || body[2] < 0x80)
		}
	}
}

func stormReading(at time.Time) []byte {
	return fmt.Appendf(nil, `{"time":%q,"battery_charge_mwh":100000,"battery_full_mwh":200000,"battery_rate_mw":-1200,"ambient_temp_c":21.5,"water_temp_c":60,"water_level_ml":900}`,
		at.Format(time.RFC3339))
}

// readMQTT reads one packet: its type and body.
func readMQTT(c net.Conn) (byte, []byte, error) {
	var hdr [1]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return 0, nil, err
	}
	n, _, err := packets.DecodeLength(byteReader{c})
	if err != nil {
		return 0, nil, err
	}
	body := make([]byte, n)
	_, err = io.ReadFull(c, body)
	return hdr[0] >> 4, body, err
}

type byteReader struct{ c net.Conn }

func (b byteReader) ReadByte() (byte, error) {
	var p [1]byte
	_, err := io.ReadFull(b.c, p[:])
	return p[0], err
}

// prestore commits each device's reading at `at` over HTTP (as the lost node
// did before it could send the PUBACK).
func prestore(ctx context.Context, base, secret string, devs []uuid.UUID, at time.Time) error {
	cl := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	return forEach(ctx, devs, 16, func(id uuid.UUID) error {
		for attempt := 0; ; attempt++ {
			req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/measurements", bytes.NewReader(stormReading(at)))
			req.Header.Set("Authorization", "Bearer "+kettle.DeviceToken([]byte(secret), id))
			req.Header.Set("Content-Type", "application/json")
			resp, err := cl.Do(req)
			if err != nil {
				return err
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			if resp.StatusCode != http.StatusServiceUnavailable || attempt > 20 {
				return fmt.Errorf("POST /v1/measurements: %s", resp.Status)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
}

// auditOnce counts, for each device, its readings stored at `at`: 0 is lost,
// more than 1 duplicated.
func auditOnce(ctx context.Context, base, operator string, devs map[uuid.UUID]bool, at time.Time) (lost, dup, checked int, err error) {
	cl := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	ids := make([]uuid.UUID, 0, len(devs))
	for d := range devs {
		ids = append(ids, d)
	}
	var mu sync.Mutex
	err = forEach(ctx, ids, 16, func(id uuid.UUID) error {
		u := fmt.Sprintf("%s/v1/devices/%s/measurements?from=%s&to=%s&limit=10", base, id,
			at.Add(-time.Minute).Format(time.RFC3339), at.Add(time.Minute).Format(time.RFC3339))
		req, _ := http.NewRequestWithContext(ctx, "GET", u, nil)
		req.Header.Set("Authorization", "Bearer "+operator)
		resp, err := cl.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
			return fmt.Errorf("GET history: %s %s", resp.Status, b)
		}
		var page struct {
			Measurements []json.RawMessage `json:"measurements"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&page); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		checked++
		switch n := len(page.Measurements); {
		case n == 0:
			lost++
		case n > 1:
			dup++
		}
		return nil
	})
	return lost, dup, checked, err
}

// forEach runs f on every id, n at once; the first error wins.
func forEach(ctx context.Context, ids []uuid.UUID, n int, f func(uuid.UUID) error) error {
	ch := make(chan uuid.UUID)
	var wg sync.WaitGroup
	var first atomic.Value
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range ch {
				if err := f(id); err != nil {
					first.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	for _, id := range ids {
		if ctx.Err() != nil || first.Load() != nil {
			break
		}
		ch <- id
	}
	close(ch)
	wg.Wait()
	if err, _ := first.Load().(error); err != nil {
		return err
	}
	return ctx.Err()
}

var metricLineRE = regexp.MustCompile(`(?m)^(\S+) (\S+)$`)

// metricValue reads one sample (name with its labels, as exposed) from
// /metrics; -1 if absent.
func metricValue(base, name string) float64 {
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if m := metricLineRE.FindStringSubmatch(sc.Text()); m != nil && m[1] == name {
			v, _ := strconv.ParseFloat(m[2], 64)
			return v
		}
	}
	return -1
}
