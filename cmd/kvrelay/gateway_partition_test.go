package main

import (
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// TestGatewayPartitionedCommand: two `kvrelay gateway --partitions 2`
// replicas, one per partition, over one NATS server. Each subscribes only
// to its partition's worker; the other lists it as remote. A prompt cached
// on a worker reaches the index of its partition's replica only, and the
// other replica's route still finds it (event_hit), through the scatter.
// A replica answers its partition (and /readyz says ready) only once it
// has joined its partition's queue group, which the route waits for: here
// at once, each being its partition's only replica ("alone"; with another
// replica answering it would wait for its worker's state, which package
// partitionsync's tests check).
func TestGatewayPartitionedCommand(t *testing.T) {
	verifyNoLeaks(t)
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	// Two workers in different partitions: start engines until both
	// partitions have one.
	var engines [2]*kvstream.Engine
	for engines[0] == nil || engines[1] == nil {
		e := kvstream.Start(t)
		if p := gateway.PartitionOf("grpc://"+e.Addr, 2); engines[p] == nil {
			engines[p] = e
		}
	}
	var addrs [2]string
	for p := range 2 {
		addrs[p], _ = startGatewayCmd(t, "--worker", "grpc://"+engines[0].Addr+",model=m", "--worker", "grpc://"+engines[1].Addr+",model=m",
			"--nats", ns.URL(), "--partitions", "2", "--partition", []string{"0", "1"}[p], "--partition-deadline", "10s",
			"--partition-join-wait", "10m", "--placement-weight", "0")
	}
	// Each replica subscribes to its own worker only (kvstream counts the
	// subscribe requests it gets).
	for p, e := range engines {
		select {
		case <-e.Requests:
		case <-time.After(30 * time.Second):
			t.Fatalf("partition %d's replica never subscribed to its worker", p)
		}
	}
	workers := apiclient.Get(t, "http://"+addrs[0]+"/v1/workers")
	if !strings.Contains(workers, `"state":"remote"`) || !strings.Contains(workers, `"partition":1`) {
		t.Fatalf("partition 0's replica does not list partition 1's worker as remote: %s", workers)
	}

	// Its worker streams but has sent nothing; alone in its partition,
	// partition 1's replica answers all the same.
	deadline := time.Now().Add(30 * time.Second)
	for r := ""; !strings.Contains(r, `"status":"ready"`); r = apiclient.Get(t, "http://"+addrs[1]+"/readyz") {
		if time.Now().After(deadline) {
			t.Fatalf("partition 1's replica, alone in its partition, never ready: %s", r)
		}
		time.Sleep(10 * time.Millisecond)
	}
	prompt := kvstream.SeqTokens(7, 48)
	engines[1].Batches <- kvstream.StoreTokens(1, 16, prompt)
	for !strings.Contains(apiclient.Get(t, "http://"+addrs[1]+"/v1/workers"), `"index_blocks":3`) {
		if time.Now().After(deadline) {
			t.Fatal("partition 1's worker's blocks never indexed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, out := apiclient.Post(t, "http://"+addrs[0]+"/v1/route", `{"model":"m","token_ids":`+apiclient.TokensJSON(prompt)+`}`)
	if out["worker"] != "grpc://"+engines[1].Addr || out["reason"] != "event_hit" {
		t.Fatalf("partition 0's route of partition 1's prompt: %v", out)
	}
	select {
	case r := <-engines[0].Requests:
		t.Errorf("partition 0's worker subscribed again: %v", r)
	case r := <-engines[1].Requests:
		t.Errorf("partition 1's worker subscribed again (by partition 0?): %v", r)
	default:
	}
	m := apiclient.Get(t, "http://"+addrs[0]+"/metrics")
	if !strings.Contains(m, "kvrelay_gateway_scatter_seconds_count 1") || !strings.Contains(m, `kvrelay_gateway_scatter_missing_total{partition="1"} 0`) {
		t.Errorf("partition 0's scatter metrics:\n%s", grepLines(m, "scatter"))
	}
	m = apiclient.Get(t, "http://"+addrs[1]+"/metrics")
	if !strings.Contains(m, "kvrelay_gateway_partition_answering 1") || !strings.Contains(m, `kvrelay_gateway_partition_joins_total{how="alone"} 1`) {
		t.Errorf("partition 1's join metrics:\n%s", grepLines(m, "partition_"))
	}
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
