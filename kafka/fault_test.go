package kafka_test

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/blackhole"
	"github.com/kettlefleet/kettlefleet/internal/kafkatest"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/internal/testkit"
	"github.com/kettlefleet/kettlefleet/kafka"
	"github.com/kettlefleet/kettlefleet/server"
)

// upload is one Append as a kettle saw it.
type faultUpload struct {
	device    kettle.DeviceID
	at        time.Time // device time, unique per device
	sent, ack time.Time
	err       error
}

// TestBrokerPause (issue 53, scenario e): 30 kettles, one reading every
// 50 ms each, produced through the front's Producer (acks=all, RF 3, min
// ISR 2) while one broker (not the active controller) is paused with
// SIGSTOP until each kettle had 40 readings sent after the pause
// acknowledged: a machine that neither answers nor refuses, which no TCP
// error reveals. Two brokers, a majority, stay up: no upload may be
// answered more than 3 s later than the usual p99 before the pause, no
// more than that may pass without an acknowledgement, nothing is refused,
// and every acknowledged reading is in the log afterwards. The kill -9
// variant, and the active controller's loss, are make chaos's log-broker
// parts (a killed JVM takes most of a minute to start again here).
func TestBrokerPause(t *testing.T) {
	needKafka(t)
	brokerFault(t, "pause")
}

func brokerFault(t *testing.T, fault string) {
	const (
		kettles = 30
		every   = 50 * time.Millisecond
		// Counted in acknowledged uploads of every kettle, not seconds (a
		// loaded machine sends fewer): the first warm ones are left out of
		// the usual latency, the next usual ones make it; the fault lasts
		// until each kettle (keyed by device, so each writes to one
		// partition, some led or followed by the faulted broker) has
		// faulted uploads sent after it acknowledged, so a stall is seen
		// whole however long it lasts.
		warm, usualN, faulted = 20, 40, 40
		ackWait               = 90 * time.Second
		// A pause must cost seconds (without the producer's and the
		// brokers' short timeouts it costs 8 s and more). The bound
		// (1 s over the usual p99) is judged by make chaos's
		// log-broker-pause part, which this loaded 2-core machine meets
		// only some of the time (docs/reliability.md).
		slack    = 3 * time.Second
		settleTo = 60 * time.Second
	)
	topic := topic(t)
	p, err := kafka.NewProducer(context.Background(), kafka.ProducerConfig{
		Target: cluster.Target(topic, kafkatest.Front), Topic: kafka.TopicConfig{Partitions: 12},
		Group: "kettle-writers-" + topic, MonitorEvery: time.Second, Log: logger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	var mu sync.Mutex
	var ups []*faultUpload
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	for k := range kettles {
		dev := uuid.New()
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(every)
			defer tick.Stop()
			for i := 0; ; i++ {
				u := &faultUpload{device: dev, at: base.Add(time.Duration(i) * time.Millisecond), sent: time.Now()}
				mu.Lock()
				ups = append(ups, u)
				mu.Unlock()
				wg.Add(1)
				// Open model: a slow answer does not delay the next reading.
				go func() {
					defer wg.Done()
					err := p.Append(context.Background(), []kettle.Measurement{{Device: u.device, Time: u.at, ChargeMWh: 1, FullMWh: 2, AmbientC: 20, WaterC: 60, LevelML: float64(k)}}, u.sent)
					mu.Lock()
					u.ack, u.err = time.Now(), err
					mu.Unlock()
				}()
				select {
				case <-tick.C:
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	// acked is the fewest acknowledged uploads sent after since of a
	// kettle.
	acked := func(since time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		each := map[uuid.UUID]int{}
		for _, u := range ups {
			if u.err == nil && !u.ack.IsZero() && !u.sent.Before(since) {
				each[u.device]++
			}
		}
		if len(each) < kettles {
			return 0
		}
		return slices.Min(slices.Collect(maps.Values(each)))
	}
	// waitAcked waits up to ackWait for n acknowledged uploads sent after
	// since of every kettle.
	waitAcked := func(n int, since time.Time, what string) bool {
		if !testkit.Poll(ackWait, 50*time.Millisecond, func() bool { return acked(since) >= n }) {
			t.Errorf("%s: a kettle had %d acknowledged uploads in %s, want %d each", what, acked(since), ackWait, n)
			return false
		}
		return true
	}
	if !waitAcked(warm, time.Time{}, "warming up") {
		stop()
		wg.Wait()
		t.FailNow()
	}
	usualFrom := time.Now()
	waitAcked(usualN, usualFrom, "before the fault") // the usual latency

	qctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	leader, err := cluster.QuorumLeader(qctx)
	cancel()
	if err != nil {
		stop()
		wg.Wait()
		t.Fatal(err)
	}
	node := leader%3 + 1 // a broker whose loss costs no controller election
	faultAt := time.Now()
	switch fault {
	case "kill":
		err = cluster.Kill(node)
	case "pause":
		err = cluster.Pause(node)
	}
	if err != nil {
		stop()
		wg.Wait()
		t.Fatal(err)
	}
	healed := false
	heal := func() {
		if healed {
			return
		}
		healed = true
		var err error
		if fault == "kill" {
			err = cluster.StartNode(node)
		} else {
			err = cluster.Resume(node)
		}
		if err != nil {
			t.Errorf("heal node %d: %v", node, err)
		}
	}
	defer heal()
	waitAcked(faulted, faultAt, fmt.Sprintf("while node %d was %sd", node, fault))
	heal()
	healAt := time.Now()
	// The other tests share these brokers: every partition in sync again
	// before the next one starts.
	testkit.WaitFor(t, fmt.Sprintf("every partition's ISR back to 3 after node %d was back", node), settleTo, func() bool { return fullyReplicated(topic) })
	t.Logf("%s: node %d (the KRaft quorum's leader: node %d) back %.1fs after the fault; every partition in sync again %.1fs later", fault, node, leader, healAt.Sub(faultAt).Seconds(), time.Since(healAt).Seconds())
	stop()
	wg.Wait()

	var usual []time.Duration
	var worst time.Duration
	var worstAt time.Time
	var refused int
	var acks []time.Time
	for _, u := range ups {
		if u.err != nil {
			refused++
			if refused <= 3 {
				t.Errorf("%s: an upload %.1fs after the fault was refused: %v", fault, u.sent.Sub(faultAt).Seconds(), u.err)
			}
			continue
		}
		lat := u.ack.Sub(u.sent)
		acks = append(acks, u.ack)
		if u.ack.Before(faultAt) && !u.sent.Before(usualFrom) {
			usual = append(usual, lat)
		}
		if !u.sent.Before(faultAt.Add(-time.Second)) && lat > worst {
			worst, worstAt = lat, u.sent
		}
	}
	slices.Sort(usual)
	if len(usual) == 0 {
		t.Fatalf("%s: no upload was acknowledged in the %s before the fault", fault, faultAt.Sub(usualFrom).Round(time.Millisecond))
	}
	p99 := usual[len(usual)*99/100]
	slices.SortFunc(acks, func(a, b time.Time) int { return a.Compare(b) })
	var gap time.Duration
	var gapAt time.Time
	for i := 1; i < len(acks); i++ {
		if acks[i].Before(faultAt.Add(-time.Second)) {
			continue
		}
		if d := acks[i].Sub(acks[i-1]); d > gap {
			gap, gapAt = d, acks[i-1]
		}
	}
	t.Logf("figure: broker_%s_usual_upload_p99 = %.3f s", fault, p99.Seconds())
	t.Logf("figure: broker_%s_longest_without_ack = %.3f s", fault, gap.Seconds())
	t.Logf("figure: broker_%s_slowest_upload = %.3f s", fault, worst.Seconds())
	t.Logf("%s: %d uploads, %d refused; longest time without an acknowledgement %.3fs (from %.2fs after the fault); slowest upload %.3fs (sent %.2fs after the fault); usual p99 %.3fs",
		fault, len(ups), refused, gap.Seconds(), gapAt.Sub(faultAt).Seconds(), worst.Seconds(), worstAt.Sub(faultAt).Seconds(), p99.Seconds())
	if worst > p99+slack {
		t.Errorf("%s of node %d: an upload took %.3fs, more than %s over the usual p99 (%.3fs)", fault, node, worst.Seconds(), slack, p99.Seconds())
	}
	if gap > p99+slack {
		t.Errorf("%s of node %d: %.3fs without an acknowledgement, more than %s over the usual p99 (%.3fs)", fault, node, gap.Seconds(), slack, p99.Seconds())
	}

	// Every acknowledged reading is in the log (a leader elected from
	// outside the ISR would have dropped some).
	want := map[string]bool{}
	for _, u := range ups {
		if u.err == nil {
			want[u.device.String()+u.at.Format(time.RFC3339Nano)] = true
		}
	}
	recs := readAll(t, topic, len(want))
	var rows []kettle.Measurement
	for _, r := range recs {
		rows, _, err = kafka.Decode(r, rows[:0])
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range rows {
			delete(want, m.Device.String()+m.Time.Format(time.RFC3339Nano))
		}
	}
	if len(want) > 0 {
		t.Errorf("%s: %d acknowledged readings are not in the log", fault, len(want))
	}
	checkNoUnclean(t, topic)
}

// fullyReplicated reports whether every partition of topic has all three
// replicas in sync.
func fullyReplicated(topic string) bool {
	cl, err := cluster.Client(kafkatest.Admin)
	if err != nil {
		return false
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	td, err := kadm.NewClient(cl).ListTopics(ctx, topic)
	if err != nil || td[topic].Err != nil || len(td[topic].Partitions) == 0 {
		return false
	}
	for _, p := range td[topic].Partitions {
		if len(p.ISR) != 3 {
			return false
		}
	}
	return true
}

// checkNoUnclean fails unless the topic forbids electing a leader from
// outside the ISR.
func checkNoUnclean(t *testing.T, topic string) {
	t.Helper()
	ctx, adm, done := admin(t)
	defer done()
	rc, err := adm.DescribeTopicConfigs(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	c, err := rc.On(topic, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range c.Configs {
		if kv.Key == "unclean.leader.election.enable" {
			if kv.MaybeValue() != "false" {
				t.Errorf("topic %s: unclean.leader.election.enable=%s", topic, kv.MaybeValue())
			}
			return
		}
	}
	t.Errorf("topic %s: unclean.leader.election.enable not described", topic)
}

// TestReadyWithoutStore (issue 53, scenario f): with the log in front, a
// node stays ready and answers uploads 200 while PostgreSQL does not
// answer at all (packets dropped: a failover, a switchover, a cut-off
// primary). Every node shares the store; had they all said not ready, the
// balancer would refuse every kettle at once, which turns the writers'
// lag into refusals.
func TestReadyWithoutStore(t *testing.T) {
	needKafka(t)
	dsn := pgtest.Start(t)
	bh, via := blackhole.ForDSN(t, dsn)
	front := startFront(t, via, topic(t), func(c *server.Config) { c.Ingest.StoreTimeout = 500 * time.Millisecond })
	base := front.URL()
	bh.Block(true)
	defer bh.Block(false)
	res, err := http.Get(base + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Errorf("/readyz with the store unreachable and the log up: %d, want 200", res.StatusCode)
	}
	id := uuid.New()
	for i := range 3 {
		if code, body, _ := upload(t, base, id, reading(time.Now().Add(time.Duration(i-10)*time.Second), 500)); code != 200 {
			t.Errorf("upload %d with the store unreachable: %d %s, want 200 (the log acknowledges)", i, code, body)
		}
	}
}
