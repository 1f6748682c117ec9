package mqttapi

import (
	"io"
	"log/slog"
	"testing"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// TestSlowHousekeeping: the reflection into mochi still finds its tickers
// (it would silently keep the one-second scans after an upgrade).
func TestSlowHousekeeping(t *testing.T) {
	srv := mqtt.New(&mqtt.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer srv.Close()
	if err := slowHousekeeping(srv); err != nil {
		t.Fatal(err)
	}
}
