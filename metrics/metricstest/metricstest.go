// Package metricstest starts an instrumented kettle serve for the metrics and
// deploy tests and drives real HTTP traffic at it, recorded on a
// metrics.Swarm as kettle swarm records its own.
//
// Start runs the real server.Start, exactly as kettle serve does.
package metricstest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kettle "github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/fleet"
	"github.com/kettlefleet/kettlefleet/metrics"
	"github.com/kettlefleet/kettlefleet/server"
)

// Operator and Secret are the test server's credentials.
const (
	Operator = "test-operator-token"
	Secret   = "test-secret-0123456789"
)

// Kettle is a running instrumented server.
type Kettle struct {
	URL     string // base URL of the API; metrics at URL+"/metrics"
	Metrics *metrics.Server
	Service *fleet.Service
}

// Start starts a real kettle serve (server.Start) on 127.0.0.1:0 with a
// SQLite store in t.TempDir(), stopped by t.Cleanup. queueRows sizes the
// ingest queue (0: default).
func Start(t testing.TB, queueRows int) *Kettle {
	t.Helper()
	dir := t.TempDir()
	srv, err := server.Start(context.Background(), server.Config{
		Addr:          "127.0.0.1:0",
		DB:            "sqlite:" + filepath.Join(dir, "k.db"),
		DataDir:       dir,
		OperatorToken: Operator,
		Secret:        Secret,
		Ingest:        fleet.Config{QueueRows: queueRows},
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &Kettle{URL: srv.URL(), Metrics: srv.Metrics(), Service: srv.Service()}
}

// Client drives traffic at a kettle serve and records it on a Swarm.
type Client struct {
	Base  string
	Swarm *metrics.Swarm // nil: not recorded
	HTTP  *http.Client
	// Devices and their v1 tokens, after Register.
	Devices []kettle.DeviceID
	Tokens  []string
	seq     atomic.Int64
}

// Do sends one request for endpoint ep (a swarm endpoint name) and returns
// the status (0 on a transport error).
func (c *Client) Do(ep, method, path, token string, body any) (int, []byte) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.Base+path, rd)
	if err != nil {
		panic(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.Swarm != nil {
		c.Swarm.Offered(ep)
	}
	start := time.Now()
	resp, err := c.HTTP.Do(req)
	if err != nil {
		if c.Swarm != nil {
			c.Swarm.Error(ep, "conn")
		}
		return 0, nil
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if c.Swarm != nil {
		c.Swarm.Completed(ep, resp.StatusCode, time.Since(start))
		if resp.StatusCode/100 != 2 && resp.StatusCode != 304 {
			c.Swarm.Error(ep, fmt.Sprintf("http_%d", resp.StatusCode))
		}
	}
	return resp.StatusCode, b
}

// Register creates n devices through POST /v1/devices.
func (c *Client) Register(n int) error {
	st, b := c.Do("other", "POST", "/v1/devices", Operator, map[string]int{"count": n})
	if st != http.StatusCreated {
		return fmt.Errorf("POST /v1/devices: %d %s", st, b)
	}
	var out struct {
		Devices []struct {
			ID    kettle.DeviceID `json:"id"`
			Token string          `json:"token"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return err
	}
	for _, d := range out.Devices {
		c.Devices = append(c.Devices, d.ID)
		c.Tokens = append(c.Tokens, d.Token)
	}
	return nil
}

// Reading is a valid v1 reading at t.
func Reading(t time.Time, level float64) map[string]any {
	return map[string]any{
		"time": t.UTC().Format(time.RFC3339Nano), "battery_charge_mwh": 500.0, "battery_full_mwh": 1000.0,
		"battery_rate_mw": 2.5, "ambient_temp_c": 21.0, "water_temp_c": 80.0, "water_level_ml": level,
	}
}

// Round sends, for every device, one reading, one command poll and one
// device read, plus statistics, a 404, a 400, a case-study login and poll,
// and one batch larger than queueRows (a 503 queue_full) when queueRows > 0.
// It returns the statuses seen by route kind, for assertions.
func (c *Client) Round(queueRows int) map[string]int {
	seen := map[string]int{}
	var mu sync.Mutex
	note := func(k string, st int) { mu.Lock(); seen[fmt.Sprintf("%s %d", k, st)]++; mu.Unlock() }
	var wg sync.WaitGroup
	for i := range c.Devices {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, tok := c.Devices[i], c.Tokens[i]
			at := time.Now().Add(-time.Hour).Add(time.Duration(c.seq.Add(1)) * time.Millisecond)
			st, _ := c.Do("measurement", "POST", "/v1/measurements", tok, Reading(at, 900))
			note("measurement", st)
			st, _ = c.Do("command", "GET", "/v1/command", tok, nil)
			note("command", st)
			st, _ = c.Do("other", "GET", "/v1/devices/"+id.String(), Operator, nil)
			note("device", st)
		}()
	}
	wg.Wait()
	st, _ := c.Do("statistics", "GET", "/v1/statistics", Operator, nil)
	note("statistics", st)
	st, _ = c.Do("other", "GET", "/v1/devices/"+kettle.DeviceID{}.String()+"/nope", Operator, nil)
	note("notfound", st)
	st, _ = c.Do("measurement", "POST", "/v1/measurements", c.Tokens[0], map[string]any{"water_level_ml": -3})
	note("invalid", st)
	st, b := c.Do("login", "POST", "/login", "", map[string]string{"username": "x"})
	note("login", st)
	var login struct{ Username string }
	if json.Unmarshal(b, &login) == nil && login.Username != "" {
		req, _ := http.NewRequest("GET", c.Base+"/command", nil)
		req.Header.Set("servant-auth-cookie", login.Username)
		if resp, err := c.HTTP.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			note("v0command", resp.StatusCode)
		}
	}
	if queueRows > 0 {
		batch := make([]map[string]any, queueRows+1)
		base := time.Now().Add(-2 * time.Hour).Add(time.Duration(c.seq.Add(int64(len(batch)))) * time.Millisecond)
		for i := range batch {
			batch[i] = Reading(base.Add(time.Duration(i)*time.Microsecond), 500)
		}
		st, _ = c.Do("measurement", "POST", "/v1/measurements", c.Tokens[0], batch)
		note("overflow", st)
	}
	return seen
}
