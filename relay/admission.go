package relay

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
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
)

// admission is the Rust relay's table (relay-semantics §3.4), checked in
// order. hasCursor is false before the rank's first batch of an incarnation.
func admit(hasCursor bool, last, seq uint64, startupClear bool) (verdict, restartReason) {
	switch {
	case !hasCursor:
		return accept, notRestart
	case seq == last+1:
		// A clear right after the cursor is a cache flush, not a restart.
		return accept, notRestart
	case seq > last+1:
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

func peekFirstEventIsClear(payload []byte) (bool, error) {
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	code, err := d.PeekCode()
	if err != nil {
		return false, err
	}
	switch {
	case msgpcode.IsFixedArray(code) || code == msgpcode.Array16 || code == msgpcode.Array32:
		n, err := d.DecodeArrayLen()
		if err != nil || n < 2 {
			return false, err
		}
		if err := d.Skip(); err != nil { // ts
			return false, err
		}
	case msgpcode.IsFixedMap(code) || code == msgpcode.Map16 || code == msgpcode.Map32:
		// A map envelope {ts, events, rank}: find the events key.
		n, err := d.DecodeMapLen()
		if err != nil {
			return false, err
		}
		found := false
		for i := 0; i < n; i++ {
			k, err := decodeKey(d)
			if err != nil {
				return false, err
			}
			if k == "events" {
				found = true
				break
			}
			if err := d.Skip(); err != nil {
				return false, err
			}
		}
		if !found {
			return false, nil
		}
	default:
		return false, fmt.Errorf("envelope is neither an array nor a map (code %#x)", code)
	}
	n, err := d.DecodeArrayLen()
	if err != nil || n < 1 {
		return false, err
	}
	code, err = d.PeekCode()
	if err != nil {
		return false, err
	}
	switch {
	case msgpcode.IsFixedArray(code) || code == msgpcode.Array16 || code == msgpcode.Array32:
		m, err := d.DecodeArrayLen()
		if err != nil || m < 1 {
			return false, err
		}
		tag, err := decodeKey(d)
		return err == nil && tag == string(clearTag), err
	case msgpcode.IsFixedMap(code) || code == msgpcode.Map16 || code == msgpcode.Map32:
		m, err := d.DecodeMapLen()
		if err != nil {
			return false, err
		}
		for i := 0; i < m; i++ {
			k, err := decodeKey(d)
			if err != nil {
				return false, err
			}
			if k == "type" {
				tag, err := decodeKey(d)
				return err == nil && tag == string(clearTag), err
			}
			if err := d.Skip(); err != nil {
				return false, err
			}
		}
	}
	return false, nil
}

// decodeKey reads a string (or, leniently, bytes) value; anything else is
// skipped and reads as "".
func decodeKey(d *msgpack.Decoder) (string, error) {
	code, err := d.PeekCode()
	if err != nil {
		return "", err
	}
	if msgpcode.IsString(code) || msgpcode.IsBin(code) {
		// DecodeString grows its buffer as bytes arrive, so a forged
		// length cannot make it allocate up front.
		return d.DecodeString()
	}
	return "", d.Skip()
}
