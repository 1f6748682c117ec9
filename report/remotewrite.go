package report

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/klauspost/compress/snappy"
	"google.golang.org/protobuf/encoding/protowire"
)

// Prometheus remote write (protocol 1.0): a snappy-compressed protobuf
// WriteRequest POSTed to the receiver. The four messages it needs are
// encoded here with protowire (google.golang.org/protobuf, already a
// dependency) rather than importing prometheus/prometheus's prompb, whose
// module brings the whole Prometheus server's dependency graph:
//
//	message WriteRequest { repeated TimeSeries timeseries = 1; }
//	message TimeSeries   { repeated Label labels = 1; repeated Sample samples = 2; }
//	message Label        { string name = 1; string value = 2; }
//	message Sample       { double value = 1; int64 timestamp = 2; } // ms since the epoch

// RWSeries is one series to push: its labels (with __name__) and one
// value per second of the run.
type RWSeries struct {
	Labels  map[string]string
	Samples []RWSample
}

// RWSample is one value at a time.
type RWSample struct {
	T time.Time
	V float64
}

// maxSamplesPerRequest bounds one remote-write request (Prometheus' own
// sender sends 2,000 a request by default; a run's series are sent whole).
const maxSamplesPerRequest = 10_000

// RemoteSeries are the per-second series of a report as remote-write
// series, labelled job="kettle-swarm" and run=the run's start (RFC 3339)
// plus extra: latency percentiles, offered and completed requests per
// endpoint, status codes, error kinds, kettles, requests in flight, the
// simulator's lag, CPU (cores) and resident memory per sampled process.
// Seconds not measured are left out.
func (s *Summary) RemoteSeries(extra map[string]string) []RWSeries {
	se := s.Series
	var out []RWSeries
	add := func(name string, xs []Num, scale float64, kv ...string) {
		l := map[string]string{"__name__": name, "job": "kettle-swarm", "run": s.Start.UTC().Format(time.RFC3339)}
		for k, v := range extra {
			l[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			l[kv[i]] = kv[i+1]
		}
		rs := RWSeries{Labels: l}
		for i, x := range xs {
			if i < len(se.T) && !math.IsNaN(float64(x)) {
				rs.Samples = append(rs.Samples, RWSample{T: s.Start.Add(time.Duration(se.T[i]) * time.Second), V: float64(x) * scale})
			}
		}
		if len(rs.Samples) > 0 {
			out = append(out, rs)
		}
	}
	quantile := map[string]string{"p50": "0.5", "p95": "0.95", "p99": "0.99", "p99.9": "0.999", "max": "1"}
	for _, ep := range sortedKeys(se.Endpoints) {
		e := se.Endpoints[ep]
		for _, p := range Percentiles {
			add("kettle_run_latency_seconds", e.Latency[p], 1e-3, "endpoint", ep, "quantile", quantile[p])
		}
		add("kettle_run_offered_per_second", e.Offered, 1, "endpoint", ep)
		add("kettle_run_completed_per_second", e.Completed, 1, "endpoint", ep)
	}
	for _, code := range sortedKeys(se.Status) {
		add("kettle_run_status_per_second", se.Status[code], 1, "code", code)
	}
	for _, kind := range sortedKeys(se.ErrorKind) {
		add("kettle_run_errors_per_second", se.ErrorKind[kind], 1, "kind", kind)
	}
	add("kettle_run_kettles", se.Kettles, 1)
	add("kettle_run_in_flight", se.InFlight, 1)
	add("kettle_run_lag_seconds", se.LagMs, 1e-3)
	add("kettle_run_late_starts_per_second", se.Late, 1)
	for _, role := range sortedKeys(se.CPU) {
		add("kettle_run_cpu_cores", se.CPU[role], 0.01, "role", role)
	}
	for _, role := range sortedKeys(se.RSSMiB) {
		add("kettle_run_memory_bytes", se.RSSMiB[role], 1<<20, "role", role)
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// encodeWriteRequest is the protobuf WriteRequest of series.
func encodeWriteRequest(series []RWSeries) []byte {
	var b, ts, msg []byte
	for _, s := range series {
		ts = ts[:0]
		for _, k := range sortedKeys(s.Labels) { // Prometheus wants labels sorted by name
			msg = protowire.AppendTag(msg[:0], 1, protowire.BytesType)
			msg = protowire.AppendString(msg, k)
			msg = protowire.AppendTag(msg, 2, protowire.BytesType)
			msg = protowire.AppendString(msg, s.Labels[k])
			ts = protowire.AppendTag(ts, 1, protowire.BytesType)
			ts = protowire.AppendBytes(ts, msg)
		}
		for _, smp := range s.Samples {
			msg = protowire.AppendTag(msg[:0], 1, protowire.Fixed64Type)
			msg = protowire.AppendFixed64(msg, math.Float64bits(smp.V))
			msg = protowire.AppendTag(msg, 2, protowire.VarintType)
			msg = protowire.AppendVarint(msg, uint64(smp.T.UnixMilli()))
			ts = protowire.AppendTag(ts, 2, protowire.BytesType)
			ts = protowire.AppendBytes(ts, msg)
		}
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, ts)
	}
	return b
}

// RemoteWrite pushes series to a Prometheus remote-write receiver (e.g.
// prometheus --web.enable-remote-write-receiver: URL
// http://HOST:9090/api/v1/write), in requests of at most
// maxSamplesPerRequest samples. A 5xx or a transport error is retried
// (3 attempts, 1 s apart); a 4xx is not (Prometheus answers 400 to samples
// older than its head block, about an hour, unless its TSDB allows
// out-of-order samples). It returns the samples pushed.
func RemoteWrite(ctx context.Context, client *http.Client, url string, series []RWSeries) (int, error) {
	if client == nil {
		client = &http.Client{Timeout: 30 * time.Second}
	}
	sent := 0
	for len(series) > 0 {
		n, k := 0, 0
		for k < len(series) && (k == 0 || n+len(series[k].Samples) <= maxSamplesPerRequest) {
			n += len(series[k].Samples)
			k++
		}
		body := snappy.Encode(nil, encodeWriteRequest(series[:k]))
		if err := postWrite(ctx, client, url, body); err != nil {
			return sent, fmt.Errorf("remote write to %s (%d samples sent before): %w", url, sent, err)
		}
		sent += n
		series = series[k:]
	}
	return sent, nil
}

func postWrite(ctx context.Context, client *http.Client, url string, body []byte) error {
	var last error
	for attempt := range 3 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Second):
			}
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Encoding", "snappy")
		req.Header.Set("Content-Type", "application/x-protobuf")
		req.Header.Set("X-Prometheus-Remote-Write-Version", "0.1.0")
		req.Header.Set("User-Agent", "kettle")
		resp, err := client.Do(req)
		if err != nil {
			last = err
			continue
		}
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		switch {
		case resp.StatusCode/100 == 2:
			return nil
		case resp.StatusCode/100 == 5:
			last = fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
			continue
		}
		return fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	return last
}

// ParseLabels reads "k=v,k=v" (the --remote-write-label flag).
func ParseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || !validLabel(k) {
			return nil, fmt.Errorf("label %q: want NAME=VALUE, NAME of letters, digits and _ (not starting with a digit or __)", kv)
		}
		out[k] = v
	}
	return out, nil
}

func validLabel(k string) bool {
	if strings.HasPrefix(k, "__") {
		return false
	}
	for i, r := range k {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || i > 0 && r >= '0' && r <= '9') {
			return false
		}
	}
	return true
}
