package placementsync

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
)

// A placement message is kvrelay's own compact binary encoding, one
// routing decision per message (the model is in the subject):
//
//	byte     version (1)
//	uvarint  worker name length, then the name's bytes
//	uvarint  hash count n
//	n × 8    prefix hashes, uint64 little-endian
//
// A 16-block placement is about 150 bytes. Fixed-width hashes (they are
// uniformly random, so varints would not shrink them) keep the decoder a
// bounds check and a loop.
const wireVersion = 1

// Decoder bounds: a peer's declared lengths are checked against them and
// against the bytes present before anything is allocated.
const (
	// MaxWorkerName bounds a worker name (an address or URL).
	MaxWorkerName = 1024
	// MaxHashes bounds one placement: 65,536 blocks is a million-token
	// prompt at block size 16.
	MaxHashes = 1 << 16
)

// Errors of the decoder.
var (
	ErrVersion   = errors.New("placementsync: unknown message version")
	ErrTruncated = errors.New("placementsync: truncated message")
	ErrTooLarge  = errors.New("placementsync: declared length over the limit")
	ErrTrailing  = errors.New("placementsync: bytes after the message")
)

// encode appends worker's placement of hashes to dst.
func encode(dst []byte, worker string, hashes []uint64) []byte {
	dst = append(dst, wireVersion)
	dst = binary.AppendUvarint(dst, uint64(len(worker)))
	dst = append(dst, worker...)
	dst = binary.AppendUvarint(dst, uint64(len(hashes)))
	for _, h := range hashes {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

// decode reads a message encode wrote.
func decode(b []byte) (worker string, hashes []uint64, err error) {
	if len(b) == 0 {
		return "", nil, ErrTruncated
	}
	if b[0] != wireVersion {
		return "", nil, fmt.Errorf("%w %d", ErrVersion, b[0])
	}
	b = b[1:]
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return "", nil, fmt.Errorf("%w: worker name length", ErrTruncated)
	}
	b = b[k:]
	if n > MaxWorkerName {
		return "", nil, fmt.Errorf("%w: worker name of %d bytes (max %d)", ErrTooLarge, n, MaxWorkerName)
	}
	if uint64(len(b)) < n {
		return "", nil, fmt.Errorf("%w: worker name of %d bytes, %d left", ErrTruncated, n, len(b))
	}
	worker, b = string(b[:n]), b[n:]
	if worker == "" {
		return "", nil, fmt.Errorf("placementsync: empty worker name")
	}
	n, k = binary.Uvarint(b)
	if k <= 0 {
		return "", nil, fmt.Errorf("%w: hash count", ErrTruncated)
	}
	b = b[k:]
	if n > MaxHashes {
		return "", nil, fmt.Errorf("%w: %d hashes (max %d)", ErrTooLarge, n, MaxHashes)
	}
	if uint64(len(b)) < 8*n {
		return "", nil, fmt.Errorf("%w: %d hashes, %d bytes left", ErrTruncated, n, len(b))
	}
	if uint64(len(b)) > 8*n {
		return "", nil, fmt.Errorf("%w: %d", ErrTrailing, uint64(len(b))-8*n)
	}
	hashes = make([]uint64, n)
	for i := range hashes {
		hashes[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return worker, hashes, nil
}

// DefaultSubjectPrefix is the subjects' first tokens: a model's placements
// go to DefaultSubjectPrefix + "." + its subject token.
const DefaultSubjectPrefix = "kvrelay.placements"

// subjectToken is model as one NATS subject token: as is when it is made
// of letters, digits, '-' and '_' (so `nats sub kvrelay.placements.llama`
// reads it), else "~" and its unpadded base64url, since '.', '*', '>' and
// white space would change the subject's meaning.
func subjectToken(model string) string {
	plain := model != ""
	for _, c := range model {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			plain = false
			break
		}
	}
	if plain {
		return model
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(model))
}

// modelOf inverts subjectToken.
func modelOf(token string) (string, error) {
	enc, ok := strings.CutPrefix(token, "~")
	if !ok {
		if token == "" {
			return "", errors.New("placementsync: empty model token")
		}
		return token, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil {
		return "", fmt.Errorf("placementsync: model token %q: %w", token, err)
	}
	return string(b), nil
}
