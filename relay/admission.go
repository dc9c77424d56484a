package relay

import (
	"errors"
	"fmt"

	"github.com/kvrelay/kvrelay/engines/wire"
)

// verdict is what admission makes of one live batch of a rank.
type verdict int

const (
	accept verdict = iota
	duplicate
	gap
	restart
)

// restartReason names why a batch reads as a new publisher incarnation; the
// strings are the Rust relay's.
type restartReason string

const (
	notRestart          restartReason = ""
	sequenceRegression  restartReason = "sequence_regression"
	startupClearRestart restartReason = "startup_clear"
	counterRestarted    restartReason = "counter_restarted"
	// replayMismatch is kvrelay's own: the engine's replay holds a different
	// batch at the relay's cursor, or nothing at or after it.
	replayMismatch restartReason = "replay_mismatch"
	// sequenceJump is kvrelay's own: a batch so far ahead of the cursor
	// that, after the engine's replay ring (window batches) gave all it
	// can, the hole left would still be wider than the ring. A single
	// forged or corrupt sequence can make that distance 2^63, and a
	// subscriber missing that many batches needs a resync anyway: the
	// stream continues from the batch as a new incarnation (subscribers get
	// DATA_LOSS and come back through a snapshot), and no such hole, nor
	// lost count, is recorded.
	sequenceJump restartReason = "sequence_jump"
)

// admission is the Rust relay's table (relay-semantics §3.4), checked in
// order, with one rule of kvrelay's: a gap longer than maxGap is a
// sequenceJump. maxGap is what keeps every hole within the engine's replay
// ring: twice the ring with a replay endpoint (the ring fills the end of the
// gap, at most a ring's worth is left), the ring without one (nothing is
// filled). A burst of live drops a little longer than the ring stays a gap.
// hasCursor is false before the rank's first batch of an incarnation. The
// arithmetic never computes last+1, which wraps to 0 after a batch at
// 2^64-1: everything after such a batch is a regression.
func admit(hasCursor bool, last, seq uint64, startupClear bool, maxGap uint64) (verdict, restartReason) {
	switch {
	case !hasCursor:
		return accept, notRestart
	case seq > last && seq-last == 1:
		// A clear right after the cursor is a cache flush, not a restart.
		return accept, notRestart
	case seq > last && seq-last-1 > maxGap:
		return restart, sequenceJump
	case seq > last:
		return gap, notRestart
	case seq <= 1 && last >= 2:
		return restart, counterRestarted
	case seq < last:
		return restart, sequenceRegression
	case startupClear:
		return restart, startupClearRestart
	default:
		return duplicate, notRestart
	}
}

// joinedLate reports whether the first batch of an incarnation leaves earlier
// batches to recover: the publisher was already counting and the batch is
// not the engine's startup clear.
func joinedLate(seq uint64, startupClear bool) bool {
	return seq > 1 && !startupClear
}

// startsWithClear reports whether a msgpack batch payload's first event is
// AllBlocksCleared, in either the tagged-map or the tag-first-array form.
// Admission needs this before the batch is normalized (normalizing a
// duplicate would corrupt the normalizer's per-hash record), so it reads only
// the envelope header and the first event. Anything it cannot read is "no".
func startsWithClear(payload []byte) bool {
	ok, _ := peekFirstEventIsClear(payload)
	return ok
}

var clearTag = []byte("AllBlocksCleared")

// peekFirstEventIsClear reads the payload bytes directly: the envelope
// header, the events list header and the first event's tag. Everything it
// passes over goes through wire.SkipValue, which is iterative, so a payload
// nested ten million levels deep costs one pass over its bytes and no stack
// (msgpack/v5's Decoder.Skip recursed once per level and overflowed the
// goroutine stack). The walk itself is a fixed four levels deep.
func peekFirstEventIsClear(payload []byte) (bool, error) {
	c := msgpackCursor{p: payload}
	kind, n, err := c.container()
	if err != nil {
		return false, fmt.Errorf("envelope: %w", err)
	}
	switch kind {
	case msgpackArray:
		// [ts, events, ...]
		if n < 2 {
			return false, nil
		}
		if err := c.skip(); err != nil { // ts
			return false, err
		}
	case msgpackMap:
		// {ts, events, rank}: find the events key.
		found, err := c.findKey(n, "events")
		if err != nil || !found {
			return false, err
		}
	default:
		return false, fmt.Errorf("envelope is neither an array nor a map (code %#x)", payload[0])
	}
	kind, n, err = c.container()
	if err != nil || kind != msgpackArray || n < 1 {
		return false, err
	}
	kind, n, err = c.container()
	if err != nil {
		return false, err
	}
	switch kind {
	case msgpackArray:
		// [tag, fields...]
		if n < 1 {
			return false, nil
		}
		tag, err := c.text()
		return err == nil && tag == string(clearTag), err
	case msgpackMap:
		// {type: tag, fields...}
		found, err := c.findKey(n, "type")
		if err != nil || !found {
			return false, err
		}
		tag, err := c.text()
		return err == nil && tag == string(clearTag), err
	}
	return false, nil
}

type msgpackKind int

const (
	msgpackOther msgpackKind = iota
	msgpackArray
	msgpackMap
)

// msgpackCursor reads msgpack headers from a byte slice. It never allocates
// for a declared length: strings are sliced out of the payload after their
// length is checked against the bytes left.
type msgpackCursor struct {
	p   []byte
	pos int
}

var errMsgpackTruncated = errors.New("msgpack truncated")

// uint reads a big-endian length of width bytes.
func (c *msgpackCursor) uint(width int) (int, error) {
	if width > len(c.p)-c.pos {
		return 0, errMsgpackTruncated
	}
	n := 0
	for _, b := range c.p[c.pos : c.pos+width] {
		n = n<<8 | int(b)
	}
	c.pos += width
	return n, nil
}

// container reads an array or map header and returns its element count (a
// map's count is its number of pairs). Any other value is left unread and
// reported as msgpackOther.
func (c *msgpackCursor) container() (msgpackKind, int, error) {
	if c.pos >= len(c.p) {
		return msgpackOther, 0, errMsgpackTruncated
	}
	code := c.p[c.pos]
	var (
		kind  msgpackKind
		n     int
		width int
	)
	switch {
	case code >= 0x90 && code <= 0x9f:
		kind, n = msgpackArray, int(code&0x0f)
	case code >= 0x80 && code <= 0x8f:
		kind, n = msgpackMap, int(code&0x0f)
	case code == 0xdc:
		kind, width = msgpackArray, 2
	case code == 0xdd:
		kind, width = msgpackArray, 4
	case code == 0xde:
		kind, width = msgpackMap, 2
	case code == 0xdf:
		kind, width = msgpackMap, 4
	default:
		return msgpackOther, 0, nil
	}
	c.pos++
	if width > 0 {
		var err error
		if n, err = c.uint(width); err != nil {
			return kind, 0, err
		}
	}
	// Every element takes at least a byte: a count beyond what is left is
	// a lie.
	if n > len(c.p)-c.pos {
		return kind, 0, fmt.Errorf("container declares %d elements, %d bytes left: %w", n, len(c.p)-c.pos, errMsgpackTruncated)
	}
	return kind, n, nil
}

func (c *msgpackCursor) skip() error {
	end, err := wire.SkipValue(c.p, c.pos)
	if err != nil {
		return err
	}
	c.pos = end
	return nil
}

// text reads a string (or, leniently, bytes) value; any other value is
// skipped and reads as "".
func (c *msgpackCursor) text() (string, error) {
	if c.pos >= len(c.p) {
		return "", errMsgpackTruncated
	}
	code := c.p[c.pos]
	var n, width int
	switch {
	case code >= 0xa0 && code <= 0xbf:
		n = int(code & 0x1f)
	case code == 0xd9 || code == 0xc4:
		width = 1
	case code == 0xda || code == 0xc5:
		width = 2
	case code == 0xdb || code == 0xc6:
		width = 4
	default:
		return "", c.skip()
	}
	c.pos++
	if width > 0 {
		var err error
		if n, err = c.uint(width); err != nil {
			return "", err
		}
	}
	if n > len(c.p)-c.pos {
		return "", fmt.Errorf("string of %d bytes, %d left: %w", n, len(c.p)-c.pos, errMsgpackTruncated)
	}
	s := string(c.p[c.pos : c.pos+n])
	c.pos += n
	return s, nil
}

// findKey reads the keys of a map of n pairs, skipping their values, until
// key; the cursor is then at key's value.
func (c *msgpackCursor) findKey(n int, key string) (bool, error) {
	for i := 0; i < n; i++ {
		k, err := c.text()
		if err != nil {
			return false, err
		}
		if k == key {
			return true, nil
		}
		if err := c.skip(); err != nil {
			return false, err
		}
	}
	return false, nil
}
