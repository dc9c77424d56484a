package main

import (
	"context"
	"io"
	"regexp"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// kvrelay gateway --report-mode-full applies the relay's report-mode "full"
// rule in its index: a worker re-announcing a prefix-cache hit (a store of
// blocks its rank already holds, no parent) adds no copy, so one removal
// takes the blocks away. Without the flag the re-announcement is a second
// copy, and the blocks stay after one removal, as in SMG. A gateway behind
// `kvrelay serve --report-mode-full` without --suppress-reannounced-stores
// needs the flag, or its digests diverge from the relay's.
func TestGatewayReportModeFullFlag(t *testing.T) {
	for _, tc := range []struct {
		name       string
		flags      []string
		wantReason string // the route for the prompt after one removal
	}{
		{"off: the re-announcement is a copy", nil, "event_hit"},
		{"on: the re-announcement is no change", []string{"--report-mode-full"}, "no_overlap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verifyNoLeaks(t)
			e := kvstream.Start(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var stderr logbuf.Buffer
			exit := make(chan int, 1)
			args := append([]string{"gateway", "--worker", "grpc://" + e.Addr + ",model=m", "--listen", "127.0.0.1:0"}, tc.flags...)
			go func() { exit <- dispatch(ctx, args, nil, io.Discard, &stderr) }()
			addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
			var addr string
			deadline := time.Now().Add(30 * time.Second)
			for addr == "" {
				if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
					addr = m[1]
				} else if time.Now().After(deadline) {
					t.Fatalf("no listening line in %q", stderr.String())
				} else {
					time.Sleep(5 * time.Millisecond)
				}
			}
			prompt, marker := kvstream.SeqTokens(7, 48), kvstream.SeqTokens(1000, 16)
			e.Batches <- kvstream.StoreTokens(1, 16, prompt)
			e.Batches <- kvstream.StoreTokens(2, 16, prompt) // the re-announcement
			remove := &kvpb.KvBlocksRemoved{}
			for _, b := range kvstream.StoreTokens(0, 16, prompt).GetEvents()[0].GetStored().GetBlocks() {
				remove.BlockHashes = append(remove.BlockHashes, b.GetBlockHash())
			}
			e.Batches <- &kvpb.KvEventBatch{SequenceNumber: 3, Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Removed{Removed: remove}}}}
			// A later store: once it is routed on, the batches before it
			// are applied.
			marked := kvstream.StoreTokens(4, 16, marker)
			marked.Events[0].GetStored().Blocks[0].BlockHash = 999
			e.Batches <- marked
			for {
				_, out := apiclient.Post(t, "http://"+addr+"/v1/route", `{"model":"m","token_ids":`+apiclient.TokensJSON(marker)+`}`)
				if out["reason"] == "event_hit" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the marker store was never applied: route %v; stderr %s", out, stderr.String())
				}
				time.Sleep(10 * time.Millisecond)
			}
			if _, out := apiclient.Post(t, "http://"+addr+"/v1/route", `{"model":"m","token_ids":`+apiclient.TokensJSON(prompt)+`}`); out["reason"] != tc.wantReason {
				t.Errorf("route for the prompt after store, re-announcement, removal: %v, want reason %s", out, tc.wantReason)
			}
			cancel()
			select {
			case code := <-exit:
				if code != 0 {
					t.Errorf("exit %d; stderr %s", code, stderr.String())
				}
			case <-time.After(20 * time.Second):
				t.Fatal("gateway did not stop")
			}
		})
	}
}
