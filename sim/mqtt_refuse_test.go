package sim

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/kettlefleet/kettlefleet/mqttapi"
)

// TestSwarmMQTTRefusedOverCap: a node capped at 3 connections refuses the
// other kettles with CONNACK 0x97; the swarm counts those refusals by
// reason, keeps retrying with backoff, and the kettles that got in lose
// nothing (audit clean).
func TestSwarmMQTTRefusedOverCap(t *testing.T) {
	ctx := context.Background()
	srv := startServer(t, mqttapi.Config{Addr: "127.0.0.1:0", MaxConns: 3})
	res, err := Run(ctx, Config{
		TargetConfig:    TargetConfig{Target: srv.URL(), Secret: srv.Secret(), Operator: srv.OperatorToken()},
		FleetConfig:     FleetConfig{Devices: 8, Seed: 7},
		ScheduleConfig:  ScheduleConfig{Interval: time.Second, Jitter: 100 * time.Millisecond, Duration: 4 * time.Second},
		TransportConfig: TransportConfig{Protocol: ProtocolMQTT, MQTTTarget: srv.MQTTAddr(), MQTTInflight: 1, Batch: 1, ReserveFDs: 1000},
		OutputConfig:    OutputConfig{Progress: io.Discard, Log: io.Discard},
	})
	if err != nil {
		t.Fatal(err)
	}
	tot := res.Totals
	t.Logf("errors %v, acked %d, audit %s", tot.ErrorsByKind, tot.Acked, res.Audit.Line())
	if got := tot.ErrorsByKind["connack_0x97_quota_exceeded"]; got < 5 {
		t.Errorf("connack_0x97_quota_exceeded = %d, want ≥ 5 (5 kettles over the cap of 3)", got)
	}
	for kind, n := range tot.ErrorsByKind {
		if kind != "connack_0x97_quota_exceeded" {
			t.Errorf("error %s × %d: only capacity refusals expected", kind, n)
		}
	}
	if a := res.Audit; a == nil || a.Lost != 0 || a.Duplicated != 0 || a.Acked == 0 || a.Stored != a.Acked {
		t.Errorf("audit %+v", a)
	}
}
