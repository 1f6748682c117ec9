package sim

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/kettlefleet/kettlefleet/mqttapi"
	"github.com/kettlefleet/kettlefleet/server"
)

// serverConfig is a real kettle serve on :0 with the embedded store in a
// temp dir and a silent log; mqtt with an Addr turns its MQTT listener on.
func serverConfig(t *testing.T, mqtt mqttapi.Config) server.Config {
	dir := t.TempDir()
	return server.Config{
		Addr: "127.0.0.1:0", DB: "sqlite:" + filepath.Join(dir, "k.db"), DataDir: dir,
		MQTT:   mqtt,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// startServer starts serverConfig's server, closed when the test ends.
func startServer(t *testing.T, mqtt mqttapi.Config) *server.Server {
	t.Helper()
	srv, err := server.Start(context.Background(), serverConfig(t, mqtt))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}
