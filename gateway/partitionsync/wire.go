package partitionsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
)

// The wire form, version 2. Every count and length a peer declares is
// checked against the bytes that remain (and a stated maximum) before it
// is used; nothing is allocated from a declared size. Version 2 added the
// partition count P to both messages: replicas of different P must never
// take each other's lookups (the subject and queue group carry P too, and
// a mismatch is refused and counted).
//
// A query (to <prefix>.lookup.<P>.<partition>):
//
//	byte     version (2)
//	byte     flags: bit 0 asks for engine load signals
//	uvarint  the asker's partition count P (2..gateway.MaxPartitions)
//	uvarint  model length (≤ MaxModelBytes), the model's bytes
//	uvarint  hash count (≤ MaxHashes), then that many 8-byte
//	         little-endian prefix hashes, filling the rest exactly
//
// An answer (to the query's reply subject):
//
//	byte     version (2)
//	uvarint  the answerer's partition count P (2..gateway.MaxPartitions)
//	uvarint  the answering partition (< P)
//	byte     status: 0 answered, 1 unknown model, 2 query refused
//	uvarint  the model's learned block size (0: none; ≤ MaxBlockSize)
//	uvarint  overlaps; each: name, uvarint blocks (1..MaxHashes)
//	uvarint  unreachable workers; each: name
//	uvarint  engine signals; each: name, byte flags (bit 0 token usage,
//	         bit 1 backlog), then the token usage as a little-endian
//	         float64 (in [0, 1]) if bit 0, the backlog as a uvarint
//	         (≤ MaxBacklog) if bit 1
//
// a name being a uvarint length (1..MaxNameBytes) and its bytes. No list
// names a worker twice (a merge would keep either entry).
const (
	Version = 2
	// MaxHashes bounds a query's prefix hashes: a 1 Mi-token request
	// (the gateway's default --max-request-tokens) at block size 16,
	// 512 KiB on the wire (NATS's default max_payload is 1 MiB). A longer
	// request scatters its first MaxHashes blocks.
	MaxHashes = 1 << 16
	// MaxModelBytes and MaxNameBytes bound a model's and a worker's name.
	MaxModelBytes = 1024
	MaxNameBytes  = 4096
	// MaxBlockSize bounds a reported block size.
	MaxBlockSize = 1 << 20
	// MaxBacklog bounds a reported backlog in tokens.
	MaxBacklog = math.MaxInt32
)

// Answer statuses.
const (
	statusAnswered     = 0
	statusUnknownModel = 1
	statusRefused      = 2
)

const flagLoads = 1

const (
	sigTokenUsage = 1
	sigBacklog    = 2
)

// Errors of the decoders.
var (
	ErrVersion   = errors.New("partitionsync: unknown wire version")
	ErrMalformed = errors.New("partitionsync: malformed message")
	ErrTooLarge  = errors.New("partitionsync: over a bound")
)

// appendQuery encodes q from a tier of parts partitions; q.Prefix must
// hold at most MaxHashes hashes.
func appendQuery(b []byte, parts int, q gateway.PartitionQuery) []byte {
	var flags byte
	if q.Loads {
		flags |= flagLoads
	}
	b = append(b, Version, flags)
	b = binary.AppendUvarint(b, uint64(parts))
	b = binary.AppendUvarint(b, uint64(len(q.Model)))
	b = append(b, q.Model...)
	b = binary.AppendUvarint(b, uint64(len(q.Prefix)))
	for _, h := range q.Prefix {
		b = binary.LittleEndian.AppendUint64(b, h)
	}
	return b
}

// reader walks a message, failing once and staying failed.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(err error, what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s", err, what)
	}
}

func (r *reader) byte(what string) byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 1 {
		r.fail(ErrMalformed, what+": truncated")
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uvarint(what string, most uint64) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(ErrMalformed, what+": bad varint")
		return 0
	}
	if v > most {
		r.fail(ErrTooLarge, fmt.Sprintf("%s %d > %d", what, v, most))
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a count of entries of at least minBytes each, checked against
// what remains.
func (r *reader) count(what string, minBytes int) int {
	n := r.uvarint(what, uint64(len(r.b)/minBytes))
	return int(n)
}

func (r *reader) bytes(what string, least, most int) []byte {
	l := r.uvarint(what+" length", uint64(most))
	if r.err != nil {
		return nil
	}
	if l < uint64(least) || l > uint64(len(r.b)) {
		r.fail(ErrMalformed, fmt.Sprintf("%s length %d (%d bytes left)", what, l, len(r.b)))
		return nil
	}
	v := r.b[:l]
	r.b = r.b[l:]
	return v
}

// partitions reads a partition count P (2..gateway.MaxPartitions).
func (r *reader) partitions() int {
	n := r.uvarint("partition count", gateway.MaxPartitions)
	if r.err == nil && n < 2 {
		r.fail(ErrMalformed, fmt.Sprintf("partition count %d", n))
	}
	return int(n)
}

// decodeQuery decodes a query into q, its prefix into q.Prefix's room,
// and returns the asker's partition count.
func decodeQuery(b []byte, q *gateway.PartitionQuery) (parts int, err error) {
	r := reader{b: b}
	if v := r.byte("version"); r.err == nil && v != Version {
		return 0, fmt.Errorf("%w: %d", ErrVersion, v)
	}
	flags := r.byte("flags")
	parts = r.partitions()
	model := r.bytes("model", 0, MaxModelBytes)
	n := r.uvarint("hash count", MaxHashes)
	if r.err != nil {
		return 0, r.err
	}
	if uint64(len(r.b)) != n*8 {
		return 0, fmt.Errorf("%w: %d hashes declared, %d bytes follow", ErrMalformed, n, len(r.b))
	}
	q.Model, q.Loads = string(model), flags&flagLoads != 0
	q.Prefix = q.Prefix[:0]
	for i := 0; i < len(r.b); i += 8 {
		q.Prefix = append(q.Prefix, binary.LittleEndian.Uint64(r.b[i:]))
	}
	return parts, nil
}

// appendAnswer encodes a partition's answer with status, from a tier of
// parts partitions.
func appendAnswer(b []byte, parts int, status byte, a *gateway.PartitionAnswer) []byte {
	b = append(b, Version)
	b = binary.AppendUvarint(b, uint64(parts))
	b = binary.AppendUvarint(b, uint64(a.Partition))
	b = append(b, status)
	b = binary.AppendUvarint(b, uint64(min(max(a.BlockSize, 0), MaxBlockSize)))
	b = binary.AppendUvarint(b, uint64(len(a.Matches)))
	for _, m := range a.Matches {
		b = appendName(b, m.Worker)
		b = binary.AppendUvarint(b, uint64(m.Blocks))
	}
	b = binary.AppendUvarint(b, uint64(len(a.Unreachable)))
	for _, w := range a.Unreachable {
		b = appendName(b, w)
	}
	b = binary.AppendUvarint(b, uint64(len(a.Signals)))
	for _, s := range a.Signals {
		b = appendName(b, s.Worker)
		var flags byte
		if s.HasTokenUsage {
			flags |= sigTokenUsage
		}
		if s.HasBacklog {
			flags |= sigBacklog
		}
		b = append(b, flags)
		if s.HasTokenUsage {
			// An engine reporting past [0, 1] must not cost the whole
			// answer (the decoder refuses it); NaN goes out as 1.
			u := s.TokenUsage
			if !(u <= 1) {
				u = 1
			}
			b = binary.LittleEndian.AppendUint64(b, math.Float64bits(max(u, 0)))
		}
		if s.HasBacklog {
			b = binary.AppendUvarint(b, uint64(min(max(s.Backlog, 0), MaxBacklog)))
		}
	}
	return b
}

func appendName(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// decodeAnswer decodes an answer into dst (reset first) and returns its
// status and the answerer's partition count.
func decodeAnswer(b []byte, dst *gateway.PartitionAnswer) (status byte, parts int, err error) {
	dst.Reset()
	r := reader{b: b}
	if v := r.byte("version"); r.err == nil && v != Version {
		return 0, 0, fmt.Errorf("%w: %d", ErrVersion, v)
	}
	parts = r.partitions()
	dst.Partition = int(r.uvarint("partition", uint64(max(parts, 1)-1)))
	status = r.byte("status")
	if r.err == nil && status > statusRefused {
		r.fail(ErrMalformed, fmt.Sprintf("status %d", status))
	}
	dst.BlockSize = int(r.uvarint("block size", MaxBlockSize))
	// An overlap takes at least 3 bytes (length, one name byte, blocks).
	for range r.count("overlaps", 3) {
		name := r.bytes("worker", 1, MaxNameBytes)
		blocks := r.uvarint("blocks", MaxHashes)
		if r.err == nil && blocks == 0 {
			r.fail(ErrMalformed, "an overlap of 0 blocks")
		}
		if r.err != nil {
			return 0, 0, r.err
		}
		dst.Matches = append(dst.Matches, index.Match{Worker: string(name), Blocks: int(blocks)})
	}
	for range r.count("unreachable", 2) {
		name := r.bytes("worker", 1, MaxNameBytes)
		if r.err != nil {
			return 0, 0, r.err
		}
		dst.Unreachable = append(dst.Unreachable, string(name))
	}
	for range r.count("signals", 3) {
		var s gateway.WorkerSignal
		name := r.bytes("worker", 1, MaxNameBytes)
		flags := r.byte("signal flags")
		if r.err == nil && flags&^(sigTokenUsage|sigBacklog) != 0 {
			r.fail(ErrMalformed, fmt.Sprintf("signal flags %#x", flags))
		}
		if flags&sigTokenUsage != 0 && r.err == nil {
			if len(r.b) < 8 {
				r.fail(ErrMalformed, "token usage: truncated")
			} else {
				u := math.Float64frombits(binary.LittleEndian.Uint64(r.b))
				r.b = r.b[8:]
				if !(u >= 0 && u <= 1) { // NaN and ±Inf too
					r.fail(ErrMalformed, fmt.Sprintf("token usage %v", u))
				}
				s.TokenUsage, s.HasTokenUsage = u, true
			}
		}
		if flags&sigBacklog != 0 {
			s.Backlog, s.HasBacklog = int(r.uvarint("backlog", MaxBacklog)), true
		}
		if r.err != nil {
			return 0, 0, r.err
		}
		s.Worker = string(name)
		dst.Signals = append(dst.Signals, s)
	}
	if r.err != nil {
		return 0, 0, r.err
	}
	if w, ok := repeated(dst.Matches, func(m *index.Match) string { return m.Worker }); ok {
		return 0, 0, fmt.Errorf("%w: worker %q overlaps twice", ErrMalformed, w)
	}
	if w, ok := repeated(dst.Unreachable, func(w *string) string { return *w }); ok {
		return 0, 0, fmt.Errorf("%w: worker %q unreachable twice", ErrMalformed, w)
	}
	if w, ok := repeated(dst.Signals, func(s *gateway.WorkerSignal) string { return s.Worker }); ok {
		return 0, 0, fmt.Errorf("%w: worker %q signalled twice", ErrMalformed, w)
	}
	if len(r.b) != 0 {
		return 0, 0, fmt.Errorf("%w: %d bytes after the answer", ErrMalformed, len(r.b))
	}
	return status, parts, nil
}

// repeated returns a name that two of xs carry. The lists come from a
// decoded message, so their length is bounded by its bytes.
func repeated[T any](xs []T, name func(*T) string) (string, bool) {
	if len(xs) <= 16 {
		for i := range xs {
			for j := range i {
				if n := name(&xs[i]); n == name(&xs[j]) {
					return n, true
				}
			}
		}
		return "", false
	}
	seen := make(map[string]struct{}, len(xs))
	for i := range xs {
		n := name(&xs[i])
		if _, ok := seen[n]; ok {
			return n, true
		}
		seen[n] = struct{}{}
	}
	return "", false
}
