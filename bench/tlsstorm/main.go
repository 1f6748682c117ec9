// Command tlsstorm is the reconnection storm of bench/tls.sh: how many new
// connections a server takes per second, and what each costs it. Every
// worker, in a closed loop: dial, (https: handshake, full or resumed),
// GET /healthz on the new connection, read the answer, close. After a
// restart every kettle of a fleet does this once, within its interval.
// With -mqtt-secret the target is kettle serve's MQTT listener (mqtt:// or
// mqtts://) and the exchange a kettle's CONNECT (a fresh device, its
// token), the CONNACK, and DISCONNECT.
//
//	tlsstorm -target https://127.0.0.1:8443 -ca cert.pem -resume=false -workers 64 -duration 10s -pid 1234
//	tlsstorm -target mqtts://127.0.0.1:8883 -ca cert.pem -mqtt-secret "$(cat data/secret)" -resume -pid 1234
//
// One line of results: connections/s, connect-to-answer latency p50/p99,
// errors, and with -pid the server's CPU per connection over the same
// window (from /proc/PID/stat).
package main

import (
	"bufio"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/eclipse/paho.golang/packets"
	"github.com/google/uuid"
	"github.com/prometheus/procfs"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/tlscert"
)

var (
	target   = flag.String("target", "http://127.0.0.1:8080", "server base URL, http or https (loopback only)")
	ca       = flag.String("ca", "", "https: PEM file of the certificate to trust")
	curves   = flag.String("curves", "", "https: key exchanges the client offers, comma-separated Go names (X25519, CurveP256, X25519MLKEM768); empty: Go's default (X25519MLKEM768 first)")
	resume   = flag.Bool("resume", false, "https: resume TLS sessions (a ticket from an earlier connection) instead of a full handshake each")
	workers  = flag.Int("workers", 64, "connections being opened at once")
	duration = flag.Duration("duration", 10*time.Second, "measured window")
	warmup   = flag.Duration("warmup", 2*time.Second, "load before the window opens (not counted)")
	pid      = flag.Int("pid", 0, "server pid whose CPU to report per connection (0: none)")
	label    = flag.String("label", "", "label printed at the start of the result line")
	mqttKey  = flag.String("mqtt-secret", "", "mqtt(s)://: the device-token secret kettle serve signs the kettles' tokens with")
)

func main() {
	flag.Parse()
	u, err := url.Parse(*target)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "mqtt" && u.Scheme != "mqtts") {
		fail("-target %q: want http(s)://HOST:PORT or mqtt(s)://HOST:PORT", *target)
	}
	isMQTT := u.Scheme == "mqtt" || u.Scheme == "mqtts"
	if isMQTT && *mqttKey == "" {
		fail("-target %s: -mqtt-secret is required (the kettles' CONNECT carries a device token)", *target)
	}
	if ip := net.ParseIP(u.Hostname()); ip == nil || !ip.IsLoopback() {
		fail("-target %s: loopback addresses only", *target)
	}
	cfg := clientTLS(u)
	once := func() (bool, error) { return connectOnce(u, cfg, isMQTT) }
	if _, err := once(); err != nil { // a certificate not trusted, a server not up: say so
		fail("first connection: %v", err)
	}

	var (
		counting atomic.Bool
		stop     atomic.Bool
		ok, errs atomic.Int64
		resumed  atomic.Int64
		firstErr atomic.Value
		mu       sync.Mutex
		hist     = hdrhistogram.New(1, 60_000_000, 3) // µs
		wg       sync.WaitGroup
	)
	for range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := hdrhistogram.New(1, 60_000_000, 3)
			for !stop.Load() {
				began := time.Now()
				r, err := once()
				if !counting.Load() {
					continue
				}
				if err != nil {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					continue
				}
				ok.Add(1)
				if r {
					resumed.Add(1)
				}
				local.RecordValue(time.Since(began).Microseconds())
			}
			mu.Lock()
			hist.Merge(local)
			mu.Unlock()
		}()
	}
	time.Sleep(*warmup)
	cpu0 := procCPU(*pid)
	began := time.Now()
	counting.Store(true)
	time.Sleep(*duration)
	counting.Store(false)
	took := time.Since(began)
	cpu1 := procCPU(*pid)
	stop.Store(true)
	wg.Wait()

	n := ok.Load()
	line := fmt.Sprintf("%sRESULT conns=%d conns_per_s=%.1f resumed=%d p50_ms=%.2f p99_ms=%.2f errors=%d",
		prefix(), n, float64(n)/took.Seconds(), resumed.Load(), float64(hist.ValueAtQuantile(50))/1000, float64(hist.ValueAtQuantile(99))/1000, errs.Load())
	if *pid > 0 && n > 0 {
		line += fmt.Sprintf(" server_cpu_us_per_conn=%.1f server_cpu_pct=%.0f", (cpu1-cpu0)/float64(n)*1e6, (cpu1-cpu0)/took.Seconds()*100)
	}
	if e, _ := firstErr.Load().(string); e != "" {
		line += " first_error=" + strings.ReplaceAll(e, " ", "_")
	}
	fmt.Println(line)
}

// clientTLS is the TLS client configuration for u (nil for plain
// http and mqtt): -ca, -curves and -resume.
func clientTLS(u *url.URL) *tls.Config {
	var cfg *tls.Config
	if u.Scheme == "https" || u.Scheme == "mqtts" {
		cfg = &tls.Config{ServerName: u.Hostname()}
		if *ca != "" {
			pool, err := tlscert.Pool("-ca", *ca)
			if err != nil {
				fail("%v", err)
			}
			cfg.RootCAs = pool
		}
		for _, n := range strings.Split(*curves, ",") {
			id, ok := curveIDs[strings.TrimSpace(n)]
			if n == "" {
				continue
			} else if !ok {
				fail("-curves: %q is not one of X25519, CurveP256, CurveP384, X25519MLKEM768", n)
			}
			cfg.CurvePreferences = append(cfg.CurvePreferences, id)
		}
		if *resume {
			cfg.ClientSessionCache = tls.NewLRUClientSessionCache(16)
		}
	}
	return cfg
}

// connectOnce is one connection of the storm: dial, the TLS handshake
// (it reports whether the session was resumed), then an HTTP GET /healthz
// or a kettle's MQTT session, and close.
func connectOnce(u *url.URL, cfg *tls.Config, isMQTT bool) (bool, error) {
	req := []byte("GET /healthz HTTP/1.1\r\nHost: " + u.Host + "\r\nConnection: close\r\n\r\n")
	c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		return false, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	resumed := false
	if cfg != nil {
		tc := tls.Client(c, cfg)
		if err := tc.Handshake(); err != nil {
			return false, err
		}
		resumed = tc.ConnectionState().DidResume
		c = tc
	}
	if isMQTT {
		return resumed, mqttExchange(c, []byte(*mqttKey))
	}
	if _, err := c.Write(req); err != nil {
		return resumed, err
	}
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return resumed, err
	}
	res.Body.Close()
	if res.StatusCode != 200 {
		return resumed, fmt.Errorf("status %d", res.StatusCode)
	}
	return resumed, nil
}

// mqttExchange is a kettle's session on c: CONNECT as a fresh device with
// its token, the CONNACK (accepted), DISCONNECT.
func mqttExchange(c net.Conn, secret []byte) error {
	id := uuid.New()
	connect := &packets.Connect{ProtocolName: "MQTT", ProtocolVersion: 5, Properties: &packets.Properties{}, ClientID: id.String(), CleanStart: true, KeepAlive: 60,
		UsernameFlag: true, Username: id.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))}
	if _, err := connect.WriteTo(c); err != nil {
		return err
	}
	cp, err := packets.ReadPacket(c)
	if err != nil {
		return fmt.Errorf("connack: %w", err)
	}
	ack, ok := cp.Content.(*packets.Connack)
	if !ok {
		return fmt.Errorf("connack: got packet type %d", cp.Type)
	}
	if ack.ReasonCode != 0 {
		return fmt.Errorf("connect refused: code %d", ack.ReasonCode)
	}
	_, err = (&packets.Disconnect{}).WriteTo(c)
	return err
}

var curveIDs = map[string]tls.CurveID{"X25519": tls.X25519, "CurveP256": tls.CurveP256, "CurveP384": tls.CurveP384, "X25519MLKEM768": tls.X25519MLKEM768}

func prefix() string {
	if *label == "" {
		return ""
	}
	return *label + " "
}

// procCPU is pid's user + system CPU seconds (0 without a pid).
func procCPU(pid int) float64 {
	if pid <= 0 {
		return 0
	}
	p, err := procfs.NewProc(pid)
	if err != nil {
		fail("-pid %d: %v", pid, err)
	}
	st, err := p.Stat()
	if err != nil {
		fail("-pid %d: %v", pid, err)
	}
	return st.CPUTime()
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "tlsstorm: "+format+"\n", args...)
	os.Exit(2)
}
