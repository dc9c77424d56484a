package httpapi

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// TestReadyzPartitioned: on partition 0 of a 2-partition tier, /readyz
// waits for the models that have a worker of partition 0 until one of
// them streams; a model whose workers are all partition 1's (they show
// state "remote" here) does not hold readiness back. Before the fix such
// a model kept the replica at 503 for good.
func TestReadyzPartitioned(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := lis.Addr().String()
	_ = lis.Close()
	in := func(p int, prefix string, n int) []string {
		var ids []string
		for i := 0; len(ids) < n; i++ {
			if id := fmt.Sprintf("%s%d", prefix, i); gateway.PartitionOf(id, 2) == p {
				ids = append(ids, id)
			}
		}
		return ids
	}
	own, remote := in(0, "w", 2), in(1, "w", 3)
	url, g, _ := servedGateway(t, gateway.Config{Partitions: 2, Partition: 0, Workers: []gateway.Worker{
		{ID: own[0], Addr: e.Addr, Model: "a"},  // streams
		{ID: remote[0], Addr: down, Model: "a"}, // partition 1's
		{ID: own[1], Addr: down, Model: "b"},    // never streams
		{ID: remote[1], Addr: down, Model: "b"}, // partition 1's
		{ID: remote[2], Addr: down, Model: "r"}, // only partition 1's
	}}, DefaultLimits, slog.New(slog.DiscardHandler))
	readyz := func() (int, []string) {
		t.Helper()
		resp, err := http.Get(url + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body struct {
			Waiting []string `json:"models_without_a_stream"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body.Waiting
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		i := slices.IndexFunc(g.Workers(), func(ws gateway.WorkerStatus) bool { return ws.ID == own[0] })
		if i >= 0 && g.Workers()[i].State == monitor.StateStreaming {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("model a's own worker never streamed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if code, waiting := readyz(); code != http.StatusServiceUnavailable || !slices.Equal(waiting, []string{"b"}) {
		t.Fatalf("/readyz %d waiting for %v; want 503 for model b only (its own worker is down; model r has only partition 1's)", code, waiting)
	}
	if err := g.RemoveWorker(own[1]); err != nil {
		t.Fatal(err)
	}
	if code, waiting := readyz(); code != http.StatusOK {
		t.Fatalf("/readyz %d waiting for %v with every model's own workers streaming or none of its own", code, waiting)
	}

	// A tier connection that does not answer the partition yet (a
	// restarted replica holding back while its workers' state arrives):
	// not ready, naming the own worker still catching up (own[0] streams
	// but has delivered nothing).
	tier := &holdingTier{}
	g.SetScatterer(tier)
	resp, err := http.Get(url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	var body struct {
		Answering  *bool    `json:"partition_answering"`
		CatchingUp []string `json:"catching_up"`
	}
	err = json.NewDecoder(resp.Body).Decode(&body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || body.Answering == nil || *body.Answering || !slices.Equal(body.CatchingUp, []string{own[0]}) {
		t.Fatalf("/readyz while the partition is not answered: %d %+v (%v); want 503, partition_answering false, catching up %s", resp.StatusCode, body, err, own[0])
	}
	tier.answering.Store(true)
	if code, waiting := readyz(); code != http.StatusOK {
		t.Fatalf("/readyz %d waiting for %v once the partition is answered", code, waiting)
	}
}

// holdingTier is a tier connection that says whether it answers the
// partition (gateway.PartitionAnswerer) and asks no other partition.
type holdingTier struct{ answering atomic.Bool }

func (h *holdingTier) Scatter(_ gateway.PartitionQuery, local func()) []gateway.PartitionAnswer {
	local()
	return nil
}

func (h *holdingTier) Answering() bool { return h.answering.Load() }
