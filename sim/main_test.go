package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
	"github.com/kvrelay/kvrelay/sim/workload"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// zmq4 v0.17.0's PUB writer goroutine never exits, even after Close
		// (go-ecosystem.md §1.3 #5); the simulator is a Go PUB.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// zmq4's inproc transport leaves connection readers blocked after
		// both ends are closed (TestInprocEndpoints).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4/internal/inproc.(*conn).read"),
	)
}

// startSim starts a simulator on free loopback ports with a replay ROUTER.
func startSim(t *testing.T, opts Options, extraConfig string) *Engine {
	t.Helper()
	if opts.DPSize == 0 {
		opts.DPSize = 1
	}
	base := freeport.ForTest(t, 2*opts.DPSize)
	enable := `"enable_kv_cache_events": true`
	if opts.Engine == "sglang" {
		enable = `"publisher": "zmq"`
	}
	opts.KVEventsConfig = fmt.Sprintf(`{%s, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"%s}`,
		enable, base, base+opts.DPSize, extraConfig)
	if opts.BlockSize == 0 {
		opts.BlockSize = 4
	}
	if opts.CapacityBlocks == 0 {
		opts.CapacityBlocks = 64
	}
	if opts.Workload == (workload.Config{}) {
		opts.Workload.Seed = 1
		opts.Workload.SystemPromptTokens = 16
		opts.Workload.TokensPerTurn = 8
		opts.Workload.Sessions = 6
		opts.Workload.Vocab = 50
	}
	e, err := Start(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// receiver reads a zmq4 socket in a goroutine so tests can wait with a
// timeout; closing the socket ends the goroutine.
type receiver struct {
	sock zmq4.Socket
	c    chan zmq4.Msg
	done chan struct{}
}

func newReceiver(t *testing.T, sock zmq4.Socket) *receiver {
	r := &receiver{sock: sock, c: make(chan zmq4.Msg, 1024), done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer close(r.c)
		for {
			m, err := sock.Recv()
			if err != nil {
				return
			}
			if m.Type == zmq4.CmdMsg {
				continue
			}
			r.c <- m
		}
	}()
	t.Cleanup(r.close)
	return r
}

func (r *receiver) close() {
	r.sock.Close()
	// Drain so the reader goroutine is never stuck on a full channel.
	for range r.c {
	}
	<-r.done
}

func (r *receiver) next(t *testing.T, timeout time.Duration) (zmq4.Msg, bool) {
	t.Helper()
	select {
	case m, ok := <-r.c:
		return m, ok
	case <-time.After(timeout):
		return zmq4.Msg{}, false
	}
}

func dialSub(t *testing.T, ep string) *receiver {
	t.Helper()
	sub := zmq4.NewSub(context.Background())
	if err := sub.Dial(ep); err != nil {
		sub.Close()
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	return newReceiver(t, sub)
}

// replayFrom asks rank's ROUTER for everything from start and returns the
// replies (seq, payload) and whether the end marker arrived. Frames are
// checked against the engine's reply framing.
func replayFrom(t *testing.T, ep string, start uint64, topicFrame bool, topic string) (seqs []uint64, payloads [][]byte, ended bool) {
	t.Helper()
	return replayWait(t, ep, start, topicFrame, topic, 2*time.Second)
}

// replayWait is replayFrom giving up after wait without a reply.
func replayWait(t *testing.T, ep string, start uint64, topicFrame bool, topic string, wait time.Duration) (seqs []uint64, payloads [][]byte, ended bool) {
	t.Helper()
	dealer := zmq4.NewDealer(context.Background())
	if err := dealer.Dial(ep); err != nil {
		dealer.Close()
		t.Fatal(err)
	}
	r := newReceiver(t, dealer)
	defer r.close()
	var s8 [8]byte
	binary.BigEndian.PutUint64(s8[:], start)
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, s8[:])); err != nil {
		t.Fatal(err)
	}
	want := 3
	if topicFrame {
		want = 4
	}
	for {
		m, ok := r.next(t, wait)
		if !ok {
			return seqs, payloads, false
		}
		f := m.Frames
		if len(f) != want {
			t.Fatalf("replay reply has %d frames, want %d: %q", len(f), want, f)
		}
		if len(f[0]) != 0 {
			t.Fatalf("replay reply's first frame is %q, want the empty delimiter", f[0])
		}
		seqFrame, payload := f[want-2], f[want-1]
		if len(seqFrame) != 8 {
			t.Fatalf("seq frame %x", seqFrame)
		}
		if bytes.Equal(seqFrame, endSeq) {
			if len(payload) != 0 || (topicFrame && len(f[1]) != 0) {
				t.Fatalf("end marker frames %q", f)
			}
			return seqs, payloads, true
		}
		if topicFrame && string(f[1]) != topic {
			t.Fatalf("replay topic frame %q, want %q", f[1], topic)
		}
		seqs = append(seqs, binary.BigEndian.Uint64(seqFrame))
		payloads = append(payloads, payload)
	}
}

// decodeBatch is a test-side decoder for the simulator's own output: it
// reads [ts, events(, rank)] with tag-first array or tagged map events and
// returns the rank (-1 when absent) and events. Tiers come from the medium.
func decodeBatch(t *testing.T, payload []byte, hostMedium string) (int, []prefixcache.Event) {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	v, err := d.DecodeInterfaceLoose()
	if err != nil {
		t.Fatal(err)
	}
	batch := v.([]any)
	rank := -1
	if len(batch) == 3 {
		rank = int(normalize(batch[2]).(uint64))
	}
	var out []prefixcache.Event
	for _, raw := range batch[1].([]any) {
		var tag string
		var field func(name string, slot int) any
		switch ev := raw.(type) {
		case []any:
			tag = ev[0].(string)
			field = func(_ string, slot int) any {
				if slot < len(ev) {
					return ev[slot]
				}
				return nil
			}
		case map[string]any:
			tag = ev["type"].(string)
			field = func(name string, _ int) any { return ev[name] }
		default:
			t.Fatalf("event %T", raw)
		}
		u64 := func(x any) uint64 {
			switch n := normalize(x).(type) {
			case uint64:
				return n
			case int64:
				return uint64(n)
			}
			t.Fatalf("not an integer: %#v", x)
			return 0
		}
		hashes := func(x any) []uint64 {
			var hs []uint64
			for _, h := range x.([]any) {
				hs = append(hs, u64(h))
			}
			return hs
		}
		tier := func(x any) prefixcache.Tier {
			if s, _ := x.(string); s == hostMedium && s != "" {
				return prefixcache.Host
			}
			return prefixcache.Device
		}
		switch tag {
		case "BlockStored":
			ev := prefixcache.BlockStored{Hashes: hashes(field("block_hashes", 1)), BlockSize: int(u64(field("block_size", 4))), Tier: tier(field("medium", 6))}
			if p := field("parent_block_hash", 2); p != nil {
				ev.Parent, ev.HasParent = u64(p), true
			}
			for _, tok := range field("token_ids", 3).([]any) {
				ev.Tokens = append(ev.Tokens, uint32(u64(tok)))
			}
			out = append(out, ev)
		case "BlockRemoved":
			out = append(out, prefixcache.BlockRemoved{Hashes: hashes(field("block_hashes", 1)), Tier: tier(field("medium", 2))})
		case "AllBlocksCleared":
			out = append(out, prefixcache.AllBlocksCleared{})
		default:
			t.Fatalf("unknown tag %q", tag)
		}
	}
	return rank, out
}

// liveModel applies decoded events, counting copies per (tier, hash), the
// way a relay keeps its record.
func liveModel(t *testing.T, m map[prefixcache.LiveKey]int, evs []prefixcache.Event) map[prefixcache.LiveKey]int {
	t.Helper()
	for _, ev := range evs {
		switch ev := ev.(type) {
		case prefixcache.BlockStored:
			for _, h := range ev.Hashes {
				m[prefixcache.LiveKey{Tier: ev.Tier, Hash: h}]++
			}
		case prefixcache.BlockRemoved:
			for _, h := range ev.Hashes {
				k := prefixcache.LiveKey{Tier: ev.Tier, Hash: h}
				if m[k] == 0 {
					t.Fatalf("removal of %v, which is not live", k)
				}
				if m[k]--; m[k] == 0 {
					delete(m, k)
				}
			}
		case prefixcache.AllBlocksCleared:
			clear(m)
		}
	}
	return m
}

func liveMap(bs []prefixcache.LiveBlock) map[prefixcache.LiveKey]int {
	m := map[prefixcache.LiveKey]int{}
	for _, b := range bs {
		m[prefixcache.LiveKey{Tier: b.Tier, Hash: b.Hash}] = b.Copies
	}
	return m
}

type zmqMsg = zmq4.Msg

func toks(from, n uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

func itoa(n int) string { return fmt.Sprint(n) }
