package mqttapi_test

import (
	"bytes"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestConnectionMemory holds N real kettle connections (CONNECT, SUBSCRIBE to
// the command topic, command received) and measures what the process holds
// per connection: Go heap + goroutine stacks, and RSS. The client side is
// bare sockets in the same process (a few hundred bytes each), so the figure
// slightly overstates the server's cost. MQTT_MEM_CONNS sets N (default 5000,
// 500 under -race, whose goroutine limit is 8128).
func TestConnectionMemory(t *testing.T) {
	n := 5000
	if raceEnabled {
		n = 500
	}
	if s := os.Getenv("MQTT_MEM_CONNS"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	e := start(t, fleet.Config{})
	before := memNow()

	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	var failed sync.Once
	for i := range conns {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := connectAndSubscribe(e.broker.Addr())
			if err != nil {
				failed.Do(func() { t.Errorf("connection %d: %v", i, err) })
				return
			}
			conns[i] = c
		}()
	}
	wg.Wait()
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}()
	if t.Failed() {
		return
	}
	for deadline := time.Now().Add(10 * time.Second); e.broker.Counters().Connections.Load() < int64(n) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	after := memNow()
	// Signed: with no goroutine per idle connection, the stacks in use may
	// end below where they began.
	heap := float64(int64(after.heap)-int64(before.heap)) / float64(n)
	stack := float64(int64(after.stack)-int64(before.stack)) / float64(n)
	rss := float64(int64(after.rss)-int64(before.rss)) / float64(n)
	t.Logf("%d connections: %.0f B heap + %.0f B stacks per connection (%.1f KiB), RSS %.1f KiB per connection; "+
		"goroutines %d → %d; extrapolated to 100,000 kettles: %.0f MiB Go memory, %.0f MiB RSS",
		n, heap, stack, (heap+stack)/1024, rss/1024, before.goroutines, after.goroutines,
		(heap+stack)*100_000/(1<<20), rss*100_000/(1<<20))
	if got := e.broker.Counters().Connections.Load(); got != int64(n) {
		t.Errorf("Connections = %d, want %d", got, n)
	}
	// On Linux the listener holds a quiet kettle in its poller, with no
	// goroutine of its own (poll_linux.go).
	if runtime.GOOS == "linux" && after.goroutines-before.goroutines > n/10 {
		t.Errorf("goroutines %d → %d with %d quiet kettles connected: want no goroutine per connection", before.goroutines, after.goroutines, n)
	}
	budget := 8 << 10 // a million kettles in 8 GiB
	if per := heap + stack; per > float64(budget) {
		t.Errorf("%.0f B per connection: over the %d KiB budget", per, budget>>10)
	}
}

type mem struct {
	heap, stack, rss uint64
	goroutines       int
}

func memNow() mem {
	for range 6 { // stacks shrink by half per GC cycle when mostly unused
		runtime.GC()
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	m := mem{heap: ms.HeapInuse, stack: ms.StackInuse, goroutines: runtime.NumGoroutine()}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseUint(f[1], 10, 64)
				m.rss = kb << 10
			}
		}
	}
	return m
}

// connectAndSubscribe is a minimal 3.1.1 kettle: bare socket, no buffers
// kept.
func connectAndSubscribe(addr string) (net.Conn, error) { return connectAs(addr, uuid.New()) }

// connectAs is connectAndSubscribe as device id.
func connectAs(addr string, id uuid.UUID) (net.Conn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 4}
	pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 300, ClientIdentifier: id.String(),
		UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken(secret, id))}
	pk.ConnectEncode(&buf)
	sub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, ProtocolVersion: 4, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: mqttapi.CommandTopic(id), Qos: 0}}}
	want := 4
	if os.Getenv("MQTT_MEM_NOSUB") == "" {
		sub.SubscribeEncode(&buf)
		want += 5 + 100
	}
	if _, err := c.Write(buf.Bytes()); err != nil {
		c.Close()
		return nil, err
	}
	// CONNACK (4 bytes) + SUBACK (5) + the command publish (> 100).
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	got := 0
	p := make([]byte, 512)
	for got < want {
		k, err := c.Read(p)
		if err != nil {
			c.Close()
			return nil, err
		}
		if got == 0 && (p[0] != 0x20 || p[3] != 0) {
			c.Close()
			return nil, &net.OpError{Op: "connack", Err: os.ErrPermission}
		}
		got += k
	}
	c.SetReadDeadline(time.Time{})
	return c, nil
}
