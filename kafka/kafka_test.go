package kafka_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/server"
)

// The suite's brokers: deploy/kafka's three nodes, on the test port (not
// make chaos's 9092) so both can run on one machine.
var cluster *kafkatest.Cluster

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run()) // the suite below skips itself; unit tests run
	}
	dir, err := os.MkdirTemp("", "kettle-kafka-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	start := time.Now()
	cluster, err = kafkatest.Start(dir, kafkatest.Options{Port: 19092})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "kafka: 3 nodes up in %s\n", time.Since(start).Round(100*time.Millisecond))
	code := pgtest.Run(m)
	if err := cluster.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func needKafka(t *testing.T) {
	t.Helper()
	if cluster == nil {
		t.Skip("-short: the Kafka suite starts three brokers")
	}
}

var topicSeq atomic.Int64

// topic is a fresh topic name per test: tests share the brokers, not data.
func topic(t *testing.T) string {
	return fmt.Sprintf("kettle.test.%d.%d", os.Getpid(), topicSeq.Add(1))
}

func logger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func baseConfig(t *testing.T, dsn, topic string) server.Config {
	return server.Config{Addr: "127.0.0.1:0", DB: dsn, DataDir: t.TempDir(), Secret: "suite-secret-0123456789", OperatorToken: "suite-operator-0123456789",
		Logger: logger(), Log: server.LogConfig{URL: cluster.URL(topic), Partitions: 4, Group: "kettle-writers-" + topic, MonitorEvery: 300 * time.Millisecond}}
}

// as makes cfg reach the brokers as user (kafkatest.Front or Writer).
func as(cfg *server.Config, user string) {
	a := cluster.Auth(user)
	cfg.Log.CA, cfg.Log.User, cfg.Log.Password = a.CA, a.User, a.Password
}

func startFront(t *testing.T, dsn, topic string, mod ...func(*server.Config)) *server.Server {
	t.Helper()
	cfg := baseConfig(t, dsn, topic)
	as(&cfg, kafkatest.Front)
	for _, m := range mod {
		m(&cfg)
	}
	srv, err := server.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("start front: %v", err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

func startWriter(t *testing.T, dsn, topic string) *server.Writer {
	t.Helper()
	cfg := baseConfig(t, dsn, topic)
	as(&cfg, kafkatest.Writer)
	w, err := server.StartWriter(context.Background(), cfg)
	if err != nil {
		t.Fatalf("start writer: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

func reading(at time.Time, level float64) string {
	return fmt.Sprintf(`{"time":%q,"battery_charge_mwh":50,"battery_full_mwh":100,"battery_rate_mw":1,"ambient_temp_c":20,"water_temp_c":70,"water_level_ml":%v}`,
		at.UTC().Format(time.RFC3339), level)
}

// upload posts a v1 body as device id and returns the status and body.
func upload(t *testing.T, base string, id uuid.UUID, body string) (int, string, http.Header) {
	t.Helper()
	req, _ := http.NewRequest("POST", base+"/v1/measurements", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+kettle.DeviceToken([]byte("suite-secret-0123456789"), id))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("upload: %v", err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b), res.Header
}

// endOffsets sums the topic's end offsets: the records the log holds.
func endOffsets(t *testing.T, topic string) int64 {
	t.Helper()
	ctx, adm, done := admin(t)
	defer done()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	return n
}

// admin is an admin client of the suite's brokers and a 10 s context;
// done releases both.
func admin(t *testing.T) (context.Context, *kadm.Client, func()) {
	t.Helper()
	cl, err := cluster.Client(kafkatest.Admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	return ctx, kadm.NewClient(cl), func() { cancel(); cl.Close() }
}

// readAll reads every record of topic up to its end (a reader outside the
// group, as a data team's consumer would).
func readAll(t *testing.T, topic string, want int) []*kgo.Record {
	t.Helper()
	cl, err := cluster.Client(kafkatest.Admin, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < want && ctx.Err() == nil {
		out = append(out, cl.PollFetches(ctx).Records()...)
	}
	return out
}

func stats(t *testing.T, st kettle.Store) kettle.Statistics {
	t.Helper()
	s, err := st.Statistics(context.Background(), kettle.StatsQuery{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func hourCount(s kettle.Statistics) (n int64) {
	for _, h := range s.ByHour {
		n += h.Water.N
	}
	return n
}

// TestAckAfterLog: with --log and no writer, a v1 upload, a case-study
// upload and an MQTT QoS 1 publish are acknowledged once the log holds
// them — the records are readable (below the high watermark, so on every
// in-sync replica) the moment the 2xx/PUBACK arrives — and the store holds
// none of them yet. A bad reading is 400 and nothing is produced.
func TestAckAfterLog(t *testing.T) {
	needKafka(t)
	tp := topic(t)
	dsn := pgtest.Start(t)
	srv := startFront(t, dsn, tp, func(c *server.Config) { c.MQTT.Addr = "127.0.0.1:0" })
	at := time.Now().Add(-time.Minute).Truncate(time.Second)

	id := uuid.New()
	if st, body, _ := upload(t, srv.URL(), id, "["+reading(at, 500)+","+reading(at.Add(time.Second), 510)+"]"); st != 200 {
		t.Fatalf("v1 upload: %d %s", st, body)
	}
	if n := endOffsets(t, tp); n != 1 {
		t.Fatalf("after the v1 200 the log holds %d records, want 1 (one record per upload of one device)", n)
	}

	// case-study protocol
	res, err := http.Post(srv.URL()+"/login", "application/json", strings.NewReader(`{"username":"kettle"}`))
	if err != nil {
		t.Fatal(err)
	}
	var login struct{ Username string }
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	fmt.Sscanf(strings.TrimPrefix(string(b), `{"username":`), "%q", &login.Username)
	if _, err := uuid.Parse(login.Username); err != nil {
		t.Fatalf("login: %s", b)
	}
	req, _ := http.NewRequest("POST", srv.URL()+"/measurement", strings.NewReader(
		fmt.Sprintf(`{"time":%q,"charge_now":40,"charge_full":100,"charge_rate":-2,"ambient_temp":21,"water_temp":80,"water_level":700}`, at.UTC().Format(time.RFC3339))))
	req.Header.Set("servant-auth-cookie", login.Username)
	res, err = http.DefaultClient.Do(req)
	if err != nil || res.StatusCode != 200 {
		t.Fatalf("v0 upload: %v %v", err, res)
	}
	res.Body.Close()
	if n := endOffsets(t, tp); n != 2 {
		t.Fatalf("after the v0 200 the log holds %d records, want 2", n)
	}

	// MQTT, QoS 1
	mid := uuid.New()
	conn, err := net.Dial("tcp", srv.MQTTAddr())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	cl := paho.NewClient(paho.ClientConfig{Conn: conn, ClientID: mid.String()})
	if ca, err := cl.Connect(ctx, &paho.Connect{ClientID: mid.String(), CleanStart: true, KeepAlive: 30,
		UsernameFlag: true, Username: mid.String(), PasswordFlag: true, Password: []byte(kettle.DeviceToken([]byte("suite-secret-0123456789"), mid))}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("MQTT connect: %v %+v", err, ca)
	}
	defer cl.Disconnect(&paho.Disconnect{})
	pr, err := cl.Publish(ctx, &paho.Publish{Topic: "kettles/" + mid.String() + "/measurements", QoS: 1, Payload: []byte(reading(at, 300))})
	if err != nil || pr.ReasonCode != 0 {
		t.Fatalf("publish: %v %+v", err, pr)
	}
	if n := endOffsets(t, tp); n != 3 {
		t.Fatalf("after the PUBACK the log holds %d records, want 3", n)
	}

	// 400 before anything is produced
	if st, body, _ := upload(t, srv.URL(), id, "["+reading(at, -3)+"]"); st != 400 || !strings.Contains(body, "water_level_ml") {
		t.Fatalf("bad reading: %d %s, want 400 naming water_level_ml", st, body)
	}
	if n := endOffsets(t, tp); n != 3 {
		t.Fatalf("after a 400 the log holds %d records, want still 3", n)
	}

	// the topic interface: key, headers, versioned value
	recs := readAll(t, tp, 3)
	keys := map[string]bool{}
	for _, r := range recs {
		keys[string(r.Key)] = true
		ms, _, err := kafka.Decode(r, nil)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if ms[0].Device.String() != string(r.Key) {
			t.Errorf("record key %s, value device %s", r.Key, ms[0].Device)
		}
	}
	for _, want := range []string{id.String(), login.Username, mid.String()} {
		if !keys[want] {
			t.Errorf("no record keyed %s among %v", want, keys)
		}
	}
	if s := stats(t, srv.Store()); s.MeasurementCount != 0 {
		t.Errorf("without a writer the store holds %d measurements, want 0", s.MeasurementCount)
	}
	// The front that took the upload answers its poll from it at once.
	if c, _ := srv.Service().Command(id); strings.Contains(c.Reason, "no reading") {
		t.Errorf("command after the ack ignores the reading: %+v", c)
	}

	// Past the in-flight bound: 503 + Retry-After at once, nothing produced.
	small := startFront(t, dsn, tp, func(c *server.Config) { c.Log.MaxInflight = 1 })
	st, body, h := upload(t, small.URL(), id, "["+reading(at.Add(time.Hour), 1)+","+reading(at.Add(time.Hour+time.Second), 2)+"]")
	if st != 503 || h.Get("Retry-After") == "" || !strings.Contains(body, "--log-max-inflight") {
		t.Errorf("2 readings past a bound of 1: %d %q (Retry-After %q), want 503 naming --log-max-inflight", st, body, h.Get("Retry-After"))
	}
	if n := endOffsets(t, tp); n != 3 {
		t.Errorf("after the 503 the log holds %d records, want still 3", n)
	}
}

// TestWriterReplayAndRebalance: writers store what the log holds, once.
// Readings from 40 devices go through a front while a first writer runs,
// a second joins (rebalance) and the first leaves (rebalance); then the
// group's offsets are set back to the start and a writer replays the whole
// topic: the store and the statistics count every reading exactly once,
// and the replay is counted as duplicates.
func TestWriterReplayAndRebalance(t *testing.T) {
	needKafka(t)
	tp := topic(t)
	dsn := pgtest.Start(t)
	front := startFront(t, dsn, tp)
	w1 := startWriter(t, dsn, tp)
	devices := make([]uuid.UUID, 40)
	for i := range devices {
		devices[i] = uuid.New()
	}
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	sent := 0
	send := func(round int) {
		for _, id := range devices {
			body := "[" + reading(base.Add(time.Duration(2*round)*time.Second), float64(100+round)) + "," + reading(base.Add(time.Duration(2*round+1)*time.Second), float64(101+round)) + "]"
			if st, b, _ := upload(t, front.URL(), id, body); st != 200 {
				t.Fatalf("upload: %d %s", st, b)
			}
			sent += 2
		}
	}
	send(0)
	send(1)
	w2 := startWriter(t, dsn, tp) // joins: the partitions are shared
	send(2)
	send(3)
	w1.Close() // leaves: w2 takes every partition
	send(4)
	st := front.Store()
	testkit.WaitFor(t, "writers store every acknowledged reading", 30*time.Second, func() bool { return stats(t, st).MeasurementCount == int64(sent) })
	s := stats(t, st)
	if s.MeasurementCount != int64(sent) || hourCount(s) != int64(sent) {
		t.Fatalf("stored %d, by-hour statistics count %d; want %d each", s.MeasurementCount, hourCount(s), sent)
	}
	if b2, _, _ := w2.Log().Stats(); b2 == 0 {
		t.Errorf("the second writer committed no batch: the partitions were not shared")
	}
	w2.Close()

	// Replay: the group's offsets back to the start, as after a writer
	// that stored everything but died before committing its offsets.
	cl, err := cluster.Client(kafkatest.Admin)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	starts, err := adm.ListStartOffsets(ctx, tp)
	if err != nil {
		t.Fatal(err)
	}
	if err := adm.CommitAllOffsets(ctx, "kettle-writers-"+tp, starts.Offsets()); err != nil {
		t.Fatalf("reset offsets: %v", err)
	}
	w3 := startWriter(t, dsn, tp)
	var dups float64
	testkit.WaitFor(t, "the replay reaches the end of the topic", 30*time.Second, func() bool {
		dups = metricValue(t, w3.URL(), "kettle_log_writer_duplicates_total")
		return dups >= float64(sent)
	})
	s = stats(t, st)
	if s.MeasurementCount != int64(sent) || hourCount(s) != int64(sent) || dups != float64(sent) {
		t.Fatalf("after the replay: stored %d, by-hour %d, duplicates %v; want %d, %d, %d", s.MeasurementCount, hourCount(s), dups, sent, sent, sent)
	}
	var level float64
	for _, id := range devices {
		d, err := st.Device(ctx, id)
		if err != nil || d.Measurements != 10 || d.Latest == nil {
			t.Fatalf("device %s: %+v %v, want 10 measurements", id, d, err)
		}
		level += d.Latest.LevelML
	}
	if s.TotalWaterML != level {
		t.Errorf("total water %v, Σ latest levels %v", s.TotalWaterML, level)
	}
}

// metricValue reads one unlabelled sample from a /metrics page.
func metricValue(t *testing.T, base, name string) float64 {
	t.Helper()
	res, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return -1
}

// TestStaleness: a kettle's poll on another front node sees a reading that
// went through the log once a writer stored it and that node's cache
// refresh ran: within (time to the store) + --cache-refresh + one scan.
// The node that took the upload sees it at once (TestAckAfterLog).
func TestStaleness(t *testing.T) {
	needKafka(t)
	tp := topic(t)
	dsn := pgtest.Start(t)
	const refresh = 500 * time.Millisecond
	fast := func(c *server.Config) { c.Ingest.Refresh = refresh }
	a := startFront(t, dsn, tp, fast)
	b := startFront(t, dsn, tp, fast)
	startWriter(t, dsn, tp)
	id := uuid.New()
	at := time.Now().Add(-time.Minute).Truncate(time.Second)
	for i, level := range []float64{777, 778, 779} {
		sent := time.Now()
		if st, body, _ := upload(t, a.URL(), id, "["+reading(at.Add(time.Duration(i)*time.Second), level)+"]"); st != 200 {
			t.Fatalf("upload: %d %s", st, body)
		}
		want := fmt.Sprintf("level %v mL", level)
		if c, _ := a.Service().Command(id); !strings.Contains(c.Reason, want) {
			t.Fatalf("the uploading node's command after the ack: %q, want %q", c.Reason, want)
		}
		var toStore, toB time.Duration
		done := make(chan struct{})
		go func() {
			defer close(done)
			for time.Since(sent) < 20*time.Second {
				if d, err := a.Store().Device(context.Background(), id); err == nil && d.Latest != nil && d.Latest.LevelML == level {
					toStore = time.Since(sent)
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
		for time.Since(sent) < 20*time.Second {
			if c, _ := b.Service().Command(id); strings.Contains(c.Reason, want) {
				toB = time.Since(sent)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		<-done
		if toB == 0 || toStore == 0 {
			t.Fatalf("reading %d: stored after %s, seen by the other node after %s (0: not within 20 s)", i, toStore, toB)
		}
		bound := toStore + refresh + time.Second // one period, and a scan of a small store under a loaded CI machine
		t.Logf("reading %d: in the store after %s, in the other node's command after %s (bound %s)", i, toStore.Round(time.Millisecond), toB.Round(time.Millisecond), bound.Round(time.Millisecond))
		if toB > bound {
			t.Errorf("reading %d: the other node saw it after %s, past the bound %s (time to the store + --cache-refresh + 1 s)", i, toB, bound)
		}
	}
}

// TestUnwrittenBound: when readings wait in the log longer than
// --log-max-unwritten-age (no writer runs), uploads are refused with 503
// and a Retry-After before any could reach the topic's retention; once a
// writer caught up they are accepted again, and every acknowledged
// reading is stored.
func TestUnwrittenBound(t *testing.T) {
	needKafka(t)
	tp := topic(t)
	dsn := pgtest.Start(t)
	front := startFront(t, dsn, tp, func(c *server.Config) {
		c.Log.Retention = time.Hour
		c.Log.MaxUnwrittenAge = 2 * time.Second
	})
	id := uuid.New()
	at := time.Now().Add(-time.Hour).Truncate(time.Second)
	acked, i := 0, 0
	next := func() (int, http.Header) {
		i++
		st, _, h := upload(t, front.URL(), id, "["+reading(at.Add(time.Duration(i)*time.Second), 100)+"]")
		if st == 200 {
			acked++
		}
		return st, h
	}
	if st, _ := next(); st != 200 {
		t.Fatalf("first upload: %d", st)
	}
	var h http.Header
	refusedAfter := testkit.WaitFor(t, "uploads refused while readings wait past --log-max-unwritten-age", 15*time.Second, func() bool {
		st, hh := next()
		h = hh
		return st == 503
	})
	t.Logf("refused %s after the first unwritten reading (bound 2 s, measured every 300 ms)", refusedAfter.Round(time.Millisecond))
	if h.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if v := metricValue(t, front.URL(), "kettle_log_unwritten_too_old"); v != 1 {
		t.Errorf("kettle_log_unwritten_too_old %v, want 1", v)
	}
	startWriter(t, dsn, tp)
	testkit.WaitFor(t, "uploads accepted again after the writer caught up", 30*time.Second, func() bool {
		time.Sleep(100 * time.Millisecond)
		st, _ := next()
		return st == 200
	})
	testkit.WaitFor(t, "every acknowledged reading stored", 30*time.Second, func() bool { return stats(t, front.Store()).MeasurementCount == int64(acked) })
}

// TestMetricsNamedByDashboard: every kettle_log_* series the dashboard and
// the alerts query is exported by a front or a writer.
func TestMetricsNamedByDashboard(t *testing.T) {
	needKafka(t)
	tp := topic(t)
	dsn := pgtest.Start(t)
	front := startFront(t, dsn, tp)
	w := startWriter(t, dsn, tp)
	if st, body, _ := upload(t, front.URL(), uuid.New(), "["+reading(time.Now().Add(-time.Minute), 100)+"]"); st != 200 {
		t.Fatalf("upload: %d %s", st, body)
	}
	testkit.WaitFor(t, "the reading written", 20*time.Second, func() bool { return stats(t, front.Store()).MeasurementCount == 1 })
	var exported strings.Builder
	for _, u := range []string{front.URL(), w.URL()} {
		res, err := http.Get(u + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		exported.Write(b)
	}
	root, err := kafkatest.Root()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, f := range []string{"deploy/grafana/kettlefleet.json", "deploy/prometheus/alerts.yml"} {
		b, err := os.ReadFile(root + "/" + f)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range metricName.FindAllString(string(b), -1) {
			names[n] = true
		}
	}
	if len(names) < 6 {
		t.Fatalf("the dashboard and alerts name only %v", names)
	}
	for n := range names {
		if !strings.Contains(exported.String(), "\n"+n) {
			t.Errorf("%s is queried by the dashboard or an alert but exported by neither a front nor a writer", n)
		}
	}
}

var metricName = regexp.MustCompile(`kettle_log_[a-z_]+`)
