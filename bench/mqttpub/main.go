// Command mqttpub is the closed-loop MQTT publisher of bench/mqtt.sh: the
// most QoS 1 measurements/s a broker acknowledges, with many connections and
// a window of messages in flight on each. It speaks MQTT 5 with a hand-rolled
// codec (CONNECT, PUBLISH, PUBACK only) so that the publisher, which shares
// the machine with the server, spends as little CPU as possible: one writer
// and one reader goroutine per connection, buffered I/O, writes coalesced.
//
// This is not the simulator (kettle swarm --protocol mqtt is, open model):
// it is a saturation load, each connection sends as fast as its window of
// PUBACKs allows. Every reading has a new device time, so a store really
// inserts each one.
//
//	mqttpub -addr 127.0.0.1:1883 -conns 2000 -inflight 4 -batch 1 -duration 20s -secret S
//
// One line of results: messages/s and readings/s acknowledged (PUBACK reason
// < 0x80), PUBACK latency p50/p99, errors; with -pid / -tree, the CPU of the
// broker's processes and of the machine over the same window.
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/google/uuid"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/wire"
)

var (
	addr      = flag.String("addr", "127.0.0.1:1883", "broker HOST:PORT (loopback only)")
	conns     = flag.Int("conns", 1000, "connections (one device each)")
	inflight  = flag.Int("inflight", 4, "QoS 1 messages awaiting PUBACK per connection")
	batch     = flag.Int("batch", 1, "readings per message (a JSON array when > 1)")
	duration  = flag.Duration("duration", 20*time.Second, "measured window")
	warmup    = flag.Duration("warmup", 5*time.Second, "load before the window opens (not counted)")
	secret    = flag.String("secret", "", "device-token secret (kettle serve); empty: username only (anonymous broker)")
	sourceIPs = flag.Int("source-ips", 1, "spread connections over 127.0.0.1..N")
	connRate  = flag.Int("connect-rate", 2000, "connections opened per second")
	label     = flag.String("label", "", "label printed at the start of the result line")
	pids      = flag.String("pid", "", "comma-separated pids whose CPU to report (e.g. the broker)")
	tree      = flag.String("tree", "", "NAME=PID: also report the CPU of PID and its children, summed (e.g. postgres=<postmaster pid>)")
	interval  = flag.Duration("interval", 0, "open model at a kettle's cadence: each connection sends one message every interval (first at a random offset), one in flight; 0: closed loop, as fast as -inflight allows")
	jsonOut   = flag.Bool("json", false, "print the result as one JSON object (for scripts) instead of a line")
)

type stats struct {
	ok, failed, readings atomic.Int64
	mu                   sync.Mutex
	hist                 *hdrhistogram.Histogram
	counting             atomic.Bool
	reasons              sync.Map // reason code → *atomic.Int64
}

func main() {
	flag.Parse()
	if h, _, err := net.SplitHostPort(*addr); err != nil || !net.ParseIP(h).IsLoopback() {
		fatal(fmt.Errorf("-addr %q: want a loopback HOST:PORT", *addr))
	}
	if *batch < 1 || *batch > kettle.MaxBatch || *inflight < 1 || *inflight > 65535 {
		fatal(errors.New("-batch 1..1000, -inflight 1..65535"))
	}
	if *interval > 0 {
		*inflight = 1
	}
	st := &stats{hist: hdrhistogram.New(1, 120_000_000, 3)}
	var up, down atomic.Int64
	var firstErr atomic.Value
	tick := time.NewTicker(time.Second / time.Duration(max(*connRate, 1)))
	for i := range *conns {
		<-tick.C
		go func() {
			err := run(i, st, &up)
			down.Add(1)
			if err != nil {
				firstErr.CompareAndSwap(nil, err)
			}
		}()
	}
	tick.Stop()
	time.Sleep(*warmup)
	if e := firstErr.Load(); e != nil {
		fmt.Fprintf(os.Stderr, "mqttpub: a connection failed: %v\n", e)
	}
	cpu0, machine0 := cpuOf(), machineTicks()
	self0 := selfCPU()
	st.counting.Store(true)
	t0 := time.Now()
	time.Sleep(*duration)
	st.counting.Store(false)
	el := time.Since(t0).Seconds()
	cpu1, machine1 := cpuOf(), machineTicks()
	self1 := selfCPU()

	st.mu.Lock()
	p50, p99 := float64(st.hist.ValueAtQuantile(50))/1000, float64(st.hist.ValueAtQuantile(99))/1000
	st.mu.Unlock()
	ok, failed := st.ok.Load(), st.failed.Load()
	res := result{Label: *label, Conns: *conns, Up: up.Load() - down.Load(), Seconds: el,
		MsgsPerSec: float64(ok) / el, ReadingsPerSec: float64(st.readings.Load()) / el, Acked: ok, Failed: failed,
		P50ms: p50, P99ms: p99, CPUSeconds: map[string]float64{}, RSSKiB: rssOf(),
		PublisherCPUPct: (self1 - self0) / el * 100, MachineBusyPct: busyPct(machine0, machine1), Cores: numCPU()}
	st.reasons.Range(func(k, v any) bool {
		if res.Reasons == nil {
			res.Reasons = map[string]int64{}
		}
		res.Reasons[fmt.Sprintf("0x%02x", k)] = v.(*atomic.Int64).Load()
		return true
	})
	for name, t := range cpu1 {
		res.CPUSeconds[name] = t - cpu0[name]
	}
	if *jsonOut {
		_ = json.NewEncoder(os.Stdout).Encode(res)
	} else {
		fmt.Println(res.line(*inflight, *batch))
	}
	if e := firstErr.Load(); e != nil && up.Load()-down.Load() < int64(*conns) {
		fmt.Fprintf(os.Stderr, "mqttpub: %d of %d connections ended early; first error: %v\n", down.Load(), *conns, e)
	}
	if ok == 0 {
		os.Exit(1)
	}
}

// result is one run's figures (-json prints it as is).
type result struct {
	Label           string             `json:"label,omitempty"`
	Conns           int                `json:"conns"`
	Up              int64              `json:"up"` // connected at the end of the window
	Seconds         float64            `json:"seconds"`
	MsgsPerSec      float64            `json:"msgs_per_s"`
	ReadingsPerSec  float64            `json:"readings_per_s"`
	Acked           int64              `json:"acked"`
	Failed          int64              `json:"failed"`
	Reasons         map[string]int64   `json:"puback_reasons,omitempty"`
	P50ms           float64            `json:"puback_p50_ms"`
	P99ms           float64            `json:"puback_p99_ms"`
	CPUSeconds      map[string]float64 `json:"cpu_s"`   // over the window, per -pid / -tree
	RSSKiB          map[string]int64   `json:"rss_kib"` // at the end of the window, per -pid
	PublisherCPUPct float64            `json:"publisher_cpu_pct"`
	MachineBusyPct  float64            `json:"machine_busy_pct"`
	Cores           int                `json:"cores"`
}

func (r result) line(inflight, batch int) string {
	var b strings.Builder
	if r.Label != "" {
		b.WriteString(r.Label + ": ")
	}
	fmt.Fprintf(&b, "%.0f msgs/s, %.0f readings/s (conns %d up %d, inflight %d, batch %d, %.0fs): PUBACK p50 %.1fms p99 %.1fms, failed %d",
		r.MsgsPerSec, r.ReadingsPerSec, r.Conns, r.Up, inflight, batch, r.Seconds, r.P50ms, r.P99ms, r.Failed)
	for k, v := range r.Reasons {
		fmt.Fprintf(&b, " reason_%s=%d", k, v)
	}
	for name, t := range r.CPUSeconds {
		fmt.Fprintf(&b, "; %s CPU %.0f%%", name, t/r.Seconds*100)
	}
	for name, kib := range r.RSSKiB {
		fmt.Fprintf(&b, "; %s RSS %d KiB", name, kib)
	}
	fmt.Fprintf(&b, "; publisher CPU %.0f%%; machine busy %.0f%% of %d cores", r.PublisherCPUPct, r.MachineBusyPct, r.Cores)
	return b.String()
}

// rssOf is the resident set of each -pid process, KiB.
func rssOf() map[string]int64 {
	out := map[string]int64{}
	for _, p := range strings.Split(*pids, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		b, err := os.ReadFile("/proc/" + p + "/status")
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				kib, _ := strconv.ParseInt(f[1], 10, 64)
				out[procName(p)] = kib
			}
		}
	}
	return out
}

func procName(p string) string {
	if c, err := os.ReadFile("/proc/" + p + "/comm"); err == nil {
		return strings.TrimSpace(string(c)) + " (" + p + ")"
	}
	return "pid " + p
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "mqttpub:", err)
	os.Exit(1)
}

// run is one device's connection: CONNECT, then publish until the process ends.
func run(i int, st *stats, up *atomic.Int64) error {
	d := net.Dialer{Timeout: 10 * time.Second}
	if n := *sourceIPs; n > 1 {
		j := i%n + 1
		d.LocalAddr = &net.TCPAddr{IP: net.IPv4(127, byte(j>>16), byte(j>>8), byte(j))}
	}
	nc, err := d.Dial("tcp", *addr)
	if err != nil {
		return err
	}
	defer nc.Close()
	br := bufio.NewReaderSize(nc, 4096)
	bw := bufio.NewWriterSize(nc, 16<<10)
	user, err := connect(nc, br, bw)
	if err != nil {
		return err
	}
	up.Add(1)

	w := *inflight
	free := make(chan uint16, w)
	for p := 1; p <= w; p++ {
		free <- uint16(p)
	}
	sent := make([]int64, w+1) // pid → send time (ns)
	errc := make(chan error, 2)
	go func() { errc <- readAcks(br, st, free, sent) }()
	return publish(bw, "kettles/"+user+"/measurements", free, sent, errc)
}

// connect sends CONNECT as a new kettle and waits for its CONNACK; it
// returns the kettle's id.
func connect(nc net.Conn, br *bufio.Reader, bw *bufio.Writer) (string, error) {
	id := uuid.New()
	user := id.String()
	pass := ""
	if *secret != "" {
		pass = kettle.DeviceToken([]byte(*secret), id)
	}
	bw.Write(connectPacket(user, user, pass))
	if err := bw.Flush(); err != nil {
		return "", err
	}
	nc.SetReadDeadline(time.Now().Add(30 * time.Second))
	typ, body, err := readPacket(br)
	if err != nil {
		return "", fmt.Errorf("connack: %w", err)
	}
	if typ != 2 || len(body) < 2 || body[1] >= 0x80 {
		return "", fmt.Errorf("connect refused: type %d body %x", typ, body)
	}
	nc.SetReadDeadline(time.Time{})
	return user, nil
}

// readAcks counts PUBACKs and their latency from sent, and hands each
// packet id back to free; it returns when the connection ends.
func readAcks(br *bufio.Reader, st *stats, free chan<- uint16, sent []int64) error {
	for {
		typ, body, err := readPacket(br)
		if err != nil {
			return err
		}
		switch typ {
		case 4: // PUBACK
			if len(body) < 2 {
				return errors.New("short PUBACK")
			}
			pid := binary.BigEndian.Uint16(body)
			reason := byte(0)
			if len(body) > 2 {
				reason = body[2]
			}
			if st.counting.Load() {
				if reason < 0x80 {
					st.ok.Add(1)
					st.readings.Add(int64(*batch))
				} else {
					st.failed.Add(1)
				}
				if reason != 0 {
					v, _ := st.reasons.LoadOrStore(reason, new(atomic.Int64))
					v.(*atomic.Int64).Add(1)
				}
				lat := (time.Now().UnixNano() - atomic.LoadInt64(&sent[pid])) / 1000
				st.mu.Lock()
				_ = st.hist.RecordValue(max(lat, 1))
				st.mu.Unlock()
			}
			free <- pid
		case 14: // DISCONNECT
			return fmt.Errorf("server DISCONNECT %x", body)
		}
	}
}

// publish sends readings on topic: one per --interval (open model), or as
// fast as free packet ids allow.
func publish(bw *bufio.Writer, topic string, free chan uint16, sent []int64, errc <-chan error) error {
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	var seq int64
	next := time.Now().Add(rand.N(max(*interval, 1))) // open model: this kettle's first send
	pkt := make([]byte, 0, 512)
	payload := make([]byte, 0, 256)
	for {
		var pid uint16
		if *interval > 0 {
			t := time.NewTimer(time.Until(next))
			select {
			case <-t.C:
			case err := <-errc:
				t.Stop()
				return err
			}
			next = next.Add(*interval)
		}
		select {
		case pid = <-free:
		case err := <-errc:
			return err
		}
		for {
			payload = payload[:0]
			if *batch > 1 {
				payload = append(payload, '[')
			}
			for j := range *batch {
				if j > 0 {
					payload = append(payload, ',')
				}
				payload = appendReading(payload, base.Add(time.Duration(seq)*time.Microsecond), seq)
				seq++
			}
			if *batch > 1 {
				payload = append(payload, ']')
			}
			pkt = publishPacket(pkt[:0], topic, pid, payload)
			sentAt := time.Now()
			if *interval > 0 {
				sentAt = next.Add(-*interval) // from the intended time: a late send counts against the broker
			}
			atomic.StoreInt64(&sent[pid], sentAt.UnixNano())
			if _, err := bw.Write(pkt); err != nil {
				return err
			}
			if *interval > 0 {
				break
			}
			select {
			case pid = <-free: // more room: keep filling the buffer
				continue
			default:
			}
			break
		}
		if err := bw.Flush(); err != nil {
			return err
		}
	}
}

// appendReading is reading seq as a kettle publishes it (wire's v1 bytes).
func appendReading(b []byte, t time.Time, seq int64) []byte {
	return wire.AppendV1(b, &kettle.Measurement{Time: t, ChargeMWh: float64(100000 + seq%1000), FullMWh: 200000, RateMW: -1200,
		AmbientC: 21.5, WaterC: float64(20 + seq%70), LevelML: float64(seq % 1500)})
}

// MQTT 5 encoding of the three packets we need.

func appendVBI(b []byte, n int) []byte {
	for {
		c := byte(n % 128)
		n /= 128
		if n > 0 {
			c |= 0x80
		}
		b = append(b, c)
		if n == 0 {
			return b
		}
	}
}

func appendStr(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

func connectPacket(clientID, user, pass string) []byte {
	var v []byte
	v = appendStr(v, "MQTT")
	flags := byte(0x02 | 0x80) // clean start, username
	if pass != "" {
		flags |= 0x40
	}
	v = append(v, 5, flags)
	v = binary.BigEndian.AppendUint16(v, 600) // keepalive: the stream never idles
	v = append(v, 0)                          // no properties
	v = appendStr(v, clientID)
	v = appendStr(v, user)
	if pass != "" {
		v = appendStr(v, pass)
	}
	b := appendVBI([]byte{0x10}, len(v))
	return append(b, v...)
}

func publishPacket(b []byte, topic string, pid uint16, payload []byte) []byte {
	n := 2 + len(topic) + 2 + 1 + len(payload)
	b = append(b, 0x32) // PUBLISH, QoS 1
	b = appendVBI(b, n)
	b = appendStr(b, topic)
	b = binary.BigEndian.AppendUint16(b, pid)
	b = append(b, 0) // no properties
	return append(b, payload...)
}

func readPacket(br *bufio.Reader) (typ byte, body []byte, err error) {
	h, err := br.ReadByte()
	if err != nil {
		return 0, nil, err
	}
	n, mul := 0, 1
	for i := 0; ; i++ {
		c, err := br.ReadByte()
		if err != nil {
			return 0, nil, err
		}
		n += int(c&0x7f) * mul
		mul *= 128
		if c&0x80 == 0 {
			break
		}
		if i == 3 {
			return 0, nil, errors.New("bad remaining length")
		}
	}
	body = make([]byte, n)
	if _, err := io.ReadFull(br, body); err != nil {
		return 0, nil, err
	}
	return h >> 4, body, nil
}

// CPU accounting from /proc (clock ticks → seconds).

const hz = 100.0

func procCPU(pid string) (float64, bool) {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0, false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 13 {
		return 0, false
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	sy, _ := strconv.ParseFloat(f[12], 64)
	return (u + sy) / hz, true
}

// cpuOf is the CPU seconds of the -pid processes and, summed, of every
// process named -comm.
func cpuOf() map[string]float64 {
	out := map[string]float64{}
	for _, p := range strings.Split(*pids, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if t, ok := procCPU(p); ok {
			out[procName(p)] = t
		}
	}
	if name, root, ok := strings.Cut(*tree, "="); ok {
		sum, _ := procCPU(root)
		dirs, _ := filepath.Glob("/proc/[0-9]*")
		for _, d := range dirs {
			b, err := os.ReadFile(d + "/stat")
			if err != nil {
				continue
			}
			s := string(b)
			i := strings.LastIndexByte(s, ')')
			if f := strings.Fields(s[i+2:]); i > 0 && len(f) > 1 && f[1] == root {
				t, _ := procCPU(filepath.Base(d))
				sum += t
			}
		}
		out[name+" (pid "+root+" + children)"] = sum
	}
	return out
}

func selfCPU() float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

// machineTicks is /proc/stat's cpu line: busy and total ticks.
func machineTicks() [2]float64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return [2]float64{}
	}
	line := strings.SplitN(string(b), "\n", 2)[0]
	var busy, total float64
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseFloat(f, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return [2]float64{busy, total}
}

func busyPct(a, b [2]float64) float64 {
	if b[1] == a[1] {
		return 0
	}
	return (b[0] - a[0]) / (b[1] - a[1]) * 100
}

func numCPU() int {
	b, _ := os.ReadFile("/proc/stat")
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "cpu") && len(l) > 3 && l[3] >= '0' && l[3] <= '9' {
			n++
		}
	}
	return n
}
