package sim

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// TestValidate: every problem is named by its flag; zero values are
// defaults, not problems.
func TestValidate(t *testing.T) {
	good := func() Config {
		return Config{
			TargetConfig:   TargetConfig{Target: "http://127.0.0.1:8080"},
			FleetConfig:    FleetConfig{Devices: 1},
			ScheduleConfig: ScheduleConfig{Duration: time.Second},
		}
	}
	f := func(change func(*Config), want ...string) {
		t.Helper()
		c := good()
		change(&c)
		errs := c.Validate()
		got := errors.Join(errs...)
		if len(errs) != len(want) {
			t.Errorf("%d problems (%v), want %d %q", len(errs), got, len(want), want)
			return
		}
		for i, w := range want {
			if !strings.Contains(errs[i].Error(), w) {
				t.Errorf("problem %d: %v, want it to name %s", i, errs[i], w)
			}
		}
	}
	f(func(c *Config) {})
	f(func(c *Config) { c.Protocol, c.MQTTTarget = ProtocolMQTT, "127.0.0.1:1883" })
	f(func(c *Config) { c.Target = "http://192.0.2.1:8080" }, "--target")
	f(func(c *Config) { c.Devices, c.Duration = 0, 0 }, "--devices", "--duration")
	f(func(c *Config) { c.API = "v2" }, "--api")
	f(func(c *Config) { c.Protocol = "coap" }, "--protocol")
	f(func(c *Config) { c.Protocol, c.API = ProtocolMQTT, "v0" }, "--protocol mqtt")
	f(func(c *Config) { c.Protocol, c.MQTTInflight = ProtocolMQTT, 1001 }, "--mqtt-inflight")
	f(func(c *Config) { c.Protocol, c.MQTTTarget = ProtocolMQTT, "192.0.2.1:1883" }, "192.0.2.1")
	f(func(c *Config) { c.Batch = 1001 }, "--batch")
}
