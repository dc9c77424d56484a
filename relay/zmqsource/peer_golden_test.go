package zmqsource

import (
	"context"
	"encoding/hex"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// TestPeerGoldenEncodings pins the engine peer's msgpack output to the
// worked encodings in engine-wire.md §3.6 (built from each engine's field
// order and checked there against smg's golden batches), so every interop
// test built on the peer sees engine-exact bytes. The payload is read back
// through the Replayer, which also checks the bytes survive the replay path.
func TestPeerGoldenEncodings(t *testing.T) {
	const ts = 1700000000.5
	tokens := []int64{1, 2, 3, 4, 5, 6, 7, 8}
	vllmHashes := []enginepeer.Hash{enginepeer.U64(0x84b146b151d55111), enginepeer.U64(0xd43b57df56b58fb1)}
	sglHashes := []enginepeer.Hash{enginepeer.I64(-3488128144981237669), enginepeer.I64(5674439469042975057)}
	gpuExtras := map[string]any{"extra_keys": []any{nil, nil}, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
	withFields := func(e enginepeer.Event, f map[string]any) enginepeer.Event { e.Fields = f; return e }

	tests := []struct {
		name   string
		engine string
		wire   string
		events []enginepeer.Event
		want   string
	}{
		{
			name: "vllm map, required keys", engine: enginepeer.VLLM, wire: "map",
			events: []enginepeer.Event{enginepeer.Stored(nil, tokens, vllmHashes...)},
			want: "93cb41d954fc4020000091" +
				"88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0" +
				"00",
		},
		{
			name: "vllm map, GPU store fields", engine: enginepeer.VLLM, wire: "map",
			events: []enginepeer.Event{withFields(enginepeer.Stored(nil, tokens, vllmHashes...), gpuExtras)},
			want: "93cb41d954fc40200000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392" +
				"cf84b146b151d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e" +
				"5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347" +
				"5055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63" +
				"616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
		},
		{
			name: "vllm legacy array", engine: enginepeer.VLLM, wire: "array",
			events: []enginepeer.Event{withFields(enginepeer.Stored(nil, tokens, vllmHashes...), gpuExtras)},
			want: "93cb41d954fc40200000919cab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1" +
				"c098010203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec000",
		},
		{
			name: "vllm map removed and cleared", engine: enginepeer.VLLM, wire: "map",
			events: []enginepeer.Event{
				withFields(enginepeer.Removed(vllmHashes...), map[string]any{"group_idx": 0}),
				enginepeer.Cleared(),
			},
			want: "93cb41d954fc4020000092" +
				"84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f69647800" +
				"81a474797065b0416c6c426c6f636b73436c6561726564" +
				"00",
		},
		{
			name: "sglang map", engine: enginepeer.SGLang, wire: "map",
			events: []enginepeer.Event{enginepeer.Stored(nil, tokens, sglHashes...)},
			want: "93cb41d954fc402000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392" +
				"d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e" +
				"5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347" +
				"505500",
		},
		{
			name: "sglang legacy array", engine: enginepeer.SGLang, wire: "array",
			events: []enginepeer.Event{enginepeer.Stored(nil, tokens, sglHashes...)},
			want:   "93cb41d954fc402000009197ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0a347505500",
		},
		{
			name: "sglang array cleared", engine: enginepeer.SGLang, wire: "array",
			events: []enginepeer.Event{enginepeer.Cleared()},
			want:   "93cb41d954fc4020000091" + "91b0416c6c426c6f636b73436c6561726564" + "00",
		},
		{
			name: "tokenspeed", engine: enginepeer.TokenSpeed,
			events: []enginepeer.Event{enginepeer.Stored(nil, tokens, vllmHashes...)},
			want:   "93cb41d954fc402000009195ab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c09801020304050607080400",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := enginepeer.Start(t, enginepeer.Options{Engine: tt.engine, Wire: tt.wire, StartupClear: "none"})
			pub, err := p.PublishAt(0, ts, tt.events...)
			if err != nil {
				t.Fatal(err)
			}
			r := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: 5 * time.Second, Logger: quietLogger()}
			msgs, complete, err := r.Replay(context.Background(), pub.Seq)
			if err != nil || !complete || len(msgs) != 1 {
				t.Fatalf("replay: %d msgs, complete %v, err %v", len(msgs), complete, err)
			}
			if got := hex.EncodeToString(msgs[0].Payload); got != tt.want {
				t.Errorf("payload\n got %s\nwant %s", got, tt.want)
			}
		})
	}
}

// SGLang publishes its startup AllBlocksCleared as seq 0 on start and on
// every restart.
func TestPeerSGLangStartupClear(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang})
	const clearedBatchTail = "9181a474797065b0416c6c426c6f636b73436c656172656400" // [AllBlocksCleared], rank 0
	r := &Replayer{Endpoint: p.ReplayEndpoint(0), Logger: quietLogger()}
	for incarnation := 0; incarnation < 2; incarnation++ {
		if _, err := p.Publish(0, probe()); err != nil {
			t.Fatal(err)
		}
		msgs, complete, err := r.Replay(context.Background(), 0)
		if err != nil || !complete || len(msgs) != 2 {
			t.Fatalf("incarnation %d: %d msgs, complete %v, err %v", incarnation, len(msgs), complete, err)
		}
		first := hex.EncodeToString(msgs[0].Payload)
		if msgs[0].Seq != 0 || len(first) < len(clearedBatchTail) || first[len(first)-len(clearedBatchTail):] != clearedBatchTail {
			t.Errorf("incarnation %d: seq %d payload %s is not the startup clear", incarnation, msgs[0].Seq, first)
		}
		if err := p.Restart(0); err != nil {
			t.Fatal(err)
		}
	}
}
