package mqttapi

import (
	"fmt"
	"reflect"
	"time"
	"unsafe"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// Housekeeping intervals in place of mochi's one second. Every second mochi
// v2.7.9 copies its whole client map twice, and for each client copies its
// inflight map and allocates a slice (clearExpiredInflights), and checks
// whether its session expired (clearExpiredClients): with 5,000 kettles a
// node spent 12% of its CPU there (pprof, bench/mqtt-fleet.sh), for nothing
// in our use — kettles never have inflight messages (QoS 1 in is
// acknowledged by us, commands go out at QoS 0: doc.go) and a session may
// outlive its expiry by a few seconds.
const (
	clientExpiryEvery   = 15 * time.Second
	inflightExpiryEvery = time.Minute
)

// slowHousekeeping resets mochi's client and inflight expiry tickers. They
// are unexported (Server.loop), and mochi offers no option for them, hence
// reflection; if a mochi upgrade moves them, this fails (a test checks it)
// and the node keeps mochi's one second.
func slowHousekeeping(srv *mqtt.Server) error {
	loop := reflect.ValueOf(srv).Elem().FieldByName("loop")
	if loop.Kind() != reflect.Pointer || loop.IsNil() || loop.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("mochi Server.loop: not a struct pointer (%s)", loop.Kind())
	}
	l := loop.Elem()
	for name, d := range map[string]time.Duration{"clientExpiry": clientExpiryEvery, "inflightExpiry": inflightExpiryEvery} {
		f := l.FieldByName(name)
		if !f.IsValid() || f.Type() != reflect.TypeFor[*time.Ticker]() {
			return fmt.Errorf("mochi Server.loop.%s: not a *time.Ticker", name)
		}
		t := *(**time.Ticker)(unsafe.Pointer(f.UnsafeAddr()))
		if t == nil {
			return fmt.Errorf("mochi Server.loop.%s: nil", name)
		}
		t.Reset(d)
	}
	return nil
}
