package relay

import (
	"context"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// What the newest engine releases changed on the wire, each sent by the
// release's own publisher module and checked in what kvrelay relays and in
// its record.

// releaseRig is a relay following one rank of a release's own publisher.
type releaseRig struct {
	t    *testing.T
	peer *enginepeer.Peer
	r    *Relay
	l    *lab
	reg  *prometheus.Registry
	sub  *Subscription
	last uint64
}

func startReleaseRig(t *testing.T, engine string) *releaseRig {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	rel, err := enginepeer.ReleaseOf(engine)
	if err != nil {
		t.Fatal(err)
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: engine, Release: rel})
	kv := engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0), HWM: engines.DefaultHWM}
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine:        exactnessEngines[engine],
		KV:            kv,
		DPSize:        1,
		ReplayTimeout: time.Second, // see interopEngineDrill
		PrimeRetry:    50 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    reg,
		Transport:     zmqTransport(kv.Topic, kv.HWM, zmqLimits{}, quietLogger()),
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("the rank connected", r.Ready)
	rig := &releaseRig{t: t, peer: peer, r: r, l: l, reg: reg}
	// A marker batch to resume after (start_sequence_number is the last
	// batch applied, 0 the whole history), so the stream read below starts
	// after whatever the engine published at startup (SGLang's clear).
	marker := rig.publish()
	rig.sub = l.subscribe(marker)
	if marker == 0 {
		if b := next(t, rig.sub); b.GetSequenceNumber() != marker {
			t.Fatalf("subscribed at %d, got %s first", marker, describe(b))
		}
	}
	return rig
}

// publish sends one batch and waits until the relay has it.
func (g *releaseRig) publish(evs ...enginepeer.Event) uint64 {
	g.t.Helper()
	pub, err := g.peer.Publish(0, evs...)
	if err != nil {
		g.t.Fatal(err)
	}
	g.last = pub.Seq
	g.l.cursor(0, pub.Seq)
	return pub.Seq
}

// relayed publishes one batch and returns what the relay sent for it.
func (g *releaseRig) relayed(evs ...enginepeer.Event) *kvpb.KvEventBatch {
	g.t.Helper()
	seq := g.publish(evs...)
	b := next(g.t, g.sub)
	if b.GetSequenceNumber() != seq {
		g.t.Fatalf("relayed %s, want sequence %d", describe(b), seq)
	}
	return b
}

// record is the rank's live set in the relay's snapshot.
func (g *releaseRig) record() map[exactKey]int {
	return snapshotLiveSet(g.r.Snapshot())[0]
}

func (g *releaseRig) expectRecord(phase string, want map[exactKey]int) {
	g.t.Helper()
	if got := g.record(); !maps.Equal(got, want) {
		g.t.Fatalf("%s: the record differs from what the engine stored: %s", phase, describeDiff(got, want))
	}
}

func (g *releaseRig) drops(reason string) float64 {
	return counter(g.r.metrics.drops.WithLabelValues(reason))
}

func strp(s string) *string { return &s }

// firstEventIsMap reports whether the first event in a batch payload
// [ts, [events...], rank] is a msgpack map (a tagged-map event) rather than
// a tag-first array. Only fix-size headers occur in these small batches.
func firstEventIsMap(t *testing.T, payload []byte) bool {
	t.Helper()
	// 0x93: a 3-element array; then a float64 ts (0xcb + 8 bytes); then the
	// events array header (0x9N); then the first event.
	if len(payload) < 12 || payload[0] != 0x93 || payload[1] != 0xcb || payload[10]&0xf0 != 0x90 {
		t.Fatalf("unexpected batch layout % x", payload[:min(len(payload), 16)])
	}
	return payload[11]&0xf0 == 0x80 || payload[11] == 0xde || payload[11] == 0xdf // fixmap, map16, map32
}

const (
	tierDevice   = uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE)
	tierHost     = uint8(kvpb.KvCacheTier_KV_CACHE_TIER_HOST)
	tierDisk     = uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DISK)
	tierExternal = uint8(kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL)
)

// SGLang 0.5.23 sends tagged-map events and names its media GPU,
// CPU_PINNED, DISK and EXTERNAL (StorageMedium): each lands on its tier,
// in the stream and in the record, and removals on a tier leave the others.
func TestEngineReleaseSGLangTaggedMapsAndMedia(t *testing.T) {
	g := startReleaseRig(t, enginepeer.SGLang)
	media := []struct {
		medium string
		tier   kvpb.KvCacheTier
	}{
		{"GPU", kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE},
		{"CPU_PINNED", kvpb.KvCacheTier_KV_CACHE_TIER_HOST},
		{"DISK", kvpb.KvCacheTier_KV_CACHE_TIER_DISK},
		{"EXTERNAL", kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL},
	}
	var evs []enginepeer.Event
	for i, m := range media {
		ev := enginepeer.Stored(nil, []int64{int64(i), int64(i) + 1}, enginepeer.I64(-100-int64(i)))
		ev.Medium = strp(m.medium)
		evs = append(evs, ev)
	}
	b := g.relayed(evs...)
	payload, err := g.peer.RingPayload(0, b.GetSequenceNumber())
	if err != nil {
		t.Fatal(err)
	}
	if !firstEventIsMap(t, payload) {
		t.Fatalf("SGLang 0.5.23's own publisher did not send tagged maps: % x", payload[:16])
	}
	if len(b.GetEvents()) != len(media) {
		t.Fatalf("relayed %d events, want %d: %s", len(b.GetEvents()), len(media), describe(b))
	}
	for i, m := range media {
		s := b.GetEvents()[i].GetStored()
		if s.GetTier() != m.tier || s.GetMedium() != m.medium {
			t.Errorf("medium %s relayed as tier %v medium %q, want %v", m.medium, s.GetTier(), s.GetMedium(), m.tier)
		}
	}
	g.expectRecord("stored on four media", map[exactKey]int{
		{tierDevice, uint64(1<<64 - 100)}: 1, {tierHost, uint64(1<<64 - 101)}: 1,
		{tierDisk, uint64(1<<64 - 102)}: 1, {tierExternal, uint64(1<<64 - 103)}: 1,
	})
	rmHost, rmDisk := enginepeer.Removed(enginepeer.I64(-101)), enginepeer.Removed(enginepeer.I64(-102))
	rmHost.Medium, rmDisk.Medium = strp("CPU_PINNED"), strp("DISK")
	g.relayed(rmHost, rmDisk)
	g.expectRecord("removed from host and disk", map[exactKey]int{
		{tierDevice, uint64(1<<64 - 100)}: 1, {tierExternal, uint64(1<<64 - 103)}: 1,
	})
	if d := g.drops("unknown_medium"); d != 0 {
		t.Errorf("%v events dropped as unknown_medium", d)
	}
}

// SGLang 0.5.23 publishes hashes already namespaced by extra_key and
// cache_salt (its own namespaced_block_hash); one prefix under two tenants'
// salts is two blocks, kept apart, each with its salt on the stream, and a
// removal under one namespace leaves the other.
func TestEngineReleaseSGLangNamespacedHashes(t *testing.T) {
	g := startReleaseRig(t, enginepeer.SGLang)
	const raw = 4242
	spaces := []struct{ extraKey, salt *string }{
		{nil, nil}, {nil, strp("tenant-a")}, {nil, strp("tenant-b")}, {strp("lora-x"), strp("tenant-a")},
	}
	want := map[exactKey]int{}
	var hashes []int64
	for _, ns := range spaces {
		h, err := g.peer.NamespacedHash(raw, ns.extraKey, ns.salt)
		if err != nil {
			t.Fatal(err)
		}
		hashes = append(hashes, h)
		want[exactKey{tierDevice, uint64(h)}] = 1
		ev := enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.I64(h))
		if ns.salt != nil {
			ev.Fields = map[string]any{"cache_salt": *ns.salt}
		}
		b := g.relayed(ev)
		s := b.GetEvents()[0].GetStored()
		if got := s.GetCacheSalt(); (ns.salt == nil && s.CacheSalt != nil) || (ns.salt != nil && got != *ns.salt) {
			t.Errorf("namespace %v: relayed cache_salt %v", ns, s.CacheSalt)
		}
	}
	if len(want) != len(spaces) {
		t.Fatalf("SGLang's namespacing gave colliding hashes %v", hashes)
	}
	if hashes[0] != raw {
		t.Fatalf("no namespace changed the hash to %d", hashes[0])
	}
	g.expectRecord("one prefix under four namespaces", want)
	g.relayed(enginepeer.Removed(enginepeer.I64(hashes[1])))
	delete(want, exactKey{tierDevice, uint64(hashes[1])})
	g.expectRecord("tenant-a's copy evicted", want)
}

// vLLM 0.33's BlockStored carries extra_keys, group_idx,
// kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership,
// session_id and lookahead_token_ids. What SMG's stream has a field for is
// relayed; lookahead_token_ids has none and must not disturb decoding.
// Placeholder stores (a lower tier without self_describing_kv_events:
// token_ids empty, block_size 0) are dropped and counted, the rest of
// their batch kept; remote and residency-agent stores are dropped as SMG
// drops them; a window group's store is dropped beside a full-attention one.
func TestEngineReleaseVLLM033Fields(t *testing.T) {
	g := startReleaseRig(t, enginepeer.VLLM)
	full := enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(1<<63+5), enginepeer.U64(6))
	full.Fields = map[string]any{
		"extra_keys":          []any{[]any{"salt-1"}, nil},
		"group_idx":           0,
		"kv_cache_spec_kind":  "full_attention",
		"locality":            "LOCAL",
		"session_id":          "session-9",
		"lookahead_token_ids": [][]int{{7, 8}, {9, 10}},
	}
	window := enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(7))
	window.Fields = map[string]any{"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128}
	remote := enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(8))
	remote.Fields = map[string]any{"locality": "REMOTE"}
	agent := enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(9))
	agent.Fields = map[string]any{"ownership": "kvcr"}
	// CPU offload without self_describing_kv_events: one placeholder per
	// offload key, no tokens, block size 0, no parent.
	placeholder := enginepeer.Stored(nil, nil, enginepeer.U64(10), enginepeer.U64(11))
	placeholder.Medium = strp("CPU")
	// With it, the offload store describes itself and lands on the host tier.
	offloaded := enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(12), enginepeer.U64(13))
	offloaded.Medium = strp("CPU")

	drops := map[string]float64{}
	for _, reason := range []string{"placeholder", "non_local_locality", "unsupported_ownership", "non_main_attention_group"} {
		drops[reason] = g.drops(reason)
	}
	b := g.relayed(window, full, remote, agent, placeholder, offloaded)
	payload, err := g.peer.RingPayload(0, b.GetSequenceNumber())
	if err != nil {
		t.Fatal(err)
	}
	if !firstEventIsMap(t, payload) {
		t.Fatalf("vLLM 0.33's own publisher did not send tagged maps: % x", payload[:16])
	}
	if n := len(b.GetEvents()); n != 2 {
		t.Fatalf("relayed %d events, want the full-attention store and the offloaded one: %s", n, describe(b))
	}
	s := b.GetEvents()[0].GetStored()
	if s.GetGroupIdx() != 0 || s.GroupIdx == nil || s.GetKvCacheSpecKind() != "full_attention" ||
		s.GetLocality() != kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL || s.GetSessionId() != "session-9" ||
		s.GetCacheSalt() != "salt-1" {
		t.Errorf("vLLM 0.33 store relayed as %v", s)
	}
	if blocks := s.GetBlocks(); len(blocks) != 2 || blocks[0].GetBlockHash() != -(1<<63)+5 ||
		len(blocks[0].GetExtraKeys()) != 1 || blocks[0].GetExtraKeys()[0].GetText() != "salt-1" || len(blocks[1].GetExtraKeys()) != 0 {
		t.Errorf("blocks relayed as %v", s.GetBlocks())
	}
	if h := b.GetEvents()[1].GetStored(); h.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_HOST || len(h.GetBlocks()) != 2 {
		t.Errorf("self-describing offload store relayed as %v", h)
	}
	// The relay counts a batch's drops after it hands the batch to its
	// subscribers, so the counters may trail the batch just read.
	deadline := time.Now().Add(patience)
	for reason, n := range map[string]float64{"placeholder": 1, "non_local_locality": 1, "unsupported_ownership": 1, "non_main_attention_group": 1} {
		for g.drops(reason)-drops[reason] < n && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if got := g.drops(reason) - drops[reason]; got < n {
			t.Errorf("%s drops went up by %v, want at least %v", reason, got, n)
		}
	}
	g.expectRecord("after the mixed batch", map[exactKey]int{
		{tierDevice, 1<<63 + 5}: 1, {tierDevice, 6}: 1, {tierHost, 12}: 1, {tierHost, 13}: 1,
	})

	// KV-group granularity (hash_block_size 2 under 4-token pages): a
	// partial page is stored as one 2-token block and replaced (removed,
	// then stored at the page) as it fills. The record follows, and the
	// stream keeps each store's own block size.
	partial := enginepeer.Stored(nil, []int64{21, 22}, enginepeer.U64(30))
	partial.BlockSize = 2
	b = g.relayed(partial)
	if bs := b.GetEvents()[0].GetStored().GetBlocks()[0].GetBlockSize(); bs != 2 {
		t.Fatalf("partial page relayed with block size %d, want 2", bs)
	}
	page := enginepeer.Stored(nil, []int64{21, 22, 23, 24}, enginepeer.U64(31))
	g.relayed(enginepeer.Removed(enginepeer.U64(30)), page)
	g.expectRecord("partial page promoted", map[exactKey]int{
		{tierDevice, 1<<63 + 5}: 1, {tierDevice, 6}: 1, {tierHost, 12}: 1, {tierHost, 13}: 1, {tierDevice, 31}: 1,
	})
}

// vLLM 0.33+ binds tcp://*:0 to a port the OS picks for each rank (#55844)
// and reports the bound endpoints only in its process
// (get_publisher_config). The fact behind kvrelay refusing port 0: the
// ranks' ports are not base + rank, and the relay reaches a rank at the
// endpoint the engine reported.
func TestEngineReleaseVLLMOSAssignedPorts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	rel, err := enginepeer.ReleaseOf(enginepeer.VLLM)
	if err != nil {
		t.Fatal(err)
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, Release: rel, DPSize: 2, OSPorts: true,
		Endpoint: "tcp://*:0", ReplayEndpoint: "tcp://*:0"})
	ranks := peer.Ranks()
	ports := map[string]bool{}
	for _, rk := range ranks {
		rep := rk.Reported
		if rep == nil || !strings.HasPrefix(rep.Pub, "tcp://127.0.0.1:") || strings.HasSuffix(rep.Pub, ":0") ||
			!strings.HasPrefix(rep.Replay, "tcp://127.0.0.1:") || strings.HasSuffix(rep.Replay, ":0") {
			t.Fatalf("rank %d: vLLM reported %+v, want OS-assigned loopback ports", rk.Rank, rep)
		}
		ports[rep.Pub], ports[rep.Replay] = true, true
	}
	if len(ports) != 4 {
		t.Fatalf("the two ranks' four sockets share ports: %+v", ranks)
	}
	if _, err := engines.ConnectEndpoint("tcp://*:0", 1); err == nil {
		t.Fatal("kvrelay would dial port 0 for rank 1")
	}
	// Rank 1 followed at the endpoints vLLM reported for it.
	kv := engines.Config{Enabled: true, Endpoint: ranks[1].Reported.Pub, ReplayEndpoint: ranks[1].Reported.Replay, HWM: engines.DefaultHWM}
	r, err := New(Config{Engine: exactnessEngines[enginepeer.VLLM], KV: kv, DPSize: 1, ReplayTimeout: time.Second,
		PrimeRetry: 50 * time.Millisecond, Logger: quietLogger(), Registerer: prometheus.NewRegistry(),
		Transport: zmqTransport(kv.Topic, kv.HWM, zmqLimits{}, quietLogger())})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	pub, err := peer.Publish(1, enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(77)))
	if err != nil {
		t.Fatal(err)
	}
	l := &lab{t: t, r: r}
	l.cursor(0, pub.Seq)
	if got := snapshotLiveSet(r.Snapshot())[0]; !maps.Equal(got, map[exactKey]int{{tierDevice, 77}: 1}) {
		t.Fatalf("record %v, want rank 1's block 77", got)
	}
}
