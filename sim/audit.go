package sim

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
)

// httpClient talks to the operator API (provisioning, the audit). It is not
// on the load path, so it is plain net/http.
type httpClient struct {
	base, operator string
	c              *http.Client
}

func newHTTPClient(base, operator string, tlsCfg *tls.Config) *httpClient {
	return &httpClient{base: base, operator: operator, c: &http.Client{
		Timeout:   60 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: 32, MaxConnsPerHost: 32, TLSClientConfig: tlsCfg},
	}}
}

// call sends one operator request and decodes a 2xx JSON answer into out,
// retrying 503s (honoring Retry-After) a few times.
func (h *httpClient) call(ctx context.Context, method, path string, body []byte, out any) error {
	for attempt := 0; ; attempt++ {
		req, err := http.NewRequestWithContext(ctx, method, h.base+path, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+h.operator)
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := h.c.Do(req)
		if err != nil {
			return fmt.Errorf("%s %s: %w", method, path, err)
		}
		b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("%s %s: %w", method, path, err)
		}
		if resp.StatusCode == http.StatusServiceUnavailable && attempt < 10 {
			wait := time.Second
			if sec, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && sec > 0 {
				wait = time.Duration(sec) * time.Second
			}
			select {
			case <-time.After(wait):
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if resp.StatusCode/100 != 2 {
			hint := ""
			if resp.StatusCode == 401 || resp.StatusCode == 403 {
				hint = " (check --operator-token / --data-dir)"
			}
			return fmt.Errorf("%s %s: %s%s: %s", method, path, resp.Status, hint, bytes.TrimSpace(b))
		}
		if out != nil {
			if err := json.Unmarshal(b, out); err != nil {
				return fmt.Errorf("%s %s: decode answer: %w", method, path, err)
			}
		}
		return nil
	}
}

type provisionedDevice struct {
	ID    uuid.UUID `json:"id"`
	Token string    `json:"token"`
}

// provision creates n devices through POST /v1/devices, 1000 at a time.
func (h *httpClient) provision(ctx context.Context, n int) ([]provisionedDevice, error) {
	out := make([]provisionedDevice, 0, n)
	for len(out) < n {
		c := min(1000, n-len(out))
		var r struct {
			Devices []provisionedDevice `json:"devices"`
		}
		if err := h.call(ctx, "POST", "/v1/devices", fmt.Appendf(nil, `{"count":%d}`, c), &r); err != nil {
			return nil, fmt.Errorf("provision devices: %w", err)
		}
		if len(r.Devices) != c {
			return nil, fmt.Errorf("provision devices: asked for %d, got %d", c, len(r.Devices))
		}
		out = append(out, r.Devices...)
	}
	return out, nil
}

// history returns the device times (unix µs) stored for one device in
// [from, to), paging through the operator history endpoint.
func (h *httpClient) history(ctx context.Context, id uuid.UUID, from, to time.Time) ([]int64, error) {
	var times []int64
	after := ""
	for {
		q := url.Values{}
		q.Set("from", from.UTC().Format(time.RFC3339Nano))
		q.Set("to", to.UTC().Format(time.RFC3339Nano))
		q.Set("limit", "1000")
		if after != "" {
			q.Set("after", after)
		}
		var page struct {
			Measurements []struct {
				Time time.Time `json:"time"`
			} `json:"measurements"`
			Next string `json:"next"`
		}
		if err := h.call(ctx, "GET", "/v1/devices/"+id.String()+"/measurements?"+q.Encode(), nil, &page); err != nil {
			return nil, err
		}
		for _, m := range page.Measurements {
			times = append(times, m.Time.UnixMicro())
		}
		if page.Next == "" || len(page.Measurements) == 0 {
			return times, nil
		}
		after = page.Next
	}
}

// Compare counts acked readings against stored ones for one device. Both
// are device times in unix µs; acked need not be sorted.
func Compare(acked, stored []int64) (a Audit, examples []int64) {
	slices.Sort(acked)
	acked = slices.Compact(acked) // a reading acked twice (retry after a lost ack) is one reading
	slices.Sort(stored)
	a.Acked = int64(len(acked))
	i, j := 0, 0
	for i < len(acked) || j < len(stored) {
		switch {
		case j >= len(stored) || (i < len(acked) && acked[i] < stored[j]):
			a.Lost++
			examples = append(examples, acked[i])
			i++
		case i >= len(acked) || stored[j] < acked[i]:
			a.Unacked++
			j++
		default:
			t := acked[i]
			a.Stored++
			n := 0
			for j < len(stored) && stored[j] == t {
				n++
				j++
			}
			if n > 1 {
				a.Duplicated++
				examples = append(examples, t)
			}
			i++
		}
	}
	return a, examples
}

// ackLog is a kettle's acknowledged device times (unix µs), kept compact
// for the audit: zigzag varint deltas, about 4 bytes a reading at a 30 s
// cadence instead of 8 (a 200,000-kettle swarm keeps every one for the
// whole run).
type ackLog struct {
	b    []byte
	last int64
}

func (a *ackLog) add(t int64) {
	a.b = binary.AppendVarint(a.b, t-a.last)
	a.last = t
}

// times decodes the log, in the order added.
func (a *ackLog) times() []int64 {
	var out []int64
	var v int64
	for b := a.b; len(b) > 0; {
		d, n := binary.Varint(b)
		if n <= 0 {
			break // cannot happen: add wrote it
		}
		b = b[n:]
		v += d
		out = append(out, v)
	}
	return out
}

// DeviceAcked is one kettle's acknowledged readings: device times, unix µs.
type DeviceAcked struct {
	ID    uuid.UUID `json:"id"`
	Times []int64   `json:"t"`
}

// ackedDevices lists every kettle's acknowledged readings (after the run:
// no writer is left).
func (s *Swarm) ackedDevices() []DeviceAcked {
	out := make([]DeviceAcked, 0, len(s.kettles))
	for i := range s.kettles {
		if k := &s.kettles[i]; len(k.acked.b) > 0 {
			out = append(out, DeviceAcked{ID: k.id, Times: k.acked.times()})
		}
	}
	return out
}

// audit looks every acknowledged reading up in the server.
func (s *Swarm) audit(ctx context.Context) (*Audit, error) {
	return auditDevices(ctx, s.http, s.ackedDevices())
}

// AuditAcked looks every reading in devs up in the server at target through
// its operator API (the lab's controller audits every worker's shard so).
func AuditAcked(ctx context.Context, target, operator string, tlsCfg *tls.Config, devs []DeviceAcked) (*Audit, error) {
	return auditDevices(ctx, newHTTPClient(strings.TrimRight(target, "/"), operator, tlsCfg), devs)
}

// auditDevices compares each device's acknowledged readings with what the
// server stored, 16 devices at a time.
func auditDevices(ctx context.Context, h *httpClient, devs []DeviceAcked) (*Audit, error) {
	start := time.Now()
	total := &Audit{}
	var mu sync.Mutex
	var firstErr error
	idx := make(chan int)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range idx {
				d := &devs[i]
				lo, hi := slices.Min(d.Times), slices.Max(d.Times)
				stored, err := h.history(ctx, d.ID, time.UnixMicro(lo), time.UnixMicro(hi+1))
				mu.Lock()
				if err != nil {
					if firstErr == nil {
						firstErr = fmt.Errorf("device %s: %w", d.ID, err)
					}
					mu.Unlock()
					continue
				}
				a, ex := Compare(d.Times, stored)
				total.Devices++
				total.Acked += a.Acked
				total.Stored += a.Stored
				total.Lost += a.Lost
				total.Duplicated += a.Duplicated
				total.Unacked += a.Unacked
				for _, t := range ex {
					if len(total.Examples) < 10 {
						total.Examples = append(total.Examples, d.ID.String()+" "+time.UnixMicro(t).UTC().Format(time.RFC3339Nano))
					}
				}
				mu.Unlock()
			}
		}()
	}
	for i := range devs {
		if len(devs[i].Times) == 0 {
			continue
		}
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed || ctx.Err() != nil {
			break
		}
		idx <- i
	}
	close(idx)
	wg.Wait()
	total.Seconds = time.Since(start).Seconds()
	if firstErr != nil {
		return total, firstErr
	}
	return total, ctx.Err()
}
