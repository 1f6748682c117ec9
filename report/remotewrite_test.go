package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/internal/testkit"
)

// TestRemoteWriteToPrometheus pushes the recorded run's per-second series
// to a real Prometheus (Debian's, make deps) with its remote-write
// receiver on, then queries them back: every series arrives with its
// labels, every second's value and timestamp as the report has them.
func TestRemoteWriteToPrometheus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Prometheus; run without -short")
	}
	bin := testkit.Tool(t, "prometheus", "prometheus")
	r := loadRecorded(t)
	// Samples are accepted into Prometheus' head block only, so the run is
	// moved to a few minutes ago.
	shift := time.Now().Add(-5 * time.Minute).Truncate(time.Second).Sub(r.Start)
	r.Start, r.End = r.Start.Add(shift), r.End.Add(shift)
	if r.System != nil {
		for i := range r.System.Samples {
			r.System.Samples[i].Time = r.System.Samples[i].Time.Add(shift)
		}
	}
	s, err := Build(r, Options{})
	if err != nil {
		t.Fatal(err)
	}

	addr := testkit.FreeAddr(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := writeFile(cfg, "global: {scrape_interval: 1m}\n"); err != nil {
		t.Fatal(err)
	}
	testkit.Start(t, bin, "--config.file="+cfg, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--web.enable-remote-write-receiver", "--log.level=warn")
	base := "http://" + addr
	testkit.WaitFor(t, "Prometheus ready", 30*time.Second, func() bool { return testkit.Answers200(nil, base+"/-/ready") })

	series := s.RemoteSeries(map[string]string{"build": "test"})
	want := 0
	for _, rs := range series {
		want += len(rs.Samples)
	}
	n, err := RemoteWrite(t.Context(), nil, base+"/api/v1/write", series)
	if err != nil {
		t.Fatal(err)
	}
	if n != want || n < 1000 {
		t.Fatalf("pushed %d samples, want %d (≥ 1000)", n, want)
	}

	// Every series, every sample, read back as one range vector over the
	// run's window.
	last := s.Series.T[len(s.Series.T)-1]
	at := s.Start.Add(time.Duration(last) * time.Second)
	q := fmt.Sprintf(`{job="kettle-swarm",build="test"}[%ds]`, last+5)
	resp, err := http.Get(base + "/api/v1/query?" + url.Values{"query": {q}, "time": {strconv.FormatInt(at.Unix(), 10)}}.Encode())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Status, Error string
		Data          struct {
			Result []struct {
				Metric map[string]string
				Values [][2]any
			}
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || body.Status != "success" {
		t.Fatalf("%s: %v %+v", q, err, body)
	}
	got := map[string][][2]any{}
	for _, res := range body.Data.Result {
		got[fmt.Sprint(res.Metric)] = res.Values
	}
	if len(got) != len(series) {
		t.Errorf("%d series in Prometheus, %d pushed", len(got), len(series))
	}
	for _, rs := range series {
		vs, ok := got[fmt.Sprint(rs.Labels)]
		if !ok {
			t.Errorf("series %v not in Prometheus", rs.Labels)
			continue
		}
		if len(vs) != len(rs.Samples) {
			t.Errorf("%v: %d samples in Prometheus, %d pushed", rs.Labels, len(vs), len(rs.Samples))
			continue
		}
		for i, smp := range rs.Samples {
			ts, _ := vs[i][0].(float64)
			v, _ := strconv.ParseFloat(fmt.Sprint(vs[i][1]), 64)
			if int64(ts*1000) != smp.T.UnixMilli() || math.Abs(v-smp.V) > 1e-9*math.Max(1, math.Abs(smp.V)) {
				t.Errorf("%v sample %d: (%v, %v) in Prometheus, (%v, %v) pushed", rs.Labels, i, ts, v, smp.T.Unix(), smp.V)
				break
			}
		}
	}
	// One figure by name: the measurement p99 of a second, as the report has it.
	p99 := s.Series.Endpoints["measurement"].Latency["p99"]
	var found bool
	for _, rs := range series {
		if rs.Labels["__name__"] == "kettle_run_latency_seconds" && rs.Labels["endpoint"] == "measurement" && rs.Labels["quantile"] == "0.99" {
			found = true
			byT := map[int64]float64{}
			for _, smp := range rs.Samples {
				byT[smp.T.Unix()] = smp.V
			}
			for i, tt := range s.Series.T {
				v, ok := byT[s.Start.Add(time.Duration(tt)*time.Second).Unix()]
				if math.IsNaN(float64(p99[i])) == ok || ok && math.Abs(v-float64(p99[i])/1000) > 1e-12 {
					t.Errorf("second %d: %v s pushed (%v), %v ms in the report", tt, v, ok, p99[i])
				}
			}
		}
	}
	if !found {
		t.Error("no measurement p99 series")
	}
}

func writeFile(path, s string) error {
	return os.WriteFile(path, []byte(s), 0o644)
}

// TestRemoteWriteRefused: a receiver's 4xx is an error that says so, not
// retried.
func TestRemoteWriteRefused(t *testing.T) {
	var calls int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		http.Error(w, "out of bounds", http.StatusBadRequest)
	}))
	defer srv.Close()
	_, err := RemoteWrite(t.Context(), nil, srv.URL+"/api/v1/write", []RWSeries{{Labels: map[string]string{"__name__": "x"}, Samples: []RWSample{{T: time.Now(), V: 1}}}})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("400")) || calls != 1 {
		t.Fatalf("err %v after %d calls", err, calls)
	}
}
