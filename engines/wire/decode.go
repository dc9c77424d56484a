package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrUndecodable marks a payload whose envelope is not a KV event batch, or
// whose msgpack is truncated or invalid: nothing in it can be trusted.
var ErrUndecodable = errors.New("undecodable KV event batch")

// errTruncated and errInvalidCode are structural failures: the payload's
// msgpack cannot be walked past them, so the whole batch is undecodable.
var (
	errTruncated   = errors.New("msgpack truncated")
	errInvalidCode = errors.New("msgpack reserved code 0xc1")
)

type eventKind uint8

const (
	kindMalformed eventKind = iota
	kindUnknown
	kindStored
	kindRemoved
	kindCleared
)

type optString struct {
	s  string
	ok bool
}

type optU32 struct {
	v  uint32
	ok bool
}

type optI64 struct {
	v  int64
	ok bool
}

// fieldState records whether a required field was present and readable.
type fieldState uint8

const (
	fieldAbsent fieldState = iota
	fieldOK
	fieldBad
)

type extraKeyKind uint8

const (
	extraText extraKeyKind = iota + 1
	extraNumber
	extraBlob
	extraMultimodal
)

// extraKey is one item of vLLM's untagged per-block extra_keys. For a
// multimodal key, text is the identifier and num the offset.
type extraKey struct {
	kind extraKeyKind
	text string
	num  int64
	blob []byte
}

// wireEvent is one decoded event before normalization. Hashes and tokens are
// ranges into the decoder's per-batch slabs, so decoding a batch allocates
// nothing per block.
type wireEvent struct {
	index   int // position in the batch's event list
	kind    eventKind
	missing string // the unreadable field of a malformed event

	tag       fieldState
	hashState fieldState
	hashOff   int
	hashN     int
	tokState  fieldState
	tokOff    int
	tokN      int
	bigram    bool
	sizeState fieldState
	blockSize int64

	parent    optI64
	loraID    optI64
	loraName  optString
	cacheSalt optString
	medium    optString
	specKind  optString
	locality  optString
	ownership optString
	sessionID optString
	groupIdx  optU32
	window    optU32
	// extraKeys is nil when absent; one entry per block, nil for a block
	// without keys. Unmodelled items are dropped at decode.
	extraKeys [][]extraKey
}

// fieldID names what a map key or an array slot holds.
type fieldID uint8

const (
	fSkip fieldID = iota
	fType
	fHashes
	fParent
	fTokens
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	fExtraKeys
	fGroup
	fKind
	fWindow
	fLocality
	fOwnership
	fSession
	fCacheSalt
	fSGLangSlot7
)

// Array layouts: the slots after the tag, in the order the engines' msgspec
// structs declare their fields. Missing trailing slots read as absent and
// extra ones are skipped, so every schema generation shares one table
// (TokenSpeed's 5-element store is a prefix of it).
var (
	storedSlots = [...]fieldID{fHashes, fParent, fTokens, fBlockSize, fLoraID, fMedium,
		fLoraName, fExtraKeys, fGroup, fKind, fWindow, fLocality, fOwnership, fSession}
	removedSlots = [...]fieldID{fHashes, fMedium, fGroup, fLocality, fOwnership}
	clearedSlots = [...]fieldID{fOwnership}
)

func mapField(key []byte) fieldID {
	switch string(key) {
	case "type":
		return fType
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoraID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoraName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroup
	case "kv_cache_spec_kind":
		return fKind
	case "kv_cache_spec_sliding_window":
		return fWindow
	case "locality":
		return fLocality
	case "ownership":
		return fOwnership
	case "session_id":
		return fSession
	case "cache_salt":
		return fCacheSalt
	}
	return fSkip
}

func tagKind(tag []byte) eventKind {
	switch string(tag) {
	case "BlockStored":
		return kindStored
	case "BlockRemoved":
		return kindRemoved
	case "AllBlocksCleared":
		return kindCleared
	}
	return kindUnknown
}

// decoder walks one payload at a time. It is reused across batches: the
// event slice, the hash and token slabs and the string intern table keep
// their memory, so steady-state decoding allocates only for strings it has
// not seen before and for extra keys.
type decoder struct {
	dialect Dialect
	p       []byte
	r       bytes.Reader
	d       *msgpack.Decoder

	events []wireEvent
	hashes []int64
	tokens []uint32
	// keys and keyLists hold extra keys and the per-block lists of them.
	keys     []extraKey
	keyLists [][]extraKey
	intern   map[string]string
	// lastIntern is the string internString returned last.
	lastIntern string

	ts      float64
	rank    int32
	hasRank bool

	total     int // events in the batch, forwardable or not
	unknown   int
	malformed int
	// skipped remembers the first few unknown or malformed events, for the
	// debug log only.
	skipped []skippedEvent
}

type skippedEvent struct {
	index   int
	kind    eventKind
	missing string
}

const skippedKept = 3

func (x *decoder) noteSkipped(ev wireEvent) {
	if len(x.skipped) < 2*skippedKept {
		x.skipped = append(x.skipped, skippedEvent{index: ev.index, kind: ev.kind, missing: ev.missing})
	}
}

const (
	internMaxEntries = 4096
	internMaxLen     = 128
)

func newDecoder(d Dialect) *decoder {
	dec := &decoder{dialect: d, intern: make(map[string]string)}
	dec.d = msgpack.NewDecoder(&dec.r)
	return dec
}

func (x *decoder) pos() int { return int(x.r.Size()) - x.r.Len() }

func (x *decoder) remaining() int { return x.r.Len() }

func (x *decoder) seek(pos int) { _, _ = x.r.Seek(int64(pos), io.SeekStart) }

// undecodable wraps a structural failure with the byte offset it happened at.
func (x *decoder) undecodable(at int, format string, args ...any) error {
	return fmt.Errorf("%w: at byte %d: %s", ErrUndecodable, at, fmt.Sprintf(format, args...))
}

// structural turns an error from the msgpack library or from a guard into
// the package's error; io errors mean the payload ended early.
func (x *decoder) structural(at int, what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err = errTruncated
	}
	return x.undecodable(at, "%s: %v", what, err)
}

// peek returns the next value's msgpack code without consuming it. It reads
// the payload directly: Decoder.PeekCode costs two interface calls, and
// this runs once per value.
func (x *decoder) peek() (byte, error) {
	at := x.pos()
	if at >= len(x.p) {
		return 0, x.undecodable(at, "reading a value: %v", errTruncated)
	}
	return x.p[at], nil
}

// skip passes over one value of any shape. It is iterative, not recursive,
// so a hostile payload of deeply nested arrays cannot exhaust the stack.
func (x *decoder) skip() error {
	at := x.pos()
	end, err := skipAt(x.p, at)
	if err != nil {
		return x.structural(at, "skipping a value", err)
	}
	x.seek(end)
	return nil
}

func skipAt(p []byte, pos int) (int, error) {
	pending := 1
	for pending > 0 {
		if pos >= len(p) {
			return pos, errTruncated
		}
		c := p[pos]
		pos++
		pending--
		var body, items int
		var ok bool
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		case c <= 0x8f:
			items = 2 * int(c&0x0f)
		case c <= 0x9f:
			items = int(c & 0x0f)
		case c <= 0xbf:
			body = int(c & 0x1f)
		case c == 0xc1:
			return pos - 1, errInvalidCode
		case c == 0xc4, c == 0xd9:
			body, pos, ok = lenAt(p, pos, 1)
		case c == 0xc5, c == 0xda:
			body, pos, ok = lenAt(p, pos, 2)
		case c == 0xc6, c == 0xdb:
			body, pos, ok = lenAt(p, pos, 4)
		case c == 0xc7:
			body, pos, ok = lenAt(p, pos, 1)
			body++
		case c == 0xc8:
			body, pos, ok = lenAt(p, pos, 2)
			body++
		case c == 0xc9:
			body, pos, ok = lenAt(p, pos, 4)
			body++
		case c == 0xca, c == 0xce, c == 0xd2:
			body = 4
		case c == 0xcb, c == 0xcf, c == 0xd3:
			body = 8
		case c == 0xcc, c == 0xd0:
			body = 1
		case c == 0xcd, c == 0xd1:
			body = 2
		case c == 0xd4:
			body = 2
		case c == 0xd5:
			body = 3
		case c == 0xd6:
			body = 5
		case c == 0xd7:
			body = 9
		case c == 0xd8:
			body = 17
		case c == 0xdc:
			items, pos, ok = lenAt(p, pos, 2)
		case c == 0xdd:
			items, pos, ok = lenAt(p, pos, 4)
		case c == 0xde:
			items, pos, ok = lenAt(p, pos, 2)
			items *= 2
		case c == 0xdf:
			items, pos, ok = lenAt(p, pos, 4)
			items *= 2
		}
		if (c >= 0xc4 && c <= 0xc9) || (c >= 0xd9 && c <= 0xdf) {
			if !ok {
				return pos, errTruncated
			}
		}
		if body > len(p)-pos {
			return pos, errTruncated
		}
		pos += body
		pending += items
		// Every pending value needs at least one byte: a count beyond what
		// is left is a lie, caught here before it can drive any work.
		if pending > len(p)-pos {
			return pos, errTruncated
		}
	}
	return pos, nil
}

// lenAt reads a big-endian length of width bytes at pos.
func lenAt(p []byte, pos, width int) (int, int, bool) {
	if width > len(p)-pos {
		return 0, pos, false
	}
	var n int
	for i := 0; i < width; i++ {
		n = n<<8 | int(p[pos+i])
	}
	return n, pos + width, true
}

// arrayLen reads an array header and checks the declared count against the
// bytes left before anyone allocates for it.
func (x *decoder) arrayLen() (int, error) {
	at := x.pos()
	// A fixarray (up to 15 elements: events, their slots, extra keys)
	// straight from the payload; the library's Decoder call costs more
	// than the rest of reading a short array.
	if at < len(x.p) && x.p[at]&0xf0 == 0x90 {
		n, left := int(x.p[at]&0x0f), len(x.p)-at-1
		if n > left {
			return 0, x.undecodable(at, "array declares %d elements, %d bytes left", n, left)
		}
		x.seek(at + 1)
		return n, nil
	}
	n, err := x.d.DecodeArrayLen()
	if err != nil {
		return 0, x.structural(at, "reading an array length", err)
	}
	if n > x.remaining() {
		return 0, x.undecodable(at, "array declares %d elements, %d bytes left", n, x.remaining())
	}
	return n, nil
}

func (x *decoder) mapLen() (int, error) {
	at := x.pos()
	if at < len(x.p) && x.p[at]&0xf0 == 0x80 { // a fixmap, as arrayLen's fixarray
		n, left := int(x.p[at]&0x0f), len(x.p)-at-1
		if n > left/2 {
			return 0, x.undecodable(at, "map declares %d entries, %d bytes left", n, left)
		}
		x.seek(at + 1)
		return n, nil
	}
	n, err := x.d.DecodeMapLen()
	if err != nil {
		return 0, x.structural(at, "reading a map length", err)
	}
	if n > x.remaining()/2 {
		return 0, x.undecodable(at, "map declares %d entries, %d bytes left", n, x.remaining())
	}
	return n, nil
}

// rawBytes reads a str or bin value and returns its bytes, aliasing the
// payload (callers copy what they keep).
func (x *decoder) rawBytes() ([]byte, error) {
	at := x.pos()
	// A fixstr (up to 31 bytes: tags, keys, media, LoRA names) straight
	// from the payload, as arrayLen reads a fixarray.
	if at < len(x.p) && x.p[at]&0xe0 == 0xa0 {
		n, start := int(x.p[at]&0x1f), at+1
		if n > len(x.p)-start {
			return nil, x.undecodable(at, "string declares %d bytes, %d left", n, len(x.p)-start)
		}
		x.seek(start + n)
		return x.p[start : start+n], nil
	}
	n, err := x.d.DecodeBytesLen()
	if err != nil {
		return nil, x.structural(at, "reading a string length", err)
	}
	if n < 0 {
		return nil, nil
	}
	start := x.pos()
	if n > len(x.p)-start {
		return nil, x.undecodable(at, "string declares %d bytes, %d left", n, len(x.p)-start)
	}
	x.seek(start + n)
	return x.p[start : start+n], nil
}

func isStr(c byte) bool { return (c >= 0xa0 && c <= 0xbf) || (c >= 0xd9 && c <= 0xdb) }
func isBin(c byte) bool { return c >= 0xc4 && c <= 0xc6 }
func isUnsignedCode(c byte) bool {
	return c <= 0x7f || (c >= 0xcc && c <= 0xcf)
}
func isSignedCode(c byte) bool { return c >= 0xe0 || (c >= 0xd0 && c <= 0xd3) }
func isIntCode(c byte) bool    { return isUnsignedCode(c) || isSignedCode(c) }
func isArray(c byte) bool      { return (c >= 0x90 && c <= 0x9f) || c == 0xdc || c == 0xdd }
func isMap(c byte) bool        { return (c >= 0x80 && c <= 0x8f) || c == 0xde || c == 0xdf }

// intValue reads any msgpack integer. neg is true for a negative value;
// otherwise u holds it (up to 2^64-1). ok is false (and the value skipped)
// for anything that is not an integer, bools included.
func (x *decoder) intValue() (u uint64, neg bool, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, false, false, err
	}
	if !isIntCode(c) {
		return 0, false, false, x.skip()
	}
	at := x.pos()
	if isUnsignedCode(c) {
		u, err = x.d.DecodeUint64()
	} else {
		var v int64
		v, err = x.d.DecodeInt64()
		u, neg = uint64(v), v < 0
	}
	if err != nil {
		return 0, false, false, x.structural(at, "reading an integer", err)
	}
	return u, neg, true, nil
}

// signed reads an integer that must fit int64 (block_size, lora_id).
func (x *decoder) signed() (int64, bool, error) {
	u, neg, ok, err := x.intValue()
	if err != nil || !ok {
		return 0, false, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, false, nil
	}
	return int64(u), true, nil
}

// unsigned32 reads an integer in [0, 2^32) (group_idx, sliding window).
func (x *decoder) unsigned32() (optU32, error) {
	u, neg, ok, err := x.intValue()
	if err != nil || !ok || neg || u > math.MaxUint32 {
		return optU32{}, err
	}
	return optU32{v: uint32(u), ok: true}, nil
}

// hash folds one block hash to the proto's int64 identity (N6): an integer
// keeps its 64-bit pattern, bytes of any length keep their last eight bytes
// read big-endian. Anything else is unreadable.
func (x *decoder) hash() (int64, bool, error) {
	c, err := x.peek()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == 0xcf || c == 0xd3:
		// The common 64-bit hash, read straight from the payload.
		at := x.pos()
		if len(x.p)-at < 9 {
			return 0, false, x.undecodable(at, "hash: %v", errTruncated)
		}
		var u uint64
		for _, b := range x.p[at+1 : at+9] {
			u = u<<8 | uint64(b)
		}
		x.seek(at + 9)
		return int64(u), true, nil
	case isIntCode(c):
		u, _, _, err := x.intValue()
		return int64(u), err == nil, err
	case isBin(c):
		b, err := x.rawBytes()
		if err != nil {
			return 0, false, err
		}
		return foldBytes(b), true, nil
	}
	return 0, false, x.skip()
}

func foldBytes(b []byte) int64 {
	if len(b) > 8 {
		b = b[len(b)-8:]
	}
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return int64(v)
}

// text reads a str value; anything else (bin included, as msgspec hands
// Python bytes) is skipped and reads as absent.
func (x *decoder) text(intern bool) (optString, error) {
	c, err := x.peek()
	if err != nil {
		return optString{}, err
	}
	if !isStr(c) {
		return optString{}, x.skip()
	}
	b, err := x.rawBytes()
	if err != nil {
		return optString{}, err
	}
	if !intern {
		return optString{s: string(b), ok: true}, nil
	}
	return optString{s: x.internString(b), ok: true}, nil
}

// internString keeps one copy of the short strings every event repeats
// (media, kinds, LoRA names, salts), bounded so hostile input cannot grow it
// without limit.
func (x *decoder) internString(b []byte) string {
	// vLLM repeats a store's LoRA name in every block's extra keys: the
	// last string interned answers those without hashing it again.
	if string(b) == x.lastIntern {
		return x.lastIntern
	}
	if s, ok := x.intern[string(b)]; ok {
		x.lastIntern = s
		return s
	}
	s := string(b)
	if len(b) <= internMaxLen && len(x.intern) < internMaxEntries {
		x.intern[s] = s
	}
	x.lastIntern = s
	return s
}

// decode reads one payload's envelope and events into x.events.
func (x *decoder) decode(payload []byte) error {
	x.p = payload
	x.r.Reset(payload)
	x.d.ResetReader(&x.r)
	x.events = x.events[:0]
	x.hashes = x.hashes[:0]
	x.tokens = x.tokens[:0]
	clear(x.keys) // drop the last batch's blobs and lists
	clear(x.keyLists)
	x.keys = x.keys[:0]
	x.keyLists = x.keyLists[:0]
	x.ts, x.rank, x.hasRank = 0, 0, false
	x.total, x.unknown, x.malformed = 0, 0, 0
	x.skipped = x.skipped[:0]

	c, err := x.peek()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		return x.arrayEnvelope()
	case isMap(c):
		return x.mapEnvelope()
	}
	return x.undecodable(0, "envelope is msgpack code 0x%02x, not [ts, events, rank]", c)
}

func (x *decoder) arrayEnvelope() error {
	n, err := x.arrayLen()
	if err != nil {
		return err
	}
	if n < 2 {
		return x.undecodable(0, "envelope has %d elements, want [ts, events, rank?]", n)
	}
	if err := x.timestamp(); err != nil {
		return err
	}
	if err := x.eventList(); err != nil {
		return err
	}
	if n > 2 {
		if err := x.rankValue(); err != nil {
			return err
		}
	}
	for i := 3; i < n; i++ {
		if err := x.skip(); err != nil {
			return err
		}
	}
	return nil
}

// mapEnvelope tolerates a batch encoded as a map (a vLLM PR-branch state
// that never shipped; cheap to accept).
func (x *decoder) mapEnvelope() error {
	n, err := x.mapLen()
	if err != nil {
		return err
	}
	sawEvents := false
	for i := 0; i < n; i++ {
		key, ok, err := x.mapKey()
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		switch string(key) {
		case "ts":
			err = x.timestamp()
		case "events":
			if sawEvents {
				return x.undecodable(x.pos(), "envelope map repeats \"events\"")
			}
			sawEvents = true
			err = x.eventList()
		case "data_parallel_rank", "attn_dp_rank", "dp_rank":
			err = x.rankValue()
		default:
			err = x.skip()
		}
		if err != nil {
			return err
		}
	}
	if !sawEvents {
		return x.undecodable(0, "envelope map has no \"events\"")
	}
	return nil
}

// timestamp reads ts; a value that is not a number reads as 0 (as the
// Python relay does).
func (x *decoder) timestamp() error {
	c, err := x.peek()
	if err != nil {
		return err
	}
	at := x.pos()
	switch {
	case c == 0xca || c == 0xcb:
		x.ts, err = x.d.DecodeFloat64()
	case isUnsignedCode(c):
		var u uint64
		u, err = x.d.DecodeUint64()
		x.ts = float64(u)
	case isSignedCode(c):
		var v int64
		v, err = x.d.DecodeInt64()
		x.ts = float64(v)
	default:
		x.ts = 0
		return x.skip()
	}
	if err != nil {
		return x.structural(at, "reading ts", err)
	}
	return nil
}

// rankValue reads the payload's rank; nil, a non-integer or a value outside
// int32 reads as none.
func (x *decoder) rankValue() error {
	u, neg, ok, err := x.intValue()
	if err != nil || !ok {
		return err
	}
	v := int64(u)
	if !neg && u > math.MaxInt32 || v < math.MinInt32 {
		return nil
	}
	x.rank, x.hasRank = int32(v), true
	return nil
}

func (x *decoder) eventList() error {
	c, err := x.peek()
	if err != nil {
		return err
	}
	if !isArray(c) {
		return x.undecodable(x.pos(), "events is msgpack code 0x%02x, not an array", c)
	}
	n, err := x.arrayLen()
	if err != nil {
		return err
	}
	x.total = n
	for i := 0; i < n; i++ {
		ev := wireEvent{index: i}
		if err := x.event(&ev); err != nil {
			return err
		}
		switch ev.kind {
		case kindStored, kindRemoved, kindCleared:
			// Only events that can be forwarded are kept: a hostile batch of
			// one-byte junk events costs counters, not memory.
			x.events = append(x.events, ev)
		case kindUnknown:
			x.unknown++
			x.noteSkipped(ev)
		default:
			x.malformed++
			x.noteSkipped(ev)
		}
	}
	return nil
}

func (x *decoder) event(ev *wireEvent) error {
	c, err := x.peek()
	if err != nil {
		return err
	}
	switch {
	case isMap(c):
		return x.mapEvent(ev)
	case isArray(c):
		return x.arrayEvent(ev)
	}
	ev.kind, ev.missing = kindMalformed, "event"
	return x.skip()
}

func (x *decoder) mapEvent(ev *wireEvent) error {
	n, err := x.mapLen()
	if err != nil {
		return err
	}
	kind := kindMalformed
	for i := 0; i < n; i++ {
		key, ok, err := x.mapKey()
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		id := mapField(key)
		if id == fType {
			tag, err := x.tagValue()
			if err != nil {
				return err
			}
			if tag == nil {
				ev.tag, kind = fieldBad, kindMalformed
			} else {
				ev.tag, kind = fieldOK, tagKind(tag)
			}
			continue
		}
		if err := x.field(ev, id); err != nil {
			return err
		}
	}
	ev.kind = kind
	ev.finish()
	return nil
}

// tagValue reads an event tag; nil means it is not text.
func (x *decoder) tagValue() ([]byte, error) {
	c, err := x.peek()
	if err != nil {
		return nil, err
	}
	if !isStr(c) {
		return nil, x.skip()
	}
	b, err := x.rawBytes()
	if b == nil && err == nil {
		b = []byte{}
	}
	return b, err
}

func (x *decoder) arrayEvent(ev *wireEvent) error {
	n, err := x.arrayLen()
	if err != nil {
		return err
	}
	if n == 0 {
		ev.kind, ev.missing = kindMalformed, "type"
		return nil
	}
	tag, err := x.tagValue()
	if err != nil {
		return err
	}
	var slots []fieldID
	if tag == nil {
		ev.tag = fieldBad
	} else {
		ev.tag = fieldOK
		ev.kind = tagKind(tag)
		switch ev.kind {
		case kindStored:
			slots = storedSlots[:]
		case kindRemoved:
			slots = removedSlots[:]
		case kindCleared:
			slots = clearedSlots[:]
		}
	}
	for i := 1; i < n; i++ {
		id := fSkip
		if i-1 < len(slots) {
			id = slots[i-1]
		}
		// SGLang's salted store (#30827) appends {"cache_salt": s} where
		// vLLM has lora_name. smg cannot tell the two apart and loses the
		// salt; the dialect tells us which engine wrote it.
		if id == fLoraName && ev.kind == kindStored && x.dialect == SGLang {
			id = fSGLangSlot7
		}
		if err := x.field(ev, id); err != nil {
			return err
		}
	}
	ev.finish()
	return nil
}

// finish settles a decoded event's kind from its required fields (N5).
func (ev *wireEvent) finish() {
	switch {
	case ev.tag != fieldOK:
		ev.kind, ev.missing = kindMalformed, "type"
	case ev.kind == kindStored:
		switch {
		case ev.hashState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "block_hashes"
		case ev.tokState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "token_ids"
		case ev.sizeState != fieldOK:
			ev.kind, ev.missing = kindMalformed, "block_size"
		}
	case ev.kind == kindRemoved:
		if ev.hashState != fieldOK {
			ev.kind, ev.missing = kindMalformed, "block_hashes"
		}
	}
}

func okState(ok bool) fieldState {
	if ok {
		return fieldOK
	}
	return fieldBad
}

// field decodes the current value into the event field id names. Readable
// but wrongly typed values leave optional fields absent and mark required
// ones bad; only structural failures return an error.
func (x *decoder) field(ev *wireEvent, id fieldID) error {
	var err error
	switch id {
	case fHashes:
		var ok bool
		ev.hashOff, ev.hashN, ok, err = x.hashList()
		ev.hashState = okState(ok)
	case fParent:
		var v int64
		var ok bool
		v, ok, err = x.hash()
		ev.parent = optI64{v: v, ok: ok}
	case fTokens:
		var ok bool
		ev.tokOff, ev.tokN, ev.bigram, ok, err = x.tokenList()
		ev.tokState = okState(ok)
	case fBlockSize:
		var ok bool
		ev.blockSize, ok, err = x.signed()
		ev.sizeState = okState(ok)
	case fLoraID:
		var v int64
		var ok bool
		v, ok, err = x.signed()
		ev.loraID = optI64{v: v, ok: ok}
	case fMedium:
		ev.medium, err = x.text(true)
	case fLoraName:
		ev.loraName, err = x.text(true)
	case fCacheSalt:
		ev.cacheSalt, err = x.text(true)
	case fKind:
		ev.specKind, err = x.text(true)
	case fLocality:
		ev.locality, err = x.text(true)
	case fOwnership:
		ev.ownership, err = x.text(true)
	case fSession:
		ev.sessionID, err = x.text(false)
	case fGroup:
		ev.groupIdx, err = x.unsigned32()
	case fWindow:
		ev.window, err = x.unsigned32()
	case fExtraKeys:
		ev.extraKeys, err = x.extraKeys()
	case fSGLangSlot7:
		err = x.sglangSlot7(ev)
	default:
		err = x.skip()
	}
	return err
}

// sglangSlot7 reads SGLang's 8th store element: the metadata map of a salted
// store, or (never seen from SGLang, but harmless) a vLLM-style lora_name.
func (x *decoder) sglangSlot7(ev *wireEvent) error {
	c, err := x.peek()
	if err != nil {
		return err
	}
	if isStr(c) {
		ev.loraName, err = x.text(true)
		return err
	}
	if !isMap(c) {
		return x.skip()
	}
	n, err := x.mapLen()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		key, ok, err := x.mapKey()
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		switch string(key) {
		case "cache_salt":
			ev.cacheSalt, err = x.text(true)
		case "session_id":
			ev.sessionID, err = x.text(false)
		default:
			err = x.skip()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (x *decoder) hashList() (off, n int, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, 0, false, err
	}
	if !isArray(c) {
		return 0, 0, false, x.skip()
	}
	count, err := x.arrayLen()
	if err != nil {
		return 0, 0, false, err
	}
	off = len(x.hashes)
	ok = true
	p, pos := x.p, x.pos()
	for i := 0; i < count; i++ {
		// The common 64-bit hash, straight from the payload; every other
		// form goes through hash.
		if q := p[pos:]; len(q) >= 9 && (q[0] == 0xcf || q[0] == 0xd3) {
			if ok {
				x.hashes = append(x.hashes, int64(binary.BigEndian.Uint64(q[1:9])))
			}
			pos += 9
			continue
		}
		x.seek(pos)
		v, good, err := x.hash()
		pos = x.pos()
		if err != nil {
			return 0, 0, false, err
		}
		if !good {
			ok = false
			continue
		}
		if ok {
			x.hashes = append(x.hashes, v)
		}
	}
	x.seek(pos)
	if !ok {
		x.hashes = x.hashes[:off]
		return 0, 0, false, nil
	}
	return off, count, true, nil
}

// tokenList reads token_ids (N7): every cell a uint32, or every cell a
// [u32, u32] bigram folded to its first word. It walks the payload bytes
// directly: this loop is most of the decoding work, and the generic
// Decoder calls cost several times more per token.
func (x *decoder) tokenList() (off, n int, bigram, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, 0, false, false, err
	}
	if !isArray(c) {
		return 0, 0, false, false, x.skip()
	}
	count, err := x.arrayLen()
	if err != nil {
		return 0, 0, false, false, err
	}
	off = len(x.tokens)
	if cap(x.tokens)-off < count {
		grown := make([]uint32, off, 2*cap(x.tokens)+count)
		copy(grown, x.tokens)
		x.tokens = grown
	}
	out := x.tokens[off : off+count]
	p := x.p
	pos := x.pos()
	ok = true
	// Every cell that is not a pair and not bad is plain, so the mix check
	// needs only the pairs counted.
	pairs := 0
	for i := range out {
		// A uint16 or uint32 cell, most ids of a real vocabulary and about
		// evenly split between the two: one branch for both, the value and
		// width then computed from the code (0xcd or 0xce) without a
		// branch on which, as that branch mispredicts on about every other
		// id. Four bytes are read either way, so this needs five left.
		if q := p[pos:]; len(q) >= 5 && q[0]-0xcd <= 1 {
			ce := int(q[0] - 0xcd) // 0 for uint16, 1 for uint32
			out[i] = binary.BigEndian.Uint32(q[1:5]) >> (16 - 16*ce)
			pos += 3 + 2*ce
			continue
		}
		// The other widths token ids use, inline; everything else below.
		if pos < len(p) {
			switch c := p[pos]; {
			case c <= 0x7f:
				out[i] = uint32(c)
				pos++
				continue
			case c == 0xcd:
				if q := p[pos:]; len(q) >= 3 {
					out[i] = uint32(q[1])<<8 | uint32(q[2])
					pos += 3
					continue
				}
			case c == 0xce:
				if q := p[pos:]; len(q) >= 5 {
					out[i] = binary.BigEndian.Uint32(q[1:5])
					pos += 5
					continue
				}
			}
		}
		if pos >= len(p) {
			return 0, 0, false, false, x.undecodable(pos, "token_ids: %v", errTruncated)
		}
		c := p[pos]
		if c == 0x92 {
			first, next, good, gerr := uint32At(p, pos+1)
			if gerr == nil && good {
				_, next2, good2, gerr2 := uint32At(p, next)
				if gerr2 == nil {
					if good2 {
						out[i] = first
						pairs++
						pos = next2
						continue
					}
				}
			}
			// fall through to the generic skip below
		} else {
			v, next, good, gerr := uint32At(p, pos)
			if gerr == nil && good {
				out[i] = v
				pos = next
				continue
			}
		}
		ok = false
		end, serr := skipAt(p, pos)
		if serr != nil {
			return 0, 0, false, false, x.undecodable(pos, "token_ids: %v", serr)
		}
		pos = end
	}
	x.seek(pos)
	if !ok || (pairs > 0 && pairs < count) {
		return 0, 0, false, false, nil
	}
	x.tokens = x.tokens[:off+count]
	return off, count, pairs > 0, true, nil
}

// uint32At reads an integer cell at pos. good is false for a value that is
// not an integer in [0, 2^32); err reports a truncated cell.
func uint32At(p []byte, pos int) (v uint32, next int, good bool, err error) {
	if pos >= len(p) {
		return 0, pos, false, errTruncated
	}
	c := p[pos]
	var width int
	signed := false
	switch {
	case c <= 0x7f:
		return uint32(c), pos + 1, true, nil
	case c >= 0xe0:
		return 0, pos + 1, false, nil
	case c == 0xcc:
		width = 1
	case c == 0xcd:
		width = 2
	case c == 0xce:
		width = 4
	case c == 0xcf:
		width = 8
	case c == 0xd0:
		width, signed = 1, true
	case c == 0xd1:
		width, signed = 2, true
	case c == 0xd2:
		width, signed = 4, true
	case c == 0xd3:
		width, signed = 8, true
	default:
		return 0, pos, false, nil
	}
	if width > len(p)-pos-1 {
		return 0, pos, false, errTruncated
	}
	var u uint64
	for i := 1; i <= width; i++ {
		u = u<<8 | uint64(p[pos+i])
	}
	next = pos + 1 + width
	if signed && p[pos+1]&0x80 != 0 {
		return 0, next, false, nil
	}
	if u > math.MaxUint32 {
		return 0, next, false, nil
	}
	return uint32(u), next, true, nil
}

// extraKeys reads vLLM's per-block extra_keys (N9). A value that is not a
// list reads as absent; a block entry that is not a list gives that block
// none.
func (x *decoder) extraKeys() ([][]extraKey, error) {
	c, err := x.peek()
	if err != nil {
		return nil, err
	}
	if !isArray(c) {
		return nil, x.skip()
	}
	n, err := x.arrayLen()
	if err != nil {
		return nil, err
	}
	// The keys and the per-block lists live in the decoder's slabs, reused
	// batch after batch (vLLM puts a LoRA name on every block of an
	// adapter's store: two allocations a block were most of a vLLM batch's
	// decoding allocations). A slab that grows leaves earlier lists
	// pointing at its old array, whose contents never change.
	start := len(x.keyLists)
	present := false
	// lastRaw is the previous block's list as msgpack bytes. A block whose
	// next bytes repeat them holds the same list (a msgpack value ends
	// where its bytes say, so equal leading bytes are an equal value), and
	// vLLM repeats a LoRA store's list on every block: it gets the
	// previous block's keys, not a parse of its own.
	var lastRaw []byte
	for i := 0; i < n; i++ {
		at := x.pos()
		if len(lastRaw) > 0 && len(x.p)-at >= len(lastRaw) && bytes.Equal(x.p[at:at+len(lastRaw)], lastRaw) {
			x.seek(at + len(lastRaw))
			x.keyLists = append(x.keyLists, x.keyLists[len(x.keyLists)-1])
			continue
		}
		c, err := x.peek()
		if err != nil {
			return nil, err
		}
		if !isArray(c) {
			if err := x.skip(); err != nil {
				return nil, err
			}
			x.keyLists = append(x.keyLists, nil)
			lastRaw = nil
			continue
		}
		items, err := x.arrayLen()
		if err != nil {
			return nil, err
		}
		present = true
		off := len(x.keys)
		shareable := true // a blob is copied per block: callers own each
		for j := 0; j < items; j++ {
			key, ok, err := x.extraKey()
			if err != nil {
				return nil, err
			}
			if ok {
				x.keys = append(x.keys, key)
				shareable = shareable && key.kind != extraBlob
			}
		}
		x.keyLists = append(x.keyLists, x.keys[off:len(x.keys):len(x.keys)])
		lastRaw = nil
		if shareable {
			lastRaw = x.p[at:x.pos()]
		}
	}
	if !present {
		// Absent, or every block said nil: nothing to carry.
		x.keyLists = x.keyLists[:start]
		return nil, nil
	}
	return x.keyLists[start:len(x.keyLists):len(x.keyLists)], nil
}

// extraKey reads one item: text, an int64, bytes, or [text, int] as a
// multimodal key. Other shapes (bools, floats, maps, nil) are not modelled
// and dropped, as both smg relays do in the end.
func (x *decoder) extraKey() (extraKey, bool, error) {
	c, err := x.peek()
	if err != nil {
		return extraKey{}, false, err
	}
	switch {
	case isStr(c):
		s, err := x.text(true)
		return extraKey{kind: extraText, text: s.s}, err == nil, err
	case isIntCode(c):
		v, ok, err := x.signed()
		return extraKey{kind: extraNumber, num: v}, ok, err
	case isBin(c):
		b, err := x.rawBytes()
		if err != nil {
			return extraKey{}, false, err
		}
		return extraKey{kind: extraBlob, blob: bytes.Clone(b)}, true, nil
	case c == 0x92:
		start := x.pos()
		if _, err := x.arrayLen(); err != nil {
			return extraKey{}, false, err
		}
		c, err := x.peek()
		if err != nil {
			return extraKey{}, false, err
		}
		if isStr(c) {
			id, err := x.text(true)
			if err != nil {
				return extraKey{}, false, err
			}
			u, neg, ok, err := x.intValue()
			if err != nil {
				return extraKey{}, false, err
			}
			if ok {
				offset := int64(u)
				if !neg && u > math.MaxInt64 {
					offset = math.MaxInt64 // as the Rust relay clamps it
				}
				return extraKey{kind: extraMultimodal, text: id.s, num: offset}, true, nil
			}
			return extraKey{}, false, nil
		}
		x.seek(start)
	}
	return extraKey{}, false, x.skip()
}

// mapKey reads one map key. A key that is not a string cannot name a field:
// it is skipped with its value, and ok is false.
func (x *decoder) mapKey() (key []byte, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return nil, false, err
	}
	if !isStr(c) {
		if err := x.skip(); err != nil {
			return nil, false, err
		}
		return nil, false, x.skip()
	}
	key, err = x.rawBytes()
	return key, err == nil, err
}
