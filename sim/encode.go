package sim

import (
	"bytes"
	"fmt"
	"sort"
	"strings"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// wireFormat is one engine's publisher output in one wire generation. The
// encoders write msgpack by hand so the bytes equal what the engine's msgspec
// structs produce: tagged maps put "type" first and then the declared fields
// in order, omitting defaulted fields equal to their default (omit_defaults);
// tag-first arrays write every field, defaults included (msgspec ignores
// omit_defaults for array_like structs).
type wireFormat struct {
	engine, gen string
	// batchRank is false for the oldest envelopes, [ts, events] without a
	// rank slot.
	batchRank bool
	// signedHashes writes hashes as int64 (SGLang); the others write uint64.
	signedHashes bool
	// medium names per tier; an empty name means the generation has no
	// medium field, so the tier cannot be reported.
	deviceMedium, hostMedium string
	stored                   func(w *wireWriter, ev prefixcache.BlockStored) error
	removed                  func(w *wireWriter, ev prefixcache.BlockRemoved) error
	cleared                  func(w *wireWriter) error
}

// Wire generations, newest first per engine; the first is the default.
var wireFormats = map[string][]*wireFormat{
	"vllm": {
		{engine: "vllm", gen: "map", batchRank: true, deviceMedium: "GPU", hostMedium: "CPU",
			stored: vllmMapStored, removed: vllmMapRemoved, cleared: mapCleared},
		{engine: "vllm", gen: "array12", batchRank: true, deviceMedium: "GPU", hostMedium: "CPU",
			stored: vllmArray12Stored, removed: vllmArray12Removed, cleared: arrayCleared},
		{engine: "vllm", gen: "array6", batchRank: false,
			stored: array6Stored, removed: array2Removed, cleared: arrayCleared},
	},
	"sglang": {
		{engine: "sglang", gen: "map", batchRank: true, signedHashes: true, deviceMedium: "GPU", hostMedium: "CPU_PINNED",
			stored: sglangMapStored, removed: sglangMapRemoved, cleared: mapCleared},
		{engine: "sglang", gen: "array7", batchRank: true, signedHashes: true, deviceMedium: "GPU", hostMedium: "CPU_TIER1",
			stored: sglangArray7Stored, removed: sglangArray3Removed, cleared: arrayCleared},
		{engine: "sglang", gen: "array6", batchRank: false, signedHashes: true,
			stored: array6Stored, removed: array2Removed, cleared: arrayCleared},
	},
	"tokenspeed": {
		{engine: "tokenspeed", gen: "array5", batchRank: true,
			stored: tokenspeedStored, removed: array2Removed, cleared: arrayCleared},
	},
}

// WireGenerations lists the --wire values an engine accepts, the default
// (newest) first.
func WireGenerations(engine string) []string {
	var out []string
	for _, f := range wireFormats[engine] {
		out = append(out, f.gen)
	}
	return out
}

func lookupWire(engine, gen string) (*wireFormat, error) {
	fs, ok := wireFormats[engine]
	if !ok {
		names := make([]string, 0, len(wireFormats))
		for n := range wireFormats {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("unknown engine %q (want one of %s)", engine, strings.Join(names, ", "))
	}
	if gen == "" {
		return fs[0], nil
	}
	for _, f := range fs {
		if f.gen == gen {
			return f, nil
		}
	}
	return nil, fmt.Errorf("engine %s has no wire generation %q (want one of %s)", engine, gen, strings.Join(WireGenerations(engine), ", "))
}

func (f *wireFormat) medium(t prefixcache.Tier) string {
	if t == prefixcache.Host {
		return f.hostMedium
	}
	return f.deviceMedium
}

// wireWriter is an msgpack encoder bound to one format.
type wireWriter struct {
	*msgpack.Encoder
	f *wireFormat
}

// encodeBatch encodes one published batch: [ts, events, rank] (or
// [ts, events] for the oldest generations).
func (f *wireFormat) encodeBatch(ts float64, events []prefixcache.Event, rank int) ([]byte, error) {
	var buf bytes.Buffer
	w := &wireWriter{Encoder: msgpack.NewEncoder(&buf), f: f}
	n := 2
	if f.batchRank {
		n = 3
	}
	if err := w.EncodeArrayLen(n); err != nil {
		return nil, err
	}
	if err := w.EncodeFloat64(ts); err != nil {
		return nil, err
	}
	if err := w.EncodeArrayLen(len(events)); err != nil {
		return nil, err
	}
	for _, ev := range events {
		if err := f.encodeEvent(w, ev); err != nil {
			return nil, err
		}
	}
	if f.batchRank {
		if err := w.EncodeInt(int64(rank)); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

func (f *wireFormat) encodeEvent(w *wireWriter, ev prefixcache.Event) error {
	switch ev := ev.(type) {
	case prefixcache.BlockStored:
		return f.stored(w, ev)
	case prefixcache.BlockRemoved:
		return f.removed(w, ev)
	case prefixcache.AllBlocksCleared:
		return f.cleared(w)
	}
	return fmt.Errorf("sim: cannot encode event %T", ev)
}

// errWriter chains encoder calls and keeps the first error, so the
// field-by-field encoders read as the field lists they implement.
type errWriter struct {
	w   *wireWriter
	err error
}

func (e *errWriter) do(f func() error) {
	if e.err == nil {
		e.err = f()
	}
}
func (e *errWriter) str(s string)  { e.do(func() error { return e.w.EncodeString(s) }) }
func (e *errWriter) nil()          { e.do(e.w.EncodeNil) }
func (e *errWriter) uint(v uint64) { e.do(func() error { return e.w.EncodeUint(v) }) }
func (e *errWriter) int(v int64)   { e.do(func() error { return e.w.EncodeInt(v) }) }
func (e *errWriter) arr(n int)     { e.do(func() error { return e.w.EncodeArrayLen(n) }) }
func (e *errWriter) mapl(n int)    { e.do(func() error { return e.w.EncodeMapLen(n) }) }
func (e *errWriter) key(k string)  { e.str(k) }

func (e *errWriter) hash(h uint64) {
	if e.w.f.signedHashes {
		e.int(int64(h))
	} else {
		e.uint(h)
	}
}

func (e *errWriter) hashes(hs []uint64) {
	e.arr(len(hs))
	for _, h := range hs {
		e.hash(h)
	}
}

func (e *errWriter) parent(ev prefixcache.BlockStored) {
	if ev.HasParent {
		e.hash(ev.Parent)
	} else {
		e.nil()
	}
}

func (e *errWriter) tokens(ts []uint32) {
	e.arr(len(ts))
	for _, t := range ts {
		e.uint(uint64(t))
	}
}

func (e *errWriter) mediumOf(t prefixcache.Tier) {
	m := e.w.f.medium(t)
	if m == "" {
		e.err = fmt.Errorf("sim: %s wire %s has no medium field for the %s tier", e.w.f.engine, e.w.f.gen, t)
		return
	}
	e.str(m)
}

// extraKeys writes vLLM's per-block extra_keys: one None per block, since
// simulated requests carry no LoRA, salt or multimodal input.
func (e *errWriter) extraKeys(n int) {
	e.arr(n)
	for i := 0; i < n; i++ {
		e.nil()
	}
}

const fullAttention = "full_attention"

// vLLM after #42892: BlockStored map with the fields a GPU store carries
// (lora_id, medium and lora_name have no default and are always present;
// extra_keys, group_idx and kv_cache_spec_kind are set; the sliding window,
// locality, ownership and session_id stay at their None default).
func vllmMapStored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	e.mapl(11)
	e.key("type")
	e.str("BlockStored")
	e.key("block_hashes")
	e.hashes(ev.Hashes)
	e.key("parent_block_hash")
	e.parent(ev)
	e.key("token_ids")
	e.tokens(ev.Tokens)
	e.key("block_size")
	e.int(int64(ev.BlockSize))
	e.key("lora_id")
	e.nil()
	e.key("medium")
	e.mediumOf(ev.Tier)
	e.key("lora_name")
	e.nil()
	e.key("extra_keys")
	e.extraKeys(len(ev.Hashes))
	e.key("group_idx")
	e.uint(0)
	e.key("kv_cache_spec_kind")
	e.str(fullAttention)
	return e.err
}

func vllmMapRemoved(w *wireWriter, ev prefixcache.BlockRemoved) error {
	e := &errWriter{w: w}
	e.mapl(4)
	e.key("type")
	e.str("BlockRemoved")
	e.key("block_hashes")
	e.hashes(ev.Hashes)
	e.key("medium")
	e.mediumOf(ev.Tier)
	e.key("group_idx")
	e.uint(0)
	return e.err
}

// vLLM's last array era (≤ v0.23): 12-element BlockStored, 4-element
// BlockRemoved.
func vllmArray12Stored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	e.arr(12)
	e.str("BlockStored")
	e.hashes(ev.Hashes)
	e.parent(ev)
	e.tokens(ev.Tokens)
	e.int(int64(ev.BlockSize))
	e.nil() // lora_id
	e.mediumOf(ev.Tier)
	e.nil() // lora_name
	e.extraKeys(len(ev.Hashes))
	e.uint(0) // group_idx
	e.str(fullAttention)
	e.nil() // kv_cache_spec_sliding_window
	return e.err
}

func vllmArray12Removed(w *wireWriter, ev prefixcache.BlockRemoved) error {
	e := &errWriter{w: w}
	e.arr(4)
	e.str("BlockRemoved")
	e.hashes(ev.Hashes)
	e.mediumOf(ev.Tier)
	e.uint(0)
	return e.err
}

// The oldest vLLM (#16750) and SGLang events: no medium, so only device
// blocks can be reported.
func array6Stored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	if ev.Tier != prefixcache.Device {
		return fmt.Errorf("sim: %s wire %s has no medium field for the %s tier", w.f.engine, w.f.gen, ev.Tier)
	}
	e.arr(6)
	e.str("BlockStored")
	e.hashes(ev.Hashes)
	e.parent(ev)
	e.tokens(ev.Tokens)
	e.int(int64(ev.BlockSize))
	e.nil() // lora_id
	return e.err
}

func array2Removed(w *wireWriter, ev prefixcache.BlockRemoved) error {
	e := &errWriter{w: w}
	if ev.Tier != prefixcache.Device {
		return fmt.Errorf("sim: %s wire %s has no medium field for the %s tier", w.f.engine, w.f.gen, ev.Tier)
	}
	e.arr(2)
	e.str("BlockRemoved")
	e.hashes(ev.Hashes)
	return e.err
}

// SGLang after #37482: lora_id has no default (always nil in radix events);
// medium, cache_salt and session_id default to None, and only medium is set.
func sglangMapStored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	e.mapl(7)
	e.key("type")
	e.str("BlockStored")
	e.key("block_hashes")
	e.hashes(ev.Hashes)
	e.key("parent_block_hash")
	e.parent(ev)
	e.key("token_ids")
	e.tokens(ev.Tokens)
	e.key("block_size")
	e.int(int64(ev.BlockSize))
	e.key("lora_id")
	e.nil()
	e.key("medium")
	e.mediumOf(ev.Tier)
	return e.err
}

func sglangMapRemoved(w *wireWriter, ev prefixcache.BlockRemoved) error {
	e := &errWriter{w: w}
	e.mapl(3)
	e.key("type")
	e.str("BlockRemoved")
	e.key("block_hashes")
	e.hashes(ev.Hashes)
	e.key("medium")
	e.mediumOf(ev.Tier)
	return e.err
}

// SGLang's medium era (#18205): 7-element BlockStored, 3-element
// BlockRemoved.
func sglangArray7Stored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	e.arr(7)
	e.str("BlockStored")
	e.hashes(ev.Hashes)
	e.parent(ev)
	e.tokens(ev.Tokens)
	e.int(int64(ev.BlockSize))
	e.nil() // lora_id
	e.mediumOf(ev.Tier)
	return e.err
}

func sglangArray3Removed(w *wireWriter, ev prefixcache.BlockRemoved) error {
	e := &errWriter{w: w}
	e.arr(3)
	e.str("BlockRemoved")
	e.hashes(ev.Hashes)
	e.mediumOf(ev.Tier)
	return e.err
}

// TokenSpeed: 5-element BlockStored without lora_id or medium.
func tokenspeedStored(w *wireWriter, ev prefixcache.BlockStored) error {
	e := &errWriter{w: w}
	if ev.Tier != prefixcache.Device {
		return fmt.Errorf("sim: tokenspeed has no medium field for the %s tier", ev.Tier)
	}
	e.arr(5)
	e.str("BlockStored")
	e.hashes(ev.Hashes)
	e.parent(ev)
	e.tokens(ev.Tokens)
	e.int(int64(ev.BlockSize))
	return e.err
}

func mapCleared(w *wireWriter) error {
	e := &errWriter{w: w}
	e.mapl(1)
	e.key("type")
	e.str("AllBlocksCleared")
	return e.err
}

func arrayCleared(w *wireWriter) error {
	e := &errWriter{w: w}
	e.arr(1)
	e.str("AllBlocksCleared")
	return e.err
}
