package gateway

import (
	"context"
	"log/slog"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// reportModeStep is one vLLM block-pool event on a rank, in the shapes a
// request with kv_cache_report_mode "full" makes it publish.
type reportModeStep struct {
	kind   string // "store", "reannounce" (a hit chain: parent None, from block 0) or "remove"
	parent int64  // 0: none
	hashes []int64
}

// reportModeLife: request A caches 1 2 3; B hits 1 2 (re-announced) and
// caches 4; C recomputes 3 into a new block (a genuine second copy); D hits
// 1 2 3 (re-announced); one copy of 3 is evicted; E hits 1; then 4 and the
// rest of 3 go, one copy at a time.
var reportModeLife = []reportModeStep{
	{"store", 0, []int64{1, 2, 3}},
	{"reannounce", 0, []int64{1, 2}},
	{"store", 2, []int64{4}},
	{"store", 2, []int64{3}},
	{"reannounce", 0, []int64{1, 2, 3}},
	{"remove", 0, []int64{3}},
	{"reannounce", 0, []int64{1}},
	{"remove", 0, []int64{4}},
	{"reannounce", 0, []int64{1, 2, 3}},
}

// Issue 14.2, end to end: a two-rank vLLM publisher (pyzmq) whose requests
// use report mode "full", a relay with --report-mode-full and
// --suppress-reannounced-stores behind a real gRPC server, and our gateway.
// The relay's record, a snapshot cut from it, the gateway that followed the
// stream from the start and a gateway that joined late (served a snapshot:
// the history holds 4 batches) all end with the engine's exact copies, while
// the genuine second copy of block 3 counts and leaves one copy at a time.
// Without the rule, every re-announced block would stay in all of them.
func TestReportModeFullEndsExactInTheRecordASnapshotAndTheIndex(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	for _, tc := range []struct {
		name     string
		suppress bool
	}{
		{"the relay suppresses re-announcements", true},
		{"the index applies the rule", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const dp = 2
			peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: dp})
			reg := prometheus.NewRegistry()
			rel, err := relay.New(relay.Config{
				Engine: vllm.Engine, DPSize: dp, HistoryBatches: 4,
				KV:             engines.Config{Enabled: true, Publisher: "zmq", Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0)},
				ReportModeFull: true, SuppressReannounced: tc.suppress,
				Logger: slog.New(slog.DiscardHandler), Registerer: reg,
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			relDone := make(chan struct{})
			go func() { defer close(relDone); _ = rel.Run(ctx) }()
			t.Cleanup(func() { cancel(); <-relDone })
			eventually(t, "relay connected", rel.Ready)
			srv, err := server.New(server.Options{Logger: slog.New(slog.DiscardHandler), Services: []server.Service{server.RelayService(vllm.Engine, rel)}})
			if err != nil {
				t.Fatal(err)
			}
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			srvDone := make(chan struct{})
			go func() { defer close(srvDone); _ = srv.Serve(lis) }()
			t.Cleanup(func() { srv.Stop(); <-srvDone })
			g, greg := startReportModeGateway(t, !tc.suppress, Worker{ID: "early", Addr: lis.Addr().String(), Model: "llama"})

			// truth: the engine's physical copies per (rank, hash).
			truth := map[int32]map[uint64]int{0: {}, 1: {}}
			published := 0
			for _, st := range reportModeLife {
				for rank := int32(0); rank < dp; rank++ {
					off := int64(rank) * 1000
					hashes := make([]enginepeer.Hash, len(st.hashes))
					tokens := make([]int64, 16*len(st.hashes))
					for i, h := range st.hashes {
						hashes[i] = enginepeer.I64(off + h)
						for j := 0; j < 16; j++ {
							tokens[16*i+j] = off + h*16 + int64(j)
						}
					}
					var ev enginepeer.Event
					switch st.kind {
					case "store", "reannounce":
						var parent *enginepeer.Hash
						if st.parent != 0 {
							p := enginepeer.I64(off + st.parent)
							parent = &p
						}
						ev = enginepeer.Stored(parent, tokens, hashes...)
					case "remove":
						ev = enginepeer.Removed(hashes...)
					}
					if _, err := peer.Publish(int(rank), ev); err != nil {
						t.Fatal(err)
					}
					published++
					for _, h := range st.hashes {
						switch st.kind {
						case "store":
							truth[rank][uint64(off+h)]++
						case "remove":
							if truth[rank][uint64(off+h)]--; truth[rank][uint64(off+h)] == 0 {
								delete(truth[rank], uint64(off+h))
							}
						}
					}
				}
			}
			var want []index.LiveBlock
			for rank := int32(0); rank < dp; rank++ {
				for h, n := range truth[rank] {
					want = append(want, index.LiveBlock{Rank: rank, Tier: index.TierDevice, EngineHash: h, Copies: n})
				}
			}
			slices.SortFunc(want, func(a, b index.LiveBlock) int {
				if a.Rank != b.Rank {
					return int(a.Rank - b.Rank)
				}
				return int(int64(a.EngineHash) - int64(b.EngineHash))
			})
			eventually(t, "every batch relayed", func() bool { return int(rel.Status().Relayed) >= published })

			// The record, through a snapshot cut from it.
			var fromSnapshot []index.LiveBlock
			for _, chunk := range rel.Snapshot() {
				for _, ev := range chunk.GetEvents() {
					for _, b := range ev.GetStored().GetBlocks() {
						lb := index.LiveBlock{Rank: chunk.GetDpRank(), Tier: index.TierDevice, EngineHash: uint64(b.GetBlockHash()), Copies: 1}
						if i := slices.IndexFunc(fromSnapshot, func(x index.LiveBlock) bool {
							return x.Rank == lb.Rank && x.EngineHash == lb.EngineHash
						}); i >= 0 {
							fromSnapshot[i].Copies++
							continue
						}
						fromSnapshot = append(fromSnapshot, lb)
					}
				}
			}
			slices.SortFunc(fromSnapshot, func(a, b index.LiveBlock) int {
				if a.Rank != b.Rank {
					return int(a.Rank - b.Rank)
				}
				return int(int64(a.EngineHash) - int64(b.EngineHash))
			})
			if !slices.Equal(fromSnapshot, want) {
				t.Fatalf("the relay's snapshot holds %v, the engine %v", fromSnapshot, want)
			}

			late, lreg := startReportModeGateway(t, !tc.suppress, Worker{ID: "late", Addr: lis.Addr().String(), Model: "llama"})
			for name, gw := range map[string]*Gateway{"early": g, "late": late} {
				deadline := time.Now().Add(waitFor)
				for {
					got, _ := gw.LiveSet(name)
					if slices.Equal(got, want) {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("gateway %s's index holds %v, the engine %v", name, got, want)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			label := map[bool]string{false: "false", true: "true"}[tc.suppress]
			if got := counterWith(t, reg, "kvrelay_record_reannounced_stores_total", map[string]string{"suppressed": label}); got != 2*4 {
				t.Errorf("kvrelay_record_reannounced_stores_total{suppressed=%s} = %g, want 8 (4 per rank)", label, got)
			}
			// The gateways' digests agree with the relay's all along.
			for name, r := range map[string]*prometheus.Registry{"early": greg, "late": lreg} {
				if n := counterWith(t, r, "kvrelay_gateway_digest_divergences_total", nil); n != 0 {
					t.Errorf("gateway %s counted %g digest divergences", name, n)
				}
			}
		})
	}
}

// startReportModeGateway runs a gateway whose index applies the report-mode
// rule or not.
func startReportModeGateway(t *testing.T, rule bool, workers ...Worker) (*Gateway, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	g, err := New(Config{Workers: workers, Registerer: reg, Index: index.Options{ReportModeFull: rule}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return g, reg
}

// counterWith sums a counter over the series matching labels.
func counterWith(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
