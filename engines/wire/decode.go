package wire

import (
	"bytes"
	"errors"
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
