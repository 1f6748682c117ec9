package postgres_test

import (
	"context"
	"math"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet"
	"github.com/kettlefleet/kettlefleet/internal/pgtest"
	"github.com/kettlefleet/kettlefleet/postgres"
)

// TestReadReplica: with --db-read a history read goes to the replica while
// its lag is measured and within the maximum, and to the primary while it
// cannot be measured (here: nothing listens at the replica's address).
// ha.TestHA runs it against a real standby.
func TestReadReplica(t *testing.T) {
	dsn := pgtest.Start(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "postgres://kettle@" + ln.Addr().String() + "/kettle?connect_timeout=1"
	ln.Close()
	// Each case writes its own kettle: both write "now", and two cases a
	// second apart would otherwise both be in one kettle's history.
	f := func(dev int, read string, wantReplica bool) {
		t.Helper()
		s, err := postgres.Open(context.Background(), dsn, postgres.Options{MaxConns: 4, ReadDSN: read, MaxReadLag: time.Second})
		if err != nil {
			t.Fatalf("Open with ReadDSN %s: %v", read, err)
		}
		defer s.Close()
		rng := rand.New(rand.NewPCG(3, 4))
		if _, err := s.Write(context.Background(), []kettle.Measurement{rowAt(rng, devID(dev), time.Now().UTC().Truncate(time.Second))}, time.Now()); err != nil {
			t.Fatal(err)
		}
		h, err := s.History(context.Background(), kettle.HistoryQuery{Device: devID(dev), Limit: 10})
		if err != nil || len(h) != 1 {
			t.Fatalf("History: %d rows, %v", len(h), err)
		}
		st := s.ReplicaStats()
		if !st.Configured || st.MaxLagSeconds != 1 {
			t.Errorf("ReplicaStats %+v: want configured, max lag 1 s", st)
		}
		if wantReplica && (st.Reads != 1 || st.PrimaryReads != 0 || st.LagSeconds != 0) {
			t.Errorf("a replica with no lag: %+v, want the read there and lag 0", st)
		}
		if !wantReplica && (st.Reads != 0 || st.PrimaryReads != 1 || !math.IsNaN(st.LagSeconds)) {
			t.Errorf("an unreachable replica: %+v, want the read on the primary and lag NaN", st)
		}
	}
	f(1, dsn, true) // the primary as its own "replica": lag 0
	f(2, dead, false)
}

// TestDeviceReadsPrimary: with --db-read, Device (a node's credential
// lookup of a kettle another node registered) still reads the primary.
// The "replica" here is another database, which has the schema but none
// of the devices: device lists go there (it has no lag), and show none;
// Device finds the device.
func TestDeviceReadsPrimary(t *testing.T) {
	dsn, other := pgtest.Start(t), pgtest.Start(t)
	o, err := postgres.Open(context.Background(), other, postgres.Options{})
	if err != nil {
		t.Fatal(err)
	}
	o.Close()
	s, err := postgres.Open(context.Background(), dsn, postgres.Options{MaxConns: 4, ReadDSN: other, MaxReadLag: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if err := s.Register(ctx, []kettle.DeviceID{devID(1)}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if ds, err := s.Devices(ctx, devID(0), 10); err != nil || len(ds) != 0 || s.ReplicaStats().Reads != 1 {
		t.Fatalf("Devices: %d devices, %v, %+v; want none, read on the replica", len(ds), err, s.ReplicaStats())
	}
	if d, err := s.Device(ctx, devID(1)); err != nil || d.ID != devID(1) {
		t.Errorf("Device of a registered device with a replica that lacks it: %+v, %v", d, err)
	}
}
